package main

import (
	"fmt"
	"io"
)

func cmdPlan(args []string, stdout, stderr io.Writer) int {
	fmt.Fprintln(stderr, "passage: not implemented yet")
	return 2
}
