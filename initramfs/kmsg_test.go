package initramfs

import (
	"bytes"
	"strings"
	"testing"
)

func TestKmsg(t *testing.T) {
	var log bytes.Buffer
	k := NewKmsg(&log)
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
	// A line longer than a record is cut, not lost or split into many.
	log.Reset()
	k.Write([]byte("passage: " + strings.Repeat("x", 5000) + "\n"))
	if n := strings.Count(log.String(), "\n"); n != 1 || len(log.String()) > 1024 {
		t.Errorf("long line: %d records, %d bytes", n, len(log.String()))
	}
}
