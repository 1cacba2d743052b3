// Command pause is the program of the node test's sandbox image (images.Node, "pause"):
// what Kubernetes' build/pause/linux/pause.c does for a pod. It is the first process of
// the pod's sandbox and holds its namespaces: it sleeps until SIGINT or SIGTERM, then
// exits 0, and reaps every child it inherits (a pod sharing its PID namespace makes it
// the namespace's init, the parent of every orphan). Static, no libc: the image has
// nothing else.
//
//	pause       run
//	pause -v    print the version and exit
package main

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

// version is what -v prints; pause.c prints its VERSION the same way.
const version = "passage pause 1"

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		fmt.Println(version)
		return
	}
	if os.Getpid() != 1 {
		// pause.c's warning: nothing but reaping depends on it.
		fmt.Fprintln(os.Stderr, "Warning: pause should be the first process")
	}
	// One notification stands for any number of exited children (signals coalesce):
	// each SIGCHLD reaps until nothing is left to reap.
	sigs := make(chan os.Signal, 16)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	// A child that exited before Notify sent its SIGCHLD to the default action (none).
	reap()
	for s := range sigs {
		if s == syscall.SIGCHLD {
			reap()
			continue
		}
		fmt.Fprintf(os.Stderr, "Shutting down, got signal: %v\n", s)
		os.Exit(0)
	}
}

// reap collects every child that has exited (pause.c's sigreap: waitpid(-1, NULL, WNOHANG)
// until none).
func reap() {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if pid <= 0 || err != nil {
			return
		}
	}
}
