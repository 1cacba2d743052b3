// Command fleetgen writes a fleet's signed manifests for bench/verify-many.sh: N B300
// manifests under DIR/manifests, signed by K node keys whose public halves go to DIR/keys
// (manifesttest.Fleet).
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/passage-boot/passage/manifest/manifesttest"
)

func main() {
	n := flag.Int("n", 1000, "manifests")
	keys := flag.Int("keys", 1000, "node keys (node i signs with key i mod keys)")
	dir := flag.String("dir", "", "output directory")
	flag.Parse()
	if *dir == "" || *n <= 0 || *keys <= 0 || *keys > 1<<16 {
		fmt.Fprintln(os.Stderr, "usage: fleetgen -dir DIR [-n N] [-keys K]")
		os.Exit(2)
	}
	m, k, err := manifesttest.Fleet(*dir, *n, *keys)
	if err != nil {
		fmt.Fprintf(os.Stderr, "fleetgen: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("%d manifests in %s, %d keys in %s\n", *n, m, *keys, k)
}
