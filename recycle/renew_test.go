package recycle_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/passage-boot/passage/initramfs/kubelet"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/recycle"
)

// countingPCR measures into nothing and counts what it was given.
type countingPCR struct{ extends int }

func (*countingPCR) PCR() int                         { return 13 }
func (*countingPCR) Banks() []string                  { return []string{"sha256"} }
func (p *countingPCR) Extend(map[string][]byte) error { p.extends++; return nil }

// bootManifest rewrites the node's generation 1 as a boot that made a kubelet key and
// whose unit gpu2 failed, and returns it.
func (n *node) bootManifest(t *testing.T) *manifest.Manifest {
	t.Helper()
	m := n.latest(t)
	m.Node.KubeletKey = manifesttest.KubeletKey
	m.Node.Hostname = "b300-a"
	u := unitOf(m, "gpu2")
	u.Status, u.Reasons = manifest.StatusFailed, []string{"erase nvme 0000:1b:00.0: sanitize failed"}
	if _, err := manifest.WriteSigned(context.Background(), m, n.dir, recycle.EnvelopeName, nil, n.signer); err != nil {
		t.Fatal(err)
	}
	return m
}

// TestRenew: a renewal's generation carries every unit exactly as the previous one
// says (a failed unit stays failed with its reasons), the same NVLink layout, profile and
// hostname, and a new kubelet key's digest in place of the old; it is signed, measured
// and attested as every generation is, and no sysfs file is written.
func TestRenew(t *testing.T) {
	n := newNode(t)
	prev := n.bootManifest(t)
	o := n.opts()
	meas := &countingPCR{}
	o.Measurer = meas
	var attested [][]byte
	o.Attest = func(dir string, signed *manifest.Signed) error {
		attested = append(attested, signed.Payload)
		return nil
	}
	n.k.ResetWrites()
	r, err := recycle.Renew(context.Background(), o, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := n.latest(t)
	if got.Generation <= prev.Generation || got.Generation != r.Manifest.Generation {
		t.Fatalf("generation %d after %d (renewal says %d)", got.Generation, prev.Generation, r.Manifest.Generation)
	}
	want, err := kubelet.Digest(r.Key.Public())
	if err != nil {
		t.Fatal(err)
	}
	if got.Node.KubeletKey != want || r.Digest != want || r.Previous != manifesttest.KubeletKey {
		t.Fatalf("kubelet key %q, renewal's %q (key's %q), previous %q; want the new key's in place of %q",
			got.Node.KubeletKey, r.Digest, want, r.Previous, manifesttest.KubeletKey)
	}
	if !reflect.DeepEqual(got.Units, prev.Units) {
		t.Errorf("units changed:\n got %+v\nwant %+v", got.Units, prev.Units)
	}
	if u := unitOf(got, "gpu2"); u.Status != manifest.StatusFailed || len(u.Reasons) != 1 {
		t.Errorf("gpu2 %s %v, want failed with its reason", u.Status, u.Reasons)
	}
	if !reflect.DeepEqual(got.NVLink, prev.NVLink) || got.Profile != prev.Profile || got.Node.Hostname != "b300-a" || got.BootID != prev.BootID {
		t.Errorf("nvlink %v profile %v hostname %q boot %s; want the previous generation's", got.NVLink, got.Profile, got.Node.Hostname, got.BootID)
	}
	if meas.extends != 1 || len(attested) != 1 || !bytes.Equal(attested[0], r.Signed.Payload) || r.Unattested != nil {
		t.Errorf("measured %d times, attested %d (the renewal's payload: %v), unattested %v; want once each", meas.extends, len(attested),
			len(attested) == 1 && bytes.Equal(attested[0], r.Signed.Payload), r.Unattested)
	}
	if w := n.k.Writes(); len(w) != 0 {
		t.Errorf("a renewal wrote %d sysfs files: %v", len(w), w)
	}
	// A second renewal replaces the key again: the first one's is gone.
	r2, err := recycle.Renew(context.Background(), o, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := n.latest(t); got.Node.KubeletKey != r2.Digest || r2.Digest == r.Digest || r2.Previous != r.Digest {
		t.Errorf("second renewal: key %q (renewal's %q, first's %q, previous %q)", got.Node.KubeletKey, r2.Digest, r.Digest, r2.Previous)
	}
}

// TestRenewRefuses: a renewal with nothing of this boot to carry, no counter or no
// randomness writes nothing; one whose attestation fails is written, says why it is
// not attested, and leaves no attestation of an older generation beside it.
func TestRenewRefuses(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(t *testing.T, n *node, o *recycle.Options)
		random func(int) ([]byte, error)
		want   error
		says   string
	}{
		{name: "another boot's manifest", want: recycle.ErrNoBootManifest, says: "is of boot",
			change: func(t *testing.T, n *node, o *recycle.Options) {
				if err := os.WriteFile(filepath.Join(n.root, "proc/sys/kernel/random/boot_id"), []byte("0d1e2f3a-4b5c-4d6e-8f70-8192a3b4c5d6\n"), 0o644); err != nil {
					t.Fatal(err)
				}
			}},
		{name: "a manifest that does not verify", want: recycle.ErrNoBootManifest,
			change: func(t *testing.T, n *node, o *recycle.Options) {
				_, pub, err := manifest.GenerateKey(t.TempDir())
				if err != nil {
					t.Fatal(err)
				}
				if o.Verifier, err = manifest.LoadVerifier(pub); err != nil {
					t.Fatal(err)
				}
			}},
		{name: "no manifest", want: recycle.ErrNoBootManifest,
			change: func(t *testing.T, n *node, o *recycle.Options) { os.Remove(filepath.Join(n.dir, recycle.EnvelopeName)) }},
		{name: "no counter", want: recycle.ErrNoCounter,
			change: func(t *testing.T, n *node, o *recycle.Options) { o.Counters = nil }},
		{name: "no randomness", says: "entropy gone",
			random: func(int) ([]byte, error) { return nil, errors.New("entropy gone") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t)
			n.bootManifest(t)
			o := n.opts()
			if tc.change != nil {
				tc.change(t, n, &o)
			}
			before, _ := os.ReadFile(filepath.Join(n.dir, recycle.EnvelopeName))
			r, err := recycle.Renew(context.Background(), o, tc.random)
			if err == nil || r != nil || (tc.want != nil && !errors.Is(err, tc.want)) || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("renewal %+v, %v; want %v saying %q", r, err, tc.want, tc.says)
			}
			after, _ := os.ReadFile(filepath.Join(n.dir, recycle.EnvelopeName))
			if !bytes.Equal(before, after) {
				t.Errorf("refused (%v), yet the manifest was rewritten", err)
			}
			if b, _ := os.ReadFile(n.gen); strings.TrimSpace(string(b)) != "1" {
				t.Errorf("refused (%v), yet the counter says %q", err, b)
			}
		})
	}

	t.Run("attestation fails", func(t *testing.T) {
		n := newNode(t)
		n.bootManifest(t)
		att := filepath.Join(n.dir, recycle.EnvelopeName+recycle.AttestationSuffix)
		if err := os.WriteFile(att, []byte(`{}`), 0o644); err != nil {
			t.Fatal(err)
		}
		o := n.opts()
		o.Measurer = &countingPCR{}
		o.Attest = func(string, *manifest.Signed) error { return errors.New("tpm busy") }
		r, err := recycle.Renew(context.Background(), o, nil)
		if err != nil {
			t.Fatal(err)
		}
		if r.Unattested == nil || !strings.Contains(r.Unattested.Error(), "tpm busy") {
			t.Errorf("unattested %v, want the attestation's failure", r.Unattested)
		}
		if _, err := os.Stat(att); !os.IsNotExist(err) {
			t.Errorf("an older generation's attestation stays beside generation %d: %v", r.Manifest.Generation, err)
		}
	})
}
