package main

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
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

// TestTurnaroundProfileBeneathRoot: a profile that the host's passage.profile= names by
// path is the host's file, read beneath --root (the container sees the host's
// /etc/passage under /host); a built-in name stays a name; a path on the command line
// that the root does not hold is refused naming the path beneath the root.
func TestTurnaroundProfileBeneathRoot(t *testing.T) {
	profile, err := os.ReadFile(filepath.Join("..", "..", "..", "topology", "profiles", "qemu.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		cmdline, file, want, refused string
	}{
		{"passage.profile=/etc/passage/profiles/node.yaml", "etc/passage/profiles/node.yaml", "ROOT/etc/passage/profiles/node.yaml", ""},
		{"passage.profile=qemu", "", "qemu", ""},
		{"", "", "b300", ""},
		{"passage.profile=/etc/passage/profiles/gone.yaml", "", "", "ROOT/etc/passage/profiles/gone.yaml"},
	} {
		root := t.TempDir()
		os.MkdirAll(filepath.Join(root, "proc"), 0o755)
		if err := os.WriteFile(filepath.Join(root, "proc", "cmdline"), []byte("console=ttyS0 "+c.cmdline+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if c.file != "" {
			os.MkdirAll(filepath.Dir(filepath.Join(root, c.file)), 0o755)
			if err := os.WriteFile(filepath.Join(root, c.file), profile, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		f := &turnFlags{on: true, url: "https://127.0.0.1:1/", tries: 1, backoff: time.Second, timeout: time.Second, poll: time.Second}
		tr, err := f.turnaround(root)
		if c.refused != "" {
			if want := strings.ReplaceAll(c.refused, "ROOT", root); err == nil || !strings.Contains(err.Error(), want) {
				t.Fatalf("%q: %v, want a refusal naming %s", c.cmdline, err, want)
			}
			continue
		}
		if want := strings.ReplaceAll(c.want, "ROOT", root); err != nil || tr.Profile != want {
			t.Fatalf("%q: %+v, %v; want profile %s", c.cmdline, tr, err, want)
		}
	}
}

// TestKubeletCertFlags: the renewal's flags reach its options from the command line,
// and a lifetime under the API server's minimum or a wait that is not a period is
// refused naming the flag.
func TestKubeletCertFlags(t *testing.T) {
	parse := func(extra ...string) (*kubeletFlags, int, string) {
		fs := flag.NewFlagSet("passage-dra plugin", flag.ContinueOnError)
		o := &options{}
		o.register(fs)
		var stderr bytes.Buffer
		fs.SetOutput(&stderr)
		args := append([]string{"--pub", t.TempDir(), "--manifest", "m.json", "--root", t.TempDir(), "--passage-url", "https://127.0.0.1:1/"}, extra...)
		_, p, code := pluginConfig(fs, args, o, &stderr)
		return &p.kubelet, code, stderr.String()
	}
	f, code, msg := parse("--kubelet-cert-lifetime", "15m", "--kubelet-cert-dir", "/run/k", "--kubelet-kubeconfig", "/run/k/c.conf", "--kubelet-cert-wait", "1m")
	if code != 0 || f.lifetime != 15*time.Minute || f.certDir != "/run/k" || f.kubeconfig != "/run/k/c.conf" || f.wait != time.Minute {
		t.Fatalf("exit %d %s: %+v", code, msg, f)
	}
	if _, code, msg := parse("--kubelet-cert-lifetime", "5m"); code != 2 || !strings.Contains(msg, "--kubelet-cert-lifetime 5m0s") {
		t.Fatalf("--kubelet-cert-lifetime 5m: exit %d %s", code, msg)
	}
	if _, code, msg := parse("--kubelet-cert-wait", "0s"); code != 2 || !strings.Contains(msg, "--kubelet-cert-wait 0s") {
		t.Fatalf("--kubelet-cert-wait 0s: exit %d %s", code, msg)
	}
}
