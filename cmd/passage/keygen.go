package main

import (
	"fmt"
	"io"
)

func cmdKeygen(args []string, stdout, stderr io.Writer) int {
	fmt.Fprintln(stderr, "passage: not implemented yet")
	return 2
}
