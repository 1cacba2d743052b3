package main

import (
	"fmt"
	"io"
)

func cmdInspect(args []string, stdout, stderr io.Writer) int {
	fmt.Fprintln(stderr, "passage: not implemented yet")
	return 2
}
