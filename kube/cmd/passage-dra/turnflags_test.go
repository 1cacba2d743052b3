package main

import (
	"bytes"
	"flag"
	"strings"
	"testing"
	"time"
)

// TestTurnaroundFlags: the turnaround's flags reach plugin.Turnaround, and a period that
// is not positive is refused naming it.
func TestTurnaroundFlags(t *testing.T) {
	parse := func(extra ...string) (*turnFlags, int, string) {
		fs := flag.NewFlagSet("passage-dra plugin", flag.ContinueOnError)
		o := &options{}
		o.register(fs)
		var stderr bytes.Buffer
		fs.SetOutput(&stderr)
		args := append([]string{"--pub", t.TempDir(), "--manifest", "m.json", "--root", t.TempDir(), "--passage-url", "https://127.0.0.1:1/"}, extra...)
		cfg, p, code := pluginConfig(fs, args, o, &stderr)
		if code == 0 && (cfg.Turnaround == nil || cfg.Turnaround.Poll != p.turn.poll || cfg.Turnaround.Tries != p.turn.tries || cfg.Turnaround.Backoff != p.turn.backoff) {
			t.Fatalf("flags %v: turnaround %+v", extra, cfg.Turnaround)
		}
		return &p.turn, code, stderr.String()
	}
	f, code, msg := parse("--recycle-poll", "250ms", "--recycle-tries", "2", "--recycle-backoff", "1s")
	if code != 0 || f.poll != 250*time.Millisecond || f.tries != 2 || f.backoff != time.Second {
		t.Fatalf("exit %d %s: %+v", code, msg, f)
	}
	if _, code, msg := parse("--recycle-poll", "0s"); code != 2 || !strings.Contains(msg, "--recycle-poll 0s") {
		t.Fatalf("--recycle-poll 0s: exit %d %s", code, msg)
	}
}
