package main

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/passage-boot/passage/buildinfo"
)

// cmdVersion prints this binary's build, the same that its manifests, log.jsonl, console
// and passage_build_info carry.
func cmdVersion(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("version", stderr)
	asJSON := fs.Bool("json", false, `print {"version","revision","modified","go_version"} as the manifest's build does`)
	if code, ok := parseNoArgs(fs, args, stdout); !ok {
		return code
	}
	b := buildinfo.Read()
	if *asJSON {
		j, err := json.Marshal(b)
		if err != nil {
			fmt.Fprintf(stderr, "passage version: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "%s\n", j)
		return 0
	}
	fmt.Fprintln(stdout, b)
	return 0
}
