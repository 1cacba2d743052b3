package initramfs

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestKmsg(t *testing.T) {
	var log bytes.Buffer
	settled := 0
	k := NewKmsg(&log, func() { settled++ })
	console := "passage (devel) (revision unknown, go1.26.0)\n" +
		"PASSAGE-T uinit-start 3.190\n" +
		"passage: scan      ok         0.051s  (1 findings, 0 changes)\n" +
		"passage: ac" // a line written in two parts
	rest := "s       degraded   0.012s\n" +
		"UNIT  GPU           NICS  STATUS  WHY\n" +
		"===PASSAGE-FILE-BEGIN manifest.json 10 abcd===\n" +
		"eyJzY2hlbWFfdmVyc2lvbiI6M30=\n" +
		"===PASSAGE-FILE-END manifest.json===\n" +
		"passage: boot failed\n" +
		"===PASSAGE-DONE failed===\n"
	for _, p := range []string{console, rest} {
		if n, err := k.Write([]byte(p)); n != len(p) || err != nil {
			t.Fatalf("Write = %d, %v", n, err)
		}
	}
	want := "<15>passage: passage (devel) (revision unknown, go1.26.0)\n" +
		"<15>passage: scan      ok         0.051s  (1 findings, 0 changes)\n" +
		"<12>passage: acs       degraded   0.012s\n" +
		"<15>passage: UNIT  GPU           NICS  STATUS  WHY\n" +
		"<11>passage: boot failed\n"
	if log.String() != want {
		t.Errorf("kmsg records:\n%s\nwant:\n%s", log.String(), want)
	}
	if settled != 2 {
		t.Errorf("the console settled %d times, want before each of the 2 records the kernel echoes", settled)
	}
	// A line longer than a record is cut, not lost or split into many.
	log.Reset()
	k.Write([]byte("passage: " + strings.Repeat("x", 5000) + "\n"))
	if n := strings.Count(log.String(), "\n"); n != 1 || len(log.String()) > 1024 {
		t.Errorf("long line: %d records, %d bytes", n, len(log.String()))
	}
}

func TestKmsgUnlimited(t *testing.T) {
	for _, tt := range []struct{ before, during string }{
		{"ratelimit\n", "on\n"},
		{"off\n", "off\n"}, // the operator's printk.devkmsg=off stands
		{"on\n", "on\n"},
	} {
		root := t.TempDir()
		p := filepath.Join(root, "proc", "sys", "kernel", "printk_devkmsg")
		os.MkdirAll(filepath.Dir(p), 0o755)
		os.WriteFile(p, []byte(tt.before), 0o644)
		restore, err := KmsgUnlimited(root)
		if err != nil {
			t.Fatal(err)
		}
		if b, _ := os.ReadFile(p); string(b) != tt.during {
			t.Errorf("%q: during the boot %q, want %q", tt.before, b, tt.during)
		}
		if err := restore(); err != nil {
			t.Fatal(err)
		}
		if b, _ := os.ReadFile(p); string(b) != tt.before {
			t.Errorf("%q: after the restore %q", tt.before, b)
		}
	}
	if _, err := KmsgUnlimited(t.TempDir()); err == nil {
		t.Error("no printk_devkmsg: no error")
	}
}
