package emit

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestMarkWithoutUptime(t *testing.T) {
	var con bytes.Buffer
	if _, err := Mark(&con, t.TempDir(), "handoff"); err == nil {
		t.Error("no error for a missing /proc/uptime")
	}
	if con.String() != "PASSAGE-T handoff -1.000\n" {
		t.Errorf("marker = %q", con.String())
	}
	// The reader keeps such a marker as "time unknown", listed after the known ones.
	rep, err := Parse(strings.NewReader("PASSAGE-T uinit-start 3.990\n" + con.String()))
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := rep.Markers["handoff"]; !ok || v != -1 {
		t.Errorf("handoff marker = %v, %v; want -1", v, ok)
	}
	tl := rep.Timeline()
	if !strings.Contains(tl, "uptime unreadable") || strings.Index(tl, "handoff") < strings.Index(tl, "uinit-start") {
		t.Errorf("timeline:\n%s", tl)
	}
}

func TestUptimeNotATime(t *testing.T) {
	for _, content := range []string{"NaN 1.0\n", "+Inf 1.0\n", "-3.5 1.0\n", "\n", "x 1\n"} {
		root := t.TempDir()
		os.MkdirAll(filepath.Join(root, "proc"), 0o755)
		os.WriteFile(filepath.Join(root, "proc", "uptime"), []byte(content), 0o644)
		if v, err := Uptime(root); err == nil || !strings.Contains(err.Error(), "uptime") {
			t.Errorf("Uptime(%q) = %v, %v; want an error naming uptime", content, v, err)
		}
		var con bytes.Buffer
		Mark(&con, root, "handoff")
		if con.String() != "PASSAGE-T handoff -1.000\n" {
			t.Errorf("uptime %q: marker = %q", content, con.String())
		}
	}
}

// The encoder refuses what the decoder could not read back.
func TestEncoderRefuses(t *testing.T) {
	var con bytes.Buffer
	for _, name := range []string{"", "a b", "a\tb", "a\rb", "dir/file", ".", ".."} {
		if err := File(&con, name, []byte("x")); err == nil {
			t.Errorf("File accepted name %q", name)
		}
	}
	if err := Done(&con, "skipped"); err == nil || !strings.Contains(err.Error(), "skipped") {
		t.Errorf("Done(skipped) = %v", err)
	}
	for _, ev := range []string{"", "Handoff", "hand off", "7up", "done==="} {
		if _, err := Mark(&con, t.TempDir(), ev); err == nil {
			t.Errorf("Mark accepted event %q", ev)
		}
	}
	if con.Len() != 0 {
		t.Errorf("refused calls wrote %q", con.String())
	}
}

// TestDirSkipsDotNames: the generation lock and a write's leftover temporary are not the
// boot's files: Dir emits neither.
func TestDirSkipsDotNames(t *testing.T) {
	dir := t.TempDir()
	for name, body := range map[string]string{"manifest.dsse.json": "{}", ".generation.lock": "pid 1 (passage) boot since 2026-03-01T00:00:00Z\n", ".manifest.dsse.json.tmp123": "{"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	var out strings.Builder
	if err := Dir(&out, dir); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "manifest.dsse.json") || strings.Contains(out.String(), ".generation.lock") || strings.Contains(out.String(), ".tmp123") {
		t.Errorf("Dir emitted:\n%s", out.String())
	}
}
