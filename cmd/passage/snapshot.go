package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/passage-boot/passage/pci"
)

func cmdSnapshot(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("snapshot", stderr)
	out := fs.String("o", "", "write the snapshot to `FILE` (.tar.gz)")
	root := fs.String("root", "/", "scan the sysfs tree under `DIR`")
	if code, ok := parseNoArgs(fs, args, stdout); !ok {
		return code
	}
	if *out == "" {
		fmt.Fprintln(stderr, "passage snapshot: -o FILE is required")
		return 2
	}
	tree, err := writeSnapshotFile(*out, *root)
	if err != nil {
		fmt.Fprintf(stderr, "passage snapshot: %v\n", err)
		return 2
	}
	problems := len(tree.Problems)
	for _, d := range tree.Devices {
		problems += len(d.Problems)
	}
	fmt.Fprintf(stdout, "%s: %d functions, %d problems\n", *out, len(tree.Devices), problems)
	return 0
}

// writeSnapshotFile writes beside the target and renames, so a snapshot interrupted
// half-way never looks complete.
func writeSnapshotFile(name, root string) (*pci.Tree, error) {
	f, err := os.CreateTemp(filepath.Dir(name), ".snapshot-*")
	if err != nil {
		return nil, err
	}
	tree, err := pci.WriteSnapshot(f, root)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), name)
	}
	if err != nil {
		os.Remove(f.Name())
		return nil, err
	}
	return tree, nil
}
