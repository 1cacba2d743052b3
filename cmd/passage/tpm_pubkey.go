package main

import (
	"fmt"
	"io"
)

func cmdTPMPubkey(args []string, stdout, stderr io.Writer) int {
	fmt.Fprintln(stderr, "passage: not implemented yet")
	return 2
}
