package boot

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/stages"
)

// countingTPM is a TPM key that counts what a dry run must not do: NV counter
// increments and PCR extends. It signs with an ed25519 key.
type countingTPM struct {
	*manifest.Ed25519Signer
	next, extends int
}

func (c *countingTPM) Next() (uint64, error)           { c.next++; return 7, nil }
func (*countingTPM) Source() manifest.GenerationSource { return manifest.GenerationTPMNV }
func (*countingTPM) PCR() int                          { return 13 }
func (*countingTPM) Banks() []string                   { return []string{"sha256"} }
func (c *countingTPM) Extend(map[string][]byte) error  { c.extends++; return nil }

// A dry run signs nothing and leaves the TPM and passage.out as it found them: no
// counter increment, no PCR extend, nothing mounted, no manifest built or written.
func TestDryRunTouchesNoCounterPCROrOut(t *testing.T) {
	for _, early := range []bool{false, true} {
		root, _ := signingNode(t)
		s, err := manifest.LoadSigner(root + "/etc/passage/passage.key")
		if err != nil {
			t.Fatal(err)
		}
		tpm := &countingTPM{Ed25519Signer: s}
		mounts := 0
		b := &Boot{Root: root, DryRun: true,
			OpenTPM: func(string) (manifest.Signer, manifest.Measurer, error) { return tpm, tpm, nil },
			Mount:   func(dev, dir string) (func() error, error) { mounts++; return func() error { return nil }, nil },
			Config:  initramfs.ParseCmdline("passage.erase=off passage.profile=b300 passage.tpm=on passage.key=/etc/passage/passage.key passage.out=/dev/hostdisk:/p")}
		if early {
			b.StartTPM()
		}
		rs, _ := run(t, b, "scan", "decide", "manifest")
		if mr := rs[2]; mr.Status != stages.Skipped {
			t.Fatalf("StartTPM %v: manifest %s %v %v, want skipped", early, mr.Status, mr.Err, mr.Findings)
		}
		if tpm.next != 0 || tpm.extends != 0 || mounts != 0 {
			t.Errorf("StartTPM %v: dry run: %d counter increments, %d PCR extends, %d mounts", early, tpm.next, tpm.extends, mounts)
		}
		if b.Manifest != nil || b.Signed != nil {
			t.Errorf("StartTPM %v: dry run built manifest %v, signed %+v, want neither", early, b.Manifest != nil, b.Signed)
		}
		if _, err := os.Stat(filepath.Join(root, initramfs.RunDir, EnvelopeName)); err == nil {
			t.Errorf("StartTPM %v: dry run wrote %s", early, EnvelopeName)
		}
	}
}

// passage.out's mount point and device come from the tree: a mount point that is a
// link out of the root is refused (nothing is mounted over a directory outside it), and
// a device link that leads out of the root too.
func TestOutMountStaysBeneathRoot(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(root, outside string)
		want  string
	}{
		{"mount point is a link out", func(root, outside string) {
			os.MkdirAll(filepath.Join(root, "run"), 0o755)
			os.Symlink(outside, filepath.Join(root, "run/passage-out"))
		}, "mount point"},
		{"device is a link out", func(root, outside string) {
			os.MkdirAll(filepath.Join(root, "dev"), 0o755)
			os.Symlink("../../../../../../../../../../.."+outside+"/disk", filepath.Join(root, "dev/hostdisk"))
		}, "leads out of"},
		{"device is a regular file", func(root, outside string) {
			os.MkdirAll(filepath.Join(root, "dev"), 0o755)
			os.WriteFile(filepath.Join(root, "dev/hostdisk"), nil, 0o644)
		}, "not a block device"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root, _ := signingNode(t)
			outside := t.TempDir()
			tc.setup(root, outside)
			var mounted []string
			b := &Boot{Root: root,
				Mount: func(dev, dir string) (func() error, error) {
					mounted = append(mounted, dev+" on "+dir)
					return func() error { return nil }, nil
				},
				Config: initramfs.ParseCmdline("passage.erase=off passage.profile=b300 passage.tpm=off passage.key=/etc/passage/passage.key passage.out=/dev/hostdisk:/p")}
			rs, _ := run(t, b, "scan", "decide", "manifest")
			if len(mounted) != 0 {
				t.Errorf("mounted %q", mounted)
			}
			if mr := rs[2]; !strings.Contains(fmt.Sprint(mr.Err, mr.Findings), tc.want) {
				t.Errorf("manifest %s %v %q, want it to say %q", mr.Status, mr.Err, mr.Findings, tc.want)
			}
			if ents, _ := os.ReadDir(outside); len(ents) != 0 {
				t.Errorf("written outside the root: %v", ents)
			}
		})
	}
}
