package emit

import (
	"bytes"
	"crypto/rand"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

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

	// Kernel messages interleaved between lines must not matter.
	var noisy bytes.Buffer
	for i, l := range strings.Split(con.String(), "\n") {
		noisy.WriteString(l + "\r\n")
		if i%3 == 1 {
			noisy.WriteString("[    8.123456] vfio-pci 0000:03:00.0: enabling device (0000 -> 0002)\n")
		}
	}
	out, err := Read(&noisy)
	if err != nil {
		t.Fatal(err)
	}
	for n, b := range files {
		if !bytes.Equal(out.Files[n], b) {
			t.Errorf("file %s: got %d bytes, want %d", n, len(out.Files[n]), len(b))
		}
	}
	if len(out.Files) != len(files) {
		t.Errorf("got files %v", len(out.Files))
	}
	if out.Done != "degraded" || out.Timeline["uinit-start"] != 7.123 {
		t.Errorf("done %q timeline %v", out.Done, out.Timeline)
	}
}

func TestReadCorrupt(t *testing.T) {
	var con bytes.Buffer
	File(&con, "manifest.json", []byte("hello world, this is the manifest"))
	good := con.String()
	tests := []struct {
		name, capture, want string
	}{
		{"flipped byte", strings.Replace(good, "aGVsbG8", "aGVsbG9", 1), "manifest.json"},
		{"truncated", good[:strings.Index(good, endPrefix)], "no end line"},
		{"bad size", strings.Replace(good, " 33 ", " 34 ", 1), "34"},
		{"malformed begin", beginPrefix + "x===\n", "malformed begin"},
	}
	for _, tt := range tests {
		_, err := Read(strings.NewReader(tt.capture))
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: err = %v, want %q", tt.name, err, tt.want)
		}
	}
	if err := File(&con, "a b", nil); err == nil {
		t.Error("File accepted a name with a space")
	}
}

func TestMarkWithoutUptime(t *testing.T) {
	var con bytes.Buffer
	if _, err := Mark(&con, t.TempDir(), "handoff"); err == nil {
		t.Error("no error for a missing /proc/uptime")
	}
	if con.String() != "PASSAGE-T handoff -1.000\n" {
		t.Errorf("marker = %q", con.String())
	}
}

func FuzzRead(f *testing.F) {
	var con bytes.Buffer
	File(&con, "manifest.json", []byte(`{"schema":1}`))
	Done(&con, "ok")
	f.Add(con.String())
	f.Add("PASSAGE-T uinit-start 7.001\n" + beginPrefix + "x 0 e3b0===\n" + endPrefix + "x===\n")
	f.Fuzz(func(t *testing.T, s string) {
		out, err := Read(strings.NewReader(s))
		if err != nil {
			return
		}
		// Whatever Read accepts must survive a second round trip unchanged.
		var again bytes.Buffer
		for n, b := range out.Files {
			if err := File(&again, n, b); err != nil {
				t.Fatalf("re-emit %q: %v", n, err)
			}
		}
		out2, err := Read(&again)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(len(out2.Files), len(out.Files)) {
			t.Fatalf("files %d != %d", len(out2.Files), len(out.Files))
		}
	})
}
