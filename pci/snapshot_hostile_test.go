package pci_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// A snapshot comes from a customer's machine, so ExtractSnapshot treats it as hostile.
// These archives are each made of entries that look harmless one by one (every name
// and link target is local by spelling) but together climb out of the extraction
// directory.

// hostileEntry is one tar entry: a header and, for a regular file, its bytes.
type hostileEntry struct {
	hdr  *tar.Header
	body []byte
}

func hFile(name, body string) hostileEntry {
	return hostileEntry{&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body))}, []byte(body)}
}

func hDir(name string) hostileEntry {
	return hostileEntry{hdr: &tar.Header{Name: name, Typeflag: tar.TypeDir, Mode: 0o755}}
}

func hLink(name, target string) hostileEntry {
	return hostileEntry{hdr: &tar.Header{Name: name, Typeflag: tar.TypeSymlink, Linkname: target, Mode: 0o777}}
}

func hFIFO(name string) hostileEntry {
	return hostileEntry{hdr: &tar.Header{Name: name, Typeflag: tar.TypeFifo, Mode: 0o644}}
}

func hHard(name, target string) hostileEntry {
	return hostileEntry{hdr: &tar.Header{Name: name, Typeflag: tar.TypeLink, Linkname: target, Mode: 0o644}}
}

func hChar(name string) hostileEntry {
	return hostileEntry{hdr: &tar.Header{Name: name, Typeflag: tar.TypeChar, Mode: 0o644, Devmajor: 1, Devminor: 3}}
}

// buildTar writes entries as a snapshot-shaped tar.gz. Entries archive/tar refuses to
// write are left out when skipBad is set (the fuzz target), else an error.
func buildTar(entries []hostileEntry, skipBad bool) ([]byte, error) {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	for _, e := range entries {
		if err := tw.WriteHeader(e.hdr); err != nil {
			if skipBad {
				continue
			}
			return nil, fmt.Errorf("%q: %w", e.hdr.Name, err)
		}
		if e.hdr.Typeflag == tar.TypeReg {
			if _, err := tw.Write(e.body); err != nil {
				return nil, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func mustTar(t testing.TB, entries ...hostileEntry) []byte {
	t.Helper()
	b, err := buildTar(entries, false)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// sandbox makes a fresh base directory holding the extraction directory x and an empty
// sibling, sentinel, at which the escaping archives aim ("../sentinel" from x).
func sandbox(t *testing.T) (base, dir string) {
	t.Helper()
	base = t.TempDir()
	dir = filepath.Join(base, "x")
	for _, d := range []string{dir, filepath.Join(base, "sentinel")} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return base, dir
}

// names lists dir without following links (ReadDir uses lstat semantics for entries).
func names(t testing.TB, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// assertContained fails unless base still holds only x and sentinel, and sentinel is
// empty: nothing was created outside the extraction directory.
func assertContained(t *testing.T, base string) {
	t.Helper()
	if got := names(t, base); !slices.Equal(got, []string{"sentinel", "x"}) {
		t.Errorf("the extraction directory's parent holds %q, want only sentinel and x", got)
	}
	if got := names(t, filepath.Join(base, "sentinel")); len(got) != 0 {
		t.Errorf("created outside the extraction directory: sentinel/%q", got)
	}
}

// The chain every escape below uses: a/b/up -> ../.. is the extraction directory itself
// (local), and a/b/esc -> up/../sentinel reads as a/b/sentinel (local) but is the kernel's
// x/../sentinel, outside.
var (
	chainUp  = hLink("a/b/up", "../..")
	chainEsc = hLink("a/b/esc", "up/../sentinel")
)

func TestExtractSnapshotHostile(t *testing.T) {
	for _, tc := range []struct {
		name    string
		entries []hostileEntry
		want    []string // all in the error
	}{
		{"file through the chain, doubled slash in the link's name",
			[]hostileEntry{hDir("a/"), hDir("a/b/"), chainUp, hLink("a/b//esc", "up/../sentinel"), hFile("a/b/esc/pwned", "x")},
			[]string{`snapshot entry "a/b//esc"`}},
		{"directory through the chain, doubled slash in the link's name",
			[]hostileEntry{chainUp, hLink("a//b/esc", "up/../sentinel"), hDir("a/b/esc/d/")},
			[]string{`snapshot entry "a//b/esc"`}},
		{"file through the chain, dot segment in the link's name",
			[]hostileEntry{chainUp, hLink("a/b/./esc", "up/../sentinel"), hFile("a/b/esc/pwned", "x")},
			[]string{`snapshot entry "a/b/./esc"`}},
		{"doubled slash in a file's name",
			[]hostileEntry{chainUp, chainEsc, hFile("a/b//esc/pwned", "x")},
			[]string{`snapshot entry "a/b//esc/pwned"`}},
		{"file under a symlinked directory that points outside",
			[]hostileEntry{chainUp, chainEsc, hFile("a/b/esc/pwned", "x")},
			[]string{`snapshot entry "a/b/esc/pwned"`, "below symlink a/b/esc"}},
		{"link through a link to ../..",
			[]hostileEntry{chainUp, chainEsc},
			[]string{`snapshot entry "a/b/esc"`, `link target "up/../sentinel" resolves outside the snapshot`}},
		{"link through a link made later",
			[]hostileEntry{chainEsc, chainUp},
			[]string{`snapshot entry "a/b/esc"`, "resolves outside the snapshot"}},
		{"link target outside, through another directory's link",
			[]hostileEntry{chainUp, hLink("sys/out", "../a/b/up/../sentinel")},
			[]string{`snapshot entry "sys/out"`, "resolves outside the snapshot"}},
		{"doubled slash below an inside link",
			[]hostileEntry{hDir("sys/y/"), hLink("sys//x", "y"), hFile("sys/x/config", "x")},
			[]string{`snapshot entry "sys//x"`}},
		{"link to ../..",
			[]hostileEntry{hLink("sys/up", "../..")},
			[]string{`snapshot entry "sys/up"`, "leaves the snapshot"}},
		{"absolute link",
			[]hostileEntry{hLink("sys/abs", "/tmp")},
			[]string{`snapshot entry "sys/abs"`, "leaves the snapshot"}},
		{"link loop",
			[]hostileEntry{hLink("sys/a", "b"), hLink("sys/b", "a")},
			[]string{`snapshot entry "sys/a"`, "too many levels of symbolic links"}},
		{"link over a link",
			[]hostileEntry{hLink("sys/a", "b"), hLink("sys/a", "../sentinel")},
			[]string{`snapshot entry "sys/a": file exists`}},
		{"FIFO",
			[]hostileEntry{hDir("sys/"), hFIFO("sys/config")},
			[]string{`snapshot entry "sys/config"`, "(FIFO)", "not allowed"}},
		{"hard link",
			[]hostileEntry{hFile("sys/a", "x"), hHard("sys/h", "sys/a")},
			[]string{`snapshot entry "sys/h"`, "(hard link)", "not allowed"}},
		{"hard link out",
			[]hostileEntry{hHard("sys/h", "../sentinel/f")},
			[]string{`snapshot entry "sys/h"`, "(hard link)", "not allowed"}},
		{"character device",
			[]hostileEntry{hChar("sys/null")},
			[]string{`snapshot entry "sys/null"`, "(character device)", "not allowed"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base, dir := sandbox(t)
			if tc.name == "hard link out" {
				// A file outside for the hard link to name.
				if err := os.WriteFile(filepath.Join(base, "sentinel", "f"), nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			err := pci.ExtractSnapshot(bytes.NewReader(mustTar(t, tc.entries...)), dir)
			if err == nil {
				t.Errorf("accepted")
			} else {
				for _, w := range tc.want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("err %q, want it to contain %q", err, w)
					}
				}
			}
			if tc.name == "hard link out" {
				if err := os.Remove(filepath.Join(base, "sentinel", "f")); err != nil {
					t.Error(err)
				}
			}
			assertContained(t, base)
			// A rejected archive leaves nothing behind, not even what stayed inside.
			if got := names(t, dir); len(got) != 0 {
				t.Errorf("rejected archive left %q in the extraction directory", got)
			}
		})
	}
}

// TestScanSnapshotChainToFIFO: a function whose bus link is local, through a directory
// link that climbs out by way of a link to the snapshot root, to a FIFO outside. Reading
// its config through that chain would block in open forever.
func TestScanSnapshotChainToFIFO(t *testing.T) {
	base := t.TempDir()
	t.Setenv("TMPDIR", base) // ScanSnapshot unpacks into base/passage-snapshot-*
	outside := filepath.Join(base, "outside")
	if err := os.Mkdir(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(outside, "config")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	data := mustTar(t,
		hDir("sys/"), hDir("sys/bus/"), hDir("sys/bus/pci/"), hDir("sys/bus/pci/devices/"), hDir("sys/devices/"),
		hLink("sys/bus/pci/devices/0000:00:01.0", "../../../devices/0000:00:01.0"),
		hLink("sys/devices/0000:00:01.0", "up/../outside"),
		hLink("sys/devices/up", "../.."),
	)
	type result struct {
		tree *pci.Tree
		err  error
	}
	done := make(chan result, 1)
	go func() {
		tr, err := pci.ScanSnapshot(bytes.NewReader(data))
		done <- result{tr, err}
	}()
	var r result
	select {
	case r = <-done:
	case <-time.After(20 * time.Second):
		t.Errorf("ScanSnapshot blocked: it opened the FIFO outside the snapshot")
		// Unblock the reader so the test ends.
		if fd, err := unix.Open(fifo, unix.O_WRONLY|unix.O_NONBLOCK, 0); err == nil {
			unix.Close(fd)
		}
		r = <-done
	}
	if r.err == nil {
		t.Fatalf("scanned a snapshot whose links leave it: %d functions", len(r.tree.Devices))
	}
	if !strings.Contains(r.err.Error(), `snapshot entry "sys/devices/0000:00:01.0"`) {
		t.Errorf("err %q does not name the escaping link", r.err)
	}
	if got := names(t, base); !slices.Equal(got, []string{"outside"}) {
		t.Errorf("TMPDIR holds %q after the scan, want only outside", got)
	}
}

func TestSnapshotHostileRoundTrip(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	live := scan(t, n.Root)
	var buf bytes.Buffer
	if _, err := pci.WriteSnapshot(&buf, n.Root); err != nil {
		t.Fatal(err)
	}
	back, err := pci.ScanSnapshot(bytes.NewReader(buf.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	if len(back.Devices) == 0 {
		t.Fatal("no functions")
	}
	sameTree(t, live, back)
}

// TestSnapshotLimitsFitBigNode: the limits leave room for a 9896-function SR-IOV node,
// bigger than any machine passage boots (see snapshotMax* in snapshot.go).
func TestSnapshotLimitsFitBigNode(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a 10 000-function tree")
	}
	t.Parallel()
	n := pcitest.New(t, pcitest.SRIOVNode(8, 617, 617))
	var buf bytes.Buffer
	written, err := pci.WriteSnapshot(&buf, n.Root)
	if err != nil {
		t.Fatal(err)
	}
	// ScanSnapshot's steps, with its 70 000 small files on tmpfs when there is one (as
	// pcitest builds its trees): a loaded disk file system takes ten times as long.
	dir := scratchDir(t)
	if err := pci.ExtractSnapshot(bytes.NewReader(buf.Bytes()), dir); err != nil {
		t.Fatal(err)
	}
	back, err := pci.Scan(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(back.Devices) != 9896 || len(written.Devices) != 9896 {
		t.Fatalf("%d functions written, %d read back, want 9896", len(written.Devices), len(back.Devices))
	}
}

// gzipMember compresses b as one gzip member. gzip readers read concatenated members as
// one stream, so a big archive can be built from a few members repeated.
func gzipMember(t *testing.T, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	if err != nil {
		t.Fatal(err)
	}
	zw.Write(b)
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// rawTar is the uncompressed tar of entries, without the end-of-archive blocks when open.
func rawTar(t *testing.T, open bool, entries ...hostileEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		if err := tw.WriteHeader(e.hdr); err != nil {
			t.Fatal(err)
		}
		tw.Write(e.body)
	}
	if err := tw.Flush(); err != nil {
		t.Fatal(err)
	}
	if !open {
		tw.Close()
	}
	return buf.Bytes()
}

// The limits (snapshot.go): 1 MiB a file, 256 MiB of files, 524288 entries, 512 MiB of
// tar stream, 4095-byte names and link targets, 64 elements a name, 40 nested links.
func TestExtractSnapshotLimits(t *testing.T) {
	end := gzipMember(t, make([]byte, 1024)) // end-of-archive

	t.Run("entries", func(t *testing.T) {
		t.Parallel()
		// One directory entry, repeated: cheap to unpack, so the count is what stops it.
		one := rawTar(t, true, hDir("d/"))
		chunk := gzipMember(t, bytes.Repeat(one, 1<<12))
		var buf bytes.Buffer
		for range 1 << 7 {
			buf.Write(chunk)
		}
		buf.Write(gzipMember(t, one)) // entry 1<<19 + 1
		buf.Write(end)
		checkLimit(t, buf.Bytes(), "snapshot: more than 524288 entries")
	})
	t.Run("total", func(t *testing.T) {
		t.Parallel()
		// 257 files of 1 MiB each: each below the file limit, together above 256 MiB.
		zeros := gzipMember(t, make([]byte, 1<<20))
		var buf bytes.Buffer
		for i := range 257 {
			var h bytes.Buffer
			tw := tar.NewWriter(&h)
			tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("f%03d", i), Typeflag: tar.TypeReg, Mode: 0o644, Size: 1 << 20})
			tw.Flush()
			buf.Write(gzipMember(t, h.Bytes()))
			buf.Write(zeros)
		}
		buf.Write(end)
		checkLimit(t, buf.Bytes(), "snapshot: more than 268435456 bytes of files")
	})
	t.Run("depth", func(t *testing.T) {
		deep := strings.Repeat("d/", 64) + "f"
		checkLimit(t, mustTar(t, hFile(deep, "x")), "path deeper than 64 elements")
	})
	t.Run("path length", func(t *testing.T) {
		long := strings.Repeat(strings.Repeat("n", 200)+"/", 21) + "f" // 4222 bytes, 22 elements
		checkLimit(t, mustTar(t, hFile(long, "x")), "path longer than 4095 bytes")
	})
	t.Run("link target length", func(t *testing.T) {
		checkLimit(t, mustTar(t, hLink("sys/l", strings.Repeat("./", 2048)+"x")), `snapshot entry "sys/l": link target longer than 4095 bytes`)
	})
	t.Run("link nesting", func(t *testing.T) {
		// l0 -> l1 -> ... -> l41 -> d: no loop, but deeper than the kernel follows.
		ents := []hostileEntry{hDir("sys/d/")}
		for i := range 41 {
			ents = append(ents, hLink(fmt.Sprintf("sys/l%d", i), fmt.Sprintf("l%d", i+1)))
		}
		ents = append(ents, hLink("sys/l41", "d"))
		checkLimit(t, mustTar(t, ents...), `snapshot entry "sys/l40": link target "l41" nests more than 40 links`)
	})
	t.Run("file", func(t *testing.T) {
		checkLimit(t, mustTar(t, hFile("sys/big", strings.Repeat("x", 1<<20+1))), `snapshot entry "sys/big": 1048577 bytes, more than 1048576`)
	})
	t.Run("gzip bomb", func(t *testing.T) {
		t.Parallel()
		// Consecutive PAX extended headers of 1 MiB each, which archive/tar reads (each
		// replacing the last) within one Next: a few KiB that unpack to 600 MiB with no
		// entry or file to count.
		one := rawTar(t, true, hostileEntry{hdr: &tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755, Format: tar.FormatPAX,
			PAXRecords: map[string]string{"PASSAGE.junk": strings.Repeat("A", 1<<20-64)}}})
		pax := gzipMember(t, one[:len(one)-512]) // the extended header without its entry
		var buf bytes.Buffer
		for range 600 {
			buf.Write(pax)
		}
		buf.Write(gzipMember(t, rawTar(t, false, hDir("d/"))))
		if buf.Len() > 4<<20 {
			t.Fatalf("bomb is %d bytes", buf.Len())
		}
		checkLimit(t, buf.Bytes(), "snapshot: more than 536870912 bytes unpacked")
	})
}

func checkLimit(t *testing.T, data []byte, want string) {
	t.Helper()
	base, dir := sandbox(t)
	err := pci.ExtractSnapshot(bytes.NewReader(data), dir)
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("err %v, want %q", err, want)
	}
	assertContained(t, base)
	if got := names(t, dir); len(got) != 0 {
		t.Errorf("rejected archive left %d entries in the extraction directory", len(got))
	}
}

// fuzzEntries turns fuzz input into archive entries, one a line: a kind byte, the name,
// and optionally ">" and a link target (a file's bytes, for a file). Kinds: f file,
// d directory, l symlink, p FIFO, h hard link; any other byte picks one of these.
func fuzzEntries(s string) []hostileEntry {
	var out []hostileEntry
	for i, line := range strings.Split(s, "\n") {
		if line == "" || i >= 64 {
			continue
		}
		kind, rest := line[0], line[1:]
		name, target, _ := strings.Cut(rest, ">")
		switch kind {
		case 'f', 'd', 'l', 'p', 'h':
		default:
			kind = "fdlph"[int(kind)%5]
		}
		switch kind {
		case 'f':
			out = append(out, hFile(name, target))
		case 'd':
			out = append(out, hDir(name))
		case 'l':
			out = append(out, hLink(name, target))
		case 'p':
			out = append(out, hFIFO(name))
		case 'h':
			out = append(out, hHard(name, target))
		}
	}
	return out
}

// fuzzSeeds are the escapes above, and some harmless trees, in fuzzEntries' form.
var fuzzSeeds = []string{
	"da/\nda/b/\nla/b/up>../..\nla/b//esc>up/..\nfa/b/esc/pwned>x",
	"la/b/up>../..\nla/b//esc>up/../..\nda/b/esc/d/",
	"la/b/up>../..\nla/b/./esc>up/..\nfa/b/esc/pwned>x",
	"la/b/up>../..\nla/b/esc>up/..\nfa/b//esc/pwned>x",
	"la/b/up>../..\nla/b/esc>up/..\nfa/b/esc/pwned>x",
	"la/b/esc>up/..\nla/b/up>../..",
	"la/b/up>../..\nlsys/out>../a/b/up/../pwned",
	"dsys/y/\nlsys//x>y\nfsys/x/config>x",
	"lsys/up>../..\nfsys/up/pwned>x",
	"lup>..\nfup/pwned>x",
	"lup>.\nl.//up2>up/..\nfup2/pwned>x",
	"lsys/abs>/tmp",
	"lsys/a>b\nlsys/b>a",
	"dsys/\npsys/config",
	"fsys/a>x\nhsys/h>sys/a",
	"hsys/h>../pwned",
	"dsys/\ndsys/bus/\ndsys/bus/pci/\ndsys/bus/pci/devices/\ndsys/devices/\nlsys/bus/pci/devices/0000:00:01.0>../../../devices/0000:00:01.0\nlsys/devices/0000:00:01.0>up/../pwned\nlsys/devices/up>../..",
	"dsys/\ndsys/devices/\ndsys/devices/pci0000:00/\ndsys/devices/pci0000:00/0000:00:01.0/\nfsys/devices/pci0000:00/0000:00:01.0/config>\x86\x80\nlsys/devices/pci0000:00/0000:00:01.0/driver>../../../bus/pci/drivers/pcieport\nlsys/bus/pci/devices/0000:00:01.0>../../../devices/pci0000:00/0000:00:01.0",
}

// scratchDir is a fresh directory on tmpfs when the machine has one (a loaded disk file
// system makes many small files an I/O wait), else t.TempDir.
func scratchDir(t *testing.T) string {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &st); err == nil && st.Type == unix.TMPFS_MAGIC {
		if dir, err := os.MkdirTemp("/dev/shm", "snapshot-fuzz-"); err == nil {
			t.Cleanup(func() {
				if err := os.RemoveAll(dir); err != nil {
					t.Error(err)
				}
			})
			return dir
		}
	}
	return t.TempDir()
}

func FuzzExtractSnapshot(f *testing.F) {
	for _, s := range fuzzSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		data, err := buildTar(fuzzEntries(s), true)
		if err != nil {
			t.Skip(err)
		}
		// base/p/x: x is the extraction directory; escapes of one or two levels land in
		// p or base.
		base := scratchDir(t)
		parent := filepath.Join(base, "p")
		dir := filepath.Join(parent, "x")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		xerr := pci.ExtractSnapshot(bytes.NewReader(data), dir)
		for _, d := range []struct{ dir, only string }{{base, "p"}, {parent, "x"}} {
			if got := names(t, d.dir); !slices.Equal(got, []string{d.only}) {
				t.Fatalf("after extraction (err %v) %s holds %q, want only %s", xerr, d.dir, got, d.only)
			}
		}
		if xerr != nil {
			if !strings.HasPrefix(xerr.Error(), "snapshot") {
				t.Errorf("error %q does not say snapshot", xerr)
			}
			if got := names(t, dir); len(got) != 0 {
				t.Errorf("rejected (%v) but left %q", xerr, got)
			}
			return
		}
		// Accepted: only directories, files and symlinks, and every symlink, resolved by
		// the kernel with RESOLVE_BENEATH, stays beneath dir (or does not resolve at all).
		rootFD, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(rootFD)
		err = filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(dir, p)
			switch e.Type() {
			case 0, fs.ModeDir:
			case fs.ModeSymlink:
				fd, err := unix.Openat2(rootFD, rel, &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: unix.RESOLVE_BENEATH})
				if err == nil {
					unix.Close(fd)
				} else if errors.Is(err, unix.EXDEV) {
					t.Errorf("accepted link %s resolves outside the extraction directory", rel)
				} else if errors.Is(err, unix.ENOSYS) {
					t.Skip("no openat2")
				}
			default:
				t.Errorf("accepted %s of type %v", rel, e.Type())
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	})
}
