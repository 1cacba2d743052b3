// Command qemurun boots the image once under QEMU with the qemu-tests harness and
// prints what an operator on the serial console would see (the stage lines and unit
// table of passage boot, without the file blocks), the boot timeline and the wall
// times; the decoded files go to -out. image/demo.sh runs it.
//
//	qemurun -build build -out build/demo [-topology ats-off] [-append 'lockdown=integrity'] [-key K]
//
// Exit status: 0 the guest said ok or degraded, 1 it said failed or never finished,
// 2 bad usage or the harness could not run.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/passage-boot/passage/manifest"
	qemutest "github.com/passage-boot/passage/qemu-tests"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("qemurun", flag.ContinueOnError)
	fs.SetOutput(stderr)
	build := fs.String("build", filepath.Join("build", "linux-"+qemutest.DefaultKernel), "image dir (kernel/vmlinuz, initramfs.cpio.gz): make initramfs KERNEL=... builds build/linux-<kernel>")
	out := fs.String("out", "", "dir for console.log and the decoded files (default: a temp dir)")
	topo := fs.String("topology", "default", "default, or variants joined by +: ats-off, shared-group, no-acs-port")
	appendArgs := fs.String("append", "", "extra kernel arguments (a passage.* key replaces the default)")
	key := fs.String("key", "", "ed25519 private key file to put at /etc/passage/key")
	keyDir := fs.String("keydir", "", "like -key with DIR/passage.key, generating the pair (passage.key, passage.pub) when absent")
	tpmState := fs.String("tpm-state", "", "swtpm state dir to keep across boots (default: fresh)")
	disk := fs.String("disk", "", "raw disk image for /dev/vda")
	timeout := fs.Duration("timeout", 5*time.Minute, "hard limit for the boot")
	verbose := fs.Bool("v", false, "copy the whole console to stderr as it arrives")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	t, err := qemutest.ParseTopology(*topo)
	if err != nil {
		fmt.Fprintf(stderr, "qemurun: %v\n", err)
		return 2
	}
	abs, err := filepath.Abs(*build)
	if err != nil {
		fmt.Fprintf(stderr, "qemurun: %v\n", err)
		return 2
	}
	if *keyDir != "" && *key == "" {
		priv := filepath.Join(*keyDir, manifest.PrivateKeyFile)
		if _, err := os.Stat(priv); err != nil {
			if err := os.MkdirAll(*keyDir, 0o700); err != nil {
				fmt.Fprintf(stderr, "qemurun: %v\n", err)
				return 2
			}
			if _, _, err := manifest.GenerateKey(*keyDir); err != nil {
				fmt.Fprintf(stderr, "qemurun: %v\n", err)
				return 2
			}
		}
		*key = priv
	}
	o := qemutest.Options{
		Build: abs, Topology: t, Append: strings.Fields(*appendArgs), Key: *key,
		TPMState: *tpmState, Disk: *disk, WorkDir: *out, Timeout: *timeout,
	}
	if *verbose {
		o.Log = stderr
	}
	r, err := qemutest.Boot(context.Background(), o)
	if r == nil {
		fmt.Fprintf(stderr, "qemurun: %v\n", err)
		return 2
	}
	printReport(stdout, r)
	work := filepath.Dir(r.Console)
	var names []string
	for n := range r.Files {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if n != filepath.Base(n) || n == "console.log" {
			fmt.Fprintf(stderr, "qemurun: not writing file %q\n", n)
			continue
		}
		if werr := os.WriteFile(filepath.Join(work, n), r.Files[n], 0o644); werr != nil {
			fmt.Fprintf(stderr, "qemurun: %v\n", werr)
			return 2
		}
	}
	fmt.Fprintf(stdout, "\nfiles from the guest in %s: %s\n", work, strings.Join(names, " "))
	fmt.Fprintf(stdout, "\nboot timeline (guest clock):\n%s", r.Timeline())
	fmt.Fprintf(stdout, "host wall time: QEMU start to first console line %v, to PASSAGE-DONE %v, to QEMU exit %v\n",
		r.HostAt["first-line"].Round(time.Millisecond), r.WallDone.Round(time.Millisecond), r.Wall.Round(time.Millisecond))
	if err != nil {
		fmt.Fprintf(stderr, "qemurun: %v\n", err)
		return 1
	}
	switch r.Done {
	case "ok", "degraded":
		fmt.Fprintf(stdout, "PASSAGE-DONE %s\n", r.Done)
		return 0
	case "":
		fmt.Fprintf(stderr, "qemurun: the guest never printed PASSAGE-DONE (console %s)\n", r.Console)
		return 1
	default:
		fmt.Fprintf(stderr, "qemurun: the guest reported %s (console %s)\n", r.Done, r.Console)
		return 1
	}
}

// printReport prints the console from passage's first line to PASSAGE-DONE, with each
// file block shortened to one line.
func printReport(w io.Writer, r *qemutest.Run) {
	f, err := os.Open(r.Console)
	if err != nil {
		fmt.Fprintf(w, "(console: %v)\n", err)
		return
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	on, inBlock := false, false
	for sc.Scan() {
		line := strings.TrimRight(sc.Text(), "\r")
		if strings.Contains(line, "PASSAGE-T uinit-start") {
			on = true
		}
		if !on {
			continue
		}
		switch {
		case strings.Contains(line, "===PASSAGE-FILE-BEGIN "):
			inBlock = true
			fields := strings.Fields(strings.Trim(line[strings.Index(line, "===PASSAGE-FILE-BEGIN"):], "="))
			if len(fields) >= 3 {
				fmt.Fprintf(w, "[file %s: %s bytes]\n", fields[1], fields[2])
			}
		case strings.Contains(line, "===PASSAGE-FILE-END "):
			inBlock = false
		case inBlock:
		default:
			fmt.Fprintln(w, line)
		}
		if strings.Contains(line, "===PASSAGE-DONE") {
			return
		}
	}
}
