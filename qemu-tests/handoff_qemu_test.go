//go:build qemu

package qemutest

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/passage-boot/passage/stages"
)

// rootReport is what internal/rootinit, the real root's init, said on the console.
type rootReport struct {
	init     string            // "pid=1 root=disk"
	runFS    string            // the file system on /run ("none": not a mount)
	hostname string            // the kernel's, as the real root reads it
	cgroup   []string          // the controllers cgroup2 offers the real root
	files    map[string]string // /run/passage's regular files: name -> sha256 hex
	end      bool              // it got to the end of its report
}

func readRootReport(t *testing.T, console string) rootReport {
	t.Helper()
	f, err := os.Open(console)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r := rootReport{files: map[string]string{}}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := strings.TrimRight(sc.Text(), "\r")
		_, l, ok := strings.Cut(l, "PASSAGE-ROOT-")
		if !ok {
			continue
		}
		kind, rest, _ := strings.Cut(l, " ")
		switch kind {
		case "INIT":
			r.init = rest
		case "RUN":
			r.runFS = strings.TrimPrefix(rest, "fstype=")
		case "HOSTNAME":
			r.hostname = rest
		case "CGROUP":
			r.cgroup = strings.Fields(rest)
		case "FILE":
			name, sum, _ := strings.Cut(rest, " ")
			r.files[name] = strings.TrimPrefix(sum, "sha256=")
		case "END":
			r.end = true
		}
	}
	return r
}

// newRootDisk is a GPT disk whose ext4 root holds internal/rootinit as /sbin/init.
func newRootDisk(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	root := filepath.Join(dir, "root")
	for _, d := range []string{"sbin", "etc"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	build := exec.Command("go", "build", "-o", filepath.Join(root, "sbin", "init"), "./internal/rootinit")
	build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build rootinit: %v\n%s", err, out)
	}
	if err := os.WriteFile(filepath.Join(root, "etc", "passage-root"), []byte("disk"), 0o644); err != nil {
		t.Fatal(err)
	}
	disk := filepath.Join(dir, "root.img")
	if err := NewGPTDisk(disk, 64, rootPartUUID, rootFSUUID, rootLabel, root); err != nil {
		t.Fatal(err)
	}
	return disk
}

// TestHandoffRunAndHostname boots the real image as a PXE-booted node is booted
// (passage as PID 1, rdinit=, switch_root into a disk found by UUID) and checks what the
// real root's init, PID 1 after switch_root, is handed (issue #55, items 1 and 2):
//
//   - /run is a mount, a tmpfs, and /run/passage holds every file the boot emitted, byte
//     for byte: the manifest that verified with the image's key, its event log, the
//     attestation, log.jsonl;
//   - the node's name: from passage.hostname= (given in upper case: folded), which wins
//     over the DHCP server's; from DHCP option 12 (QEMU's slirp hostname=) when the
//     command line names none, the manifest then signed after the network stage; and a
//     node with neither is signed with an empty hostname and the error, its hostname
//     stage degraded, never "(none)". The manifest's hostname is the one the real root
//     reads.
func TestHandoffRunAndHostname(t *testing.T) {
	disk := newRootDisk(t)
	for _, tc := range []struct {
		name     string
		append   []string
		without  []string
		dhcp     string // option 12 from QEMU's DHCP server
		want     string // the signed hostname, and the real root's
		done     string
		dhcpWait bool // the network stage ran before the manifest
	}{
		{name: "kernel argument", append: []string{"passage.hostname=B300-R07-N3"}, dhcp: "from-dhcp", want: "b300-r07-n3", done: "ok"},
		{name: "DHCP option 12", without: []string{"passage.hostname"}, dhcp: "b300-r07-n4", want: "b300-r07-n4", done: "ok", dhcpWait: true},
		{name: "no name", without: []string{"passage.hostname"}, want: "", done: "degraded", dhcpWait: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run, m := bootPassage(t, Options{NVMe: []string{disk}, Topology: Topology{DHCPHostname: tc.dhcp}, Without: tc.without,
				Append: append([]string{
					"rdinit=/bbin/passage",
					"passage.handoff=switch_root", "passage.root=UUID=" + rootFSUUID, "passage.rootfstype=ext4",
					"passage.host_modules=e1000e,nvme,crc32c_generic,ext4",
				}, tc.append...)})
			if run.Done != tc.done {
				t.Errorf("PASSAGE-DONE %s, want %s", run.Done, tc.done)
			}
			for _, u := range m.Units {
				checkBound(t, &u)
			}

			// The name, as signed.
			if m.Node.Hostname != tc.want {
				t.Errorf("manifest node.hostname %q, want %q", m.Node.Hostname, tc.want)
			}
			noName := slices.ContainsFunc(m.Errors, func(e string) bool { return strings.Contains(e, "no hostname") })
			if noName != (tc.want == "") {
				t.Errorf("manifest errors %q: a no-hostname error %v, want %v", m.Errors, noName, tc.want == "")
			}
			var inManifest []string
			for _, s := range m.Stages {
				inManifest = append(inManifest, s.Name)
				if s.Name != "hostname" {
					continue
				}
				want := "ok"
				if tc.want == "" {
					want = "degraded"
				}
				said := ""
				for _, f := range s.Findings {
					said += f.Message + "\n"
				}
				if s.Status != want || tc.want == "" && !strings.Contains(said, "no hostname") {
					t.Errorf("manifest's hostname stage %s %q, want %s", s.Status, said, want)
				}
			}
			// The network stage ran before the manifest only when the name had to come
			// from DHCP; its lease is then in the manifest.
			if got := slices.Contains(inManifest, "network"); got != tc.dhcpWait {
				t.Errorf("manifest stages %v: network in it %v, want %v", inManifest, got, tc.dhcpWait)
			}
			if !slices.Contains(inManifest, "hostname") {
				t.Errorf("manifest stages %v: no hostname stage", inManifest)
			}
			for _, s := range logStages(t, run) {
				if s.Name == "network" && s.Status != stages.OK {
					t.Errorf("network stage %s %s", s.Status, s.Error)
				}
				if s.Name == "network" && tc.dhcp != "" && !slices.ContainsFunc(s.Changes, func(c string) bool { return strings.Contains(c, `host name "`+tc.dhcp+`"`) }) {
					t.Errorf("network stage changes %q, want the lease's host name %q", s.Changes, tc.dhcp)
				}
			}

			// What the real root's init was handed.
			r := readRootReport(t, run.Console)
			if r.init != "pid=1 root=disk" || !r.end {
				t.Fatalf("the real root's init: %q (report complete: %v), want pid=1 on the disk; console end:\n%s", r.init, r.end, consoleTail(run.Console, 40))
			}
			// Every controller is free for the real root's cgroup2: none left bound to the
			// v1 hierarchies u-root's init mounted in the initramfs.
			for _, c := range []string{"cpu", "io", "pids"} {
				if !slices.Contains(r.cgroup, c) {
					t.Errorf("the real root's cgroup2 controllers %q: no %s", r.cgroup, c)
				}
			}
			if r.runFS != "tmpfs" {
				t.Errorf("the real root's /run: %q, want a tmpfs (moved by switch_root)", r.runFS)
			}
			wantHost := tc.want
			if wantHost == "" {
				wantHost = "(none)"
			}
			if r.hostname != wantHost {
				t.Errorf("the real root's hostname %q, want %q", r.hostname, wantHost)
			}
			for name, b := range run.Files {
				sum := sha256.Sum256(b)
				if got := r.files[name]; got != hex.EncodeToString(sum[:]) {
					t.Errorf("/run/passage/%s in the real root: sha256 %q, want the boot's %x", name, got, sum)
				}
			}
			for name := range r.files {
				if _, ok := run.Files[name]; !ok {
					t.Errorf("/run/passage/%s in the real root: not one of the boot's files", name)
				}
			}
			for _, name := range []string{"manifest.dsse.json", "manifest.dsse.json.eventlog.bin", "log.jsonl"} {
				if _, ok := r.files[name]; !ok {
					t.Errorf("/run/passage/%s: not in the real root (it has %v)", name, keys(r.files))
				}
			}
		})
	}
}
