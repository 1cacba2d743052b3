package emit

import (
	"bytes"
	"compress/gzip"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

func encode(t testing.TB, name string, data []byte) string {
	t.Helper()
	var b bytes.Buffer
	if err := File(&b, name, data); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

func parse(t testing.TB, capture string) *Report {
	t.Helper()
	rep, err := Parse(strings.NewReader(capture))
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// What Mark, Dir and Done write, Parse reads back, with kernel messages and CR LF line
// ends between the lines.
func TestRoundTrip(t *testing.T) {
	dir := t.TempDir()
	big := make([]byte, 10000)
	rand.Read(big)
	files := map[string][]byte{
		"manifest.dsse.json": []byte(`{"payloadType":"application/vnd.passage.manifest+json"}`),
		"log.jsonl":          []byte("{\"type\":\"stage\"}\n"),
		"empty":              nil,
		"eventlog":           big,
	}
	for n, b := range files {
		if err := os.WriteFile(filepath.Join(dir, n), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "proc"), 0o755)
	os.WriteFile(filepath.Join(root, "proc", "uptime"), []byte("7.12345 10.00\n"), 0o644)

	var con bytes.Buffer
	if _, err := Mark(&con, root, "uinit-start"); err != nil {
		t.Fatal(err)
	}
	if err := Dir(&con, dir); err != nil {
		t.Fatal(err)
	}
	if err := Done(&con, "degraded"); err != nil {
		t.Fatal(err)
	}

	// Sorted by name, 76 columns, nothing but the protocol.
	var begins []string
	for _, l := range strings.Split(con.String(), "\n") {
		if len(l) > 76 && !strings.HasPrefix(l, "===") {
			t.Errorf("line longer than 76: %q", l)
		}
		if strings.HasPrefix(l, beginPrefix) {
			begins = append(begins, strings.Fields(l)[1])
		}
	}
	if want := []string{"empty", "eventlog", "log.jsonl", "manifest.dsse.json"}; !reflect.DeepEqual(begins, want) {
		t.Errorf("block order = %v, want %v", begins, want)
	}

	var noisy bytes.Buffer
	for i, l := range strings.Split(con.String(), "\n") {
		noisy.WriteString(l + "\r\n")
		if i%3 == 1 {
			noisy.WriteString("[    8.123456] vfio-pci 0000:03:00.0: enabling device (0000 -> 0002)\n")
		}
	}
	out := parse(t, noisy.String())
	if len(out.Errors) != 0 {
		t.Fatalf("errors: %v", out.Errors)
	}
	for n, b := range files {
		got, ok := out.Files[n]
		if !ok || !bytes.Equal(got, b) {
			t.Errorf("file %s: got %d bytes (present %v), want %d", n, len(got), ok, len(b))
		}
	}
	if len(out.Files) != len(files) {
		t.Errorf("got %d files, want %d", len(out.Files), len(files))
	}
	if out.Done != "degraded" || out.Markers["uinit-start"] != 7.123 {
		t.Errorf("done %q markers %v", out.Done, out.Markers)
	}
	if len(out.HostAt) != 0 {
		t.Errorf("Parse has no clock, yet HostAt = %v", out.HostAt)
	}
}

// A serial console as QEMU shows it: firmware, kernel messages (one inside a block, one in
// front of a marker on the same line), then the report.
func TestParseKernelNoise(t *testing.T) {
	manifest := bytes.Repeat([]byte(`{"unit":"gpu0","bdf":"0000:09:00.0"}`+"\n"), 40)
	blockM := encode(t, "manifest.json", manifest)
	lines := strings.Split(blockM, "\n")
	withNoise := strings.Join(append(append(append([]string{}, lines[:3]...),
		"[   10.123456] vfio-pci 0000:09:00.0: enabling device (0000 -> 0002)\r"), lines[3:]...), "\n")
	log := "SeaBIOS (version 1.16.2)\r\n" +
		"[    0.000000] Linux version 6.1.0-57-amd64\r\n" +
		"PASSAGE-T uinit-start 7.012\r\n" +
		withNoise +
		encode(t, "empty", []byte{}) +
		"[    9.4] e1000e: eth0 NIC Link is Up PASSAGE-T manifest-written 9.500\n" +
		"PASSAGE-T handoff 9.750\n" +
		"PASSAGE-T handoff 99.000\n" +
		"===PASSAGE-DONE degraded===\r\n" +
		"===PASSAGE-DONE ok===\r\n" +
		"[   10.0] reboot: Power down\n"
	rep := parse(t, log)
	if len(rep.Errors) != 0 {
		t.Fatalf("errors: %v", rep.Errors)
	}
	if !bytes.Equal(rep.Files["manifest.json"], manifest) {
		t.Errorf("manifest.json: got %d bytes, want %d", len(rep.Files["manifest.json"]), len(manifest))
	}
	if d, ok := rep.Files["empty"]; !ok || len(d) != 0 {
		t.Errorf("empty file: %q, %v", d, ok)
	}
	if rep.Done != "degraded" {
		t.Errorf("Done = %q, want the first PASSAGE-DONE", rep.Done)
	}
	want := map[string]float64{"uinit-start": 7.012, "manifest-written": 9.5, "handoff": 9.75}
	if !reflect.DeepEqual(rep.Markers, want) {
		t.Errorf("markers = %v, want %v", rep.Markers, want)
	}
	tl := rep.Timeline()
	order := []string{"kernel-start", "uinit-start", "manifest-written", "handoff"}
	for i := 1; i < len(order); i++ {
		if a, b := strings.Index(tl, order[i-1]), strings.Index(tl, order[i]); a < 0 || b < 0 || a > b {
			t.Errorf("timeline: %s not before %s:\n%s", order[i-1], order[i], tl)
		}
	}
	if !strings.Contains(tl, "9.750 s  (+0.250 s)") {
		t.Errorf("timeline lacks the handoff step:\n%s", tl)
	}
}

// A capture of a real boot under QEMU (make demo): Debian's kernel, u-root's init and
// passage's own output around five blocks. The sums are those of the files the demo
// left on disk, computed apart from the console.
func TestParseQEMUCapture(t *testing.T) {
	f, err := os.Open(filepath.Join("testdata", "qemu-demo-console.log.gz"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := Parse(zr)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Errors) != 0 {
		t.Fatalf("errors: %v", rep.Errors)
	}
	want := map[string]struct {
		size int
		sum  string
	}{
		"log.jsonl":                        {3894, "bfb2a83a14815cf59c92485a03616af9dab92c4857b2cac826b5a0f172f915a0"},
		"manifest.dsse.json":               {18906, "2260d527b8332d8a9bdb2602e3aec17a8765264fa8ed8d82b4f1a408680b6418"},
		"manifest.dsse.json.eventlog.json": {736, "bbf22e78358ec330758bf825c3878580ba2d4cb928664e526fa7b0a3ddf2e018"},
		"manifest.json":                    {13747, "a459f59175dffbc1672a2f84d7f86c7f687eef7523f1f5c12b6762ba69ff7e57"},
		"readback.json":                    {6373, "a8e4821f040fe3209f701aac9256c5bb4ccfcdc8b907335187d1f2a9e275511a"},
	}
	if len(rep.Files) != len(want) {
		t.Errorf("%d files, want %d", len(rep.Files), len(want))
	}
	for n, w := range want {
		b, ok := rep.Files[n]
		sum := sha256.Sum256(b)
		if !ok || len(b) != w.size || hex.EncodeToString(sum[:]) != w.sum {
			t.Errorf("%s: present %v, %d bytes, sha256 %x; want %d bytes, %s", n, ok, len(b), sum, w.size, w.sum)
		}
	}
	if rep.Done != "ok" {
		t.Errorf("Done = %q", rep.Done)
	}
	wantM := map[string]float64{"uinit-start": 3.990, "manifest-written": 4.860, "handoff": 7.880}
	if !reflect.DeepEqual(rep.Markers, wantM) {
		t.Errorf("markers = %v, want %v", rep.Markers, wantM)
	}
}

// Every kind of damage is reported once, naming the file, and keeps nothing of the block.
func TestParseDamage(t *testing.T) {
	data := []byte("the quick brown fox jumps over the lazy dog, twice: the quick brown fox jumps over the lazy dog")
	good := encode(t, "f", data)
	lines := strings.Split(strings.TrimSuffix(good, "\n"), "\n")
	manifest := encode(t, "manifest.json", []byte("hello world, this is the manifest"))
	zeros := strings.Repeat("0", 64)
	for _, tc := range []struct {
		name, log, want string
	}{
		{"line lost", strings.Join(append([]string{lines[0]}, lines[2:]...), "\n"), "console file f: "},
		{"line altered", strings.Replace(good, lines[1], strings.ToUpper(lines[1]), 1), "console file f: sha256"},
		{"flipped byte", strings.Replace(manifest, "aGVsbG8", "aGVsbG9", 1), "console file manifest.json: sha256"},
		{"size lie", strings.Replace(good, fmt.Sprintf(" %d ", len(data)), fmt.Sprintf(" %d ", len(data)+1), 1), "console file f: 95 bytes, BEGIN said 96"},
		{"size too small", strings.Replace(good, fmt.Sprintf(" %d ", len(data)), " 3 ", 1), "console file f: more data than the 3 bytes"},
		{"size beyond bound", beginPrefix + "x 99999999999999999999 " + zeros + "===\n", "console file x: bad size 99999999999999999999"},
		{"no end", strings.Join(lines[:len(lines)-1], "\n"), "console file f: no END before the console closed"},
		{"truncated", manifest[:strings.Index(manifest, endPrefix)], "console file manifest.json: no END"},
		{"end without begin", "===PASSAGE-FILE-END x===\n", "console file x: END without BEGIN"},
		{"end names another", strings.Replace(good, "FILE-END f", "FILE-END g", 1), "console file f: END names g"},
		{"sent twice", good + good, "console file f: sent twice"},
		{"nested begin", lines[0] + "\n" + good, "console file f: no END before the next BEGIN"},
		{"malformed begin", beginPrefix + "x===\n", `console file "x": malformed BEGIN line`},
		{"short sum", beginPrefix + "y 3 abc===\n", `console file "y": malformed BEGIN line`},
		{"path in name", beginPrefix + "../etc/passwd 0 " + zeros + "===\n", `console file "../etc/passwd": malformed BEGIN`},
		{"dot dot", beginPrefix + ".. 0 " + zeros + "===\n" + endPrefix + "..===\n", `console file "..": not a file name`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := parse(t, tc.log)
			if len(rep.Errors) == 0 {
				t.Fatalf("no error; files %q", rep.Files)
			}
			if !strings.Contains(fmt.Sprint(rep.Errors), tc.want) {
				t.Errorf("errors %v, want %q", rep.Errors, tc.want)
			}
			// Only the whole second block of these two is good.
			wantFiles := 0
			if tc.name == "sent twice" || tc.name == "nested begin" {
				wantFiles = 1
			}
			if len(rep.Files) != wantFiles {
				t.Errorf("files %q, want %d", rep.Files, wantFiles)
			}
		})
	}
}

// A block cut short by the end of the boot still lets PASSAGE-DONE and the markers
// through, and a later block survives.
func TestParseCutBlock(t *testing.T) {
	cut := encode(t, "log.jsonl", bytes.Repeat([]byte("stage line\n"), 30))
	cut = cut[:strings.Index(cut, "\n")+20] + "\n"
	rep := parse(t, cut+"PASSAGE-T handoff 8.000\n===PASSAGE-DONE failed===\n"+encode(t, "readback.json", []byte("{}")))
	if rep.Done != "failed" || rep.Markers["handoff"] != 8 {
		t.Errorf("done %q markers %v", rep.Done, rep.Markers)
	}
	if string(rep.Files["readback.json"]) != "{}" {
		t.Errorf("files %q", rep.Files)
	}
	if len(rep.Errors) != 1 || !strings.Contains(rep.Errors[0].Error(), "console file log.jsonl: no END before the next BEGIN") {
		t.Errorf("errors %v", rep.Errors)
	}
}

// Lines longer than any protocol line are dropped without ending the read.
func TestParseLongLine(t *testing.T) {
	capture := strings.Repeat("x", 3*maxLine) + "\n" + encode(t, "a", []byte("after")) + "===PASSAGE-DONE ok===" // no final newline
	rep := parse(t, capture)
	if len(rep.Errors) != 0 || string(rep.Files["a"]) != "after" || rep.Done != "ok" {
		t.Errorf("errors %v files %q done %q", rep.Errors, rep.Files, rep.Done)
	}
}

type failingReader struct{ r io.Reader }

func (f failingReader) Read(b []byte) (int, error) {
	n, err := f.r.Read(b)
	if err == io.EOF {
		return n, io.ErrUnexpectedEOF
	}
	return n, err
}

func TestParseReadError(t *testing.T) {
	rep, err := Parse(failingReader{strings.NewReader("PASSAGE-T uinit-start 1.000\n")})
	if err == nil || !strings.Contains(err.Error(), "console: read") {
		t.Errorf("err = %v", err)
	}
	if rep == nil || rep.Markers["uinit-start"] != 1 {
		t.Errorf("report before the failure lost: %+v", rep)
	}
}

// The live parser stamps host time on the first line, each marker (first only) and
// PASSAGE-DONE, counted from NewParser; Report shows the state before Finish.
func TestParserHostAt(t *testing.T) {
	clock := time.Unix(1000, 0)
	p := NewParser(func() time.Time { return clock })
	step := func(d time.Duration, line string) { clock = clock.Add(d); p.Line(line) }
	step(2*time.Second, "SeaBIOS")
	step(5*time.Second, "PASSAGE-T uinit-start 3.990\r\n")
	step(time.Second, lines(encode(t, "a", []byte("x")))[0])
	if p.Report().Done != "" || len(p.Report().Files) != 0 {
		t.Errorf("report before the block ended: %+v", p.Report())
	}
	step(time.Second, "PASSAGE-T uinit-start 5.000")
	step(time.Second, "===PASSAGE-DONE ok===")
	if p.Report().Done != "ok" {
		t.Errorf("Report() does not show the done line: %q", p.Report().Done)
	}
	rep := p.Finish()
	want := map[string]time.Duration{"first-line": 2 * time.Second, "uinit-start": 7 * time.Second, "done": 10 * time.Second}
	if !reflect.DeepEqual(rep.HostAt, want) {
		t.Errorf("HostAt = %v, want %v", rep.HostAt, want)
	}
	if rep.Markers["uinit-start"] != 3.99 {
		t.Errorf("marker = %v, want the first", rep.Markers["uinit-start"])
	}
	if len(rep.Errors) != 1 || !strings.Contains(rep.Errors[0].Error(), "console file a: no END before the console closed") {
		t.Errorf("errors %v", rep.Errors)
	}
}

func lines(s string) []string { return strings.Split(strings.TrimSuffix(s, "\n"), "\n") }

func FuzzParse(f *testing.F) {
	var con bytes.Buffer
	File(&con, "manifest.json", []byte(`{"schema":1}`))
	Done(&con, "ok")
	f.Add(con.Bytes())
	f.Add([]byte("PASSAGE-T uinit-start 7.001\n" + beginPrefix + "x 0 e3b0===\n" + endPrefix + "x===\n"))
	f.Add([]byte(encode(f, "a", []byte("hello")) + "===PASSAGE-DONE ok===\nPASSAGE-T handoff 1.000\n"))
	f.Add([]byte(beginPrefix + "x 99999999999999999999 " + strings.Repeat("0", 64) + "===\n"))
	f.Add([]byte(encode(f, "a=", []byte("hello")) + "junk " + encode(f, "b", nil)))
	f.Fuzz(func(t *testing.T, data []byte) {
		rep, err := Parse(bytes.NewReader(data))
		if err != nil {
			t.Fatalf("a bytes.Reader cannot fail: %v", err)
		}
		for _, e := range rep.Errors {
			if e == nil || !strings.HasPrefix(e.Error(), "console ") {
				t.Fatalf("error without its object: %v", e)
			}
		}
		// Whatever decodes must re-encode (the encoder takes every name the decoder
		// does) to a block that decodes to the same bytes.
		var again bytes.Buffer
		for name, d := range rep.Files {
			if err := File(&again, name, d); err != nil {
				t.Fatalf("re-emit %q: %v", name, err)
			}
		}
		for ev := range rep.Markers {
			if _, err := Mark(io.Discard, "", ev); err != nil && !strings.Contains(err.Error(), "uptime") {
				t.Fatalf("decoded a marker Mark refuses: %v", err)
			}
		}
		rep2 := parse(t, again.String())
		if len(rep2.Errors) != 0 {
			t.Fatalf("re-emitted blocks: %v", rep2.Errors)
		}
		if len(rep2.Files) != len(rep.Files) {
			t.Fatalf("files %d != %d", len(rep2.Files), len(rep.Files))
		}
		for name, d := range rep.Files {
			if !bytes.Equal(rep2.Files[name], d) {
				t.Fatalf("file %q does not round-trip", name)
			}
		}
	})
}

// BenchmarkParseQEMUCapture is the decoder's cost on a real boot's console (117 KB).
func BenchmarkParseQEMUCapture(b *testing.B) {
	f, err := os.Open(filepath.Join("testdata", "qemu-demo-console.log.gz"))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		b.Fatal(err)
	}
	capture, err := io.ReadAll(zr)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(capture)))
	for b.Loop() {
		rep, err := Parse(bytes.NewReader(capture))
		if err != nil || len(rep.Errors) != 0 || len(rep.Files) != 5 {
			b.Fatalf("err %v, errors %v, %d files", err, rep.Errors, len(rep.Files))
		}
	}
}
