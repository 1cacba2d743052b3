// Command fwd joins its standard input and output to a TCP address: QEMU's user network
// runs it for each guest connection to a guestfwd address (guestfwd=...-cmd:fwd ADDR),
// which reaches a control plane the test serves on the host's loopback. A chardev
// guestfwd takes one connection for the whole run; the boot makes several.
package main

import (
	"fmt"
	"io"
	"net"
	"os"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: fwd HOST:PORT")
		os.Exit(2)
	}
	c, err := net.Dial("tcp", os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "fwd:", err)
		os.Exit(1)
	}
	done := make(chan struct{})
	go func() {
		io.Copy(os.Stdout, c)
		close(done)
	}()
	io.Copy(c, os.Stdin)
	c.(*net.TCPConn).CloseWrite()
	<-done
}
