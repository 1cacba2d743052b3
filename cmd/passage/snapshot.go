package main

import (
	"fmt"
	"io"
)

func cmdSnapshot(args []string, stdout, stderr io.Writer) int {
	fmt.Fprintln(stderr, "passage: not implemented yet")
	return 2
}
