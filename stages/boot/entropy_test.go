package boot

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-tpm-tools/simulator"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/passage-boot/passage/entropy/entropytest"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
	"github.com/passage-boot/passage/stages"
)

// The boot's stages up to the signed manifest, with every random source of the process
// blocked (a node whose kernel random pool is not ready): the TPM key is created inside
// the TPM, ed25519 signatures are deterministic, temp file names come from the runtime's
// generator, and the envelope verifies with both keys. Nothing reads a blocked source.
// (The network stage's DHCP and publish are covered in initramfs/netboot.)
func TestBootPathWithBlockedRandomSource(t *testing.T) {
	sim, err := simulator.Get() // seeds itself from crypto/rand: before Block
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	root, edv := signingNode(t)
	open := func(string) (manifest.Signer, manifest.Measurer, error) {
		k, err := tpmkey.New(transport.FromReadWriteCloser(keepOpen{sim}))
		if err != nil {
			return nil, nil, err
		}
		return k, k, nil
	}
	blk := entropytest.Block(t)
	b := &Boot{Root: root, OpenTPM: open, Sysfs: nil, DryRun: true,
		Config: initramfs.ParseCmdline("passage.profile=b300 passage.tpm=on passage.key=/etc/passage/passage.key passage.net=off")}
	var rs []stages.Result
	var runErr error
	within := 20 * time.Second
	done := make(chan struct{})
	go func() {
		defer close(done)
		list := []stages.Stage{}
		for _, s := range b.Stages() {
			if s.Name != "modules" && s.Name != "host" && s.Name != "network" && s.Name != "publish" && s.Name != "push" { // kernel modules and NICs: not in a synthetic tree
				list = append(list, s)
			}
		}
		rs, runErr = (&stages.Runner{Stages: list, Timeout: within}).Run(context.Background(), &stages.State{})
	}()
	select {
	case <-done:
	case <-time.After(within + 5*time.Second):
		t.Fatalf("the boot's stages did not finish in %v with the random sources blocked (%d reads)", within, blk.Calls())
	}
	if runErr != nil {
		t.Fatalf("runner: %v", runErr)
	}
	for _, r := range rs {
		if r.Status == stages.Failed {
			t.Errorf("stage %s failed: %v", r.Name, r.Err)
		}
	}
	if n := blk.Calls(); n != 0 {
		t.Errorf("%d reads from a blocked random source on the boot path", n)
	}
	env, err := os.ReadFile(filepath.Join(root, "run/passage", EnvelopeName))
	if err != nil {
		t.Fatal(err)
	}
	k, err := tpmkey.New(transport.FromReadWriteCloser(keepOpen{sim}))
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	tv, err := manifest.NewVerifier(k.Public())
	if err != nil {
		t.Fatal(err)
	}
	for name, v := range map[string]manifest.Verifier{"tpm": tv, "ed25519": edv} {
		// A dry run's ready units are not bound: the payload is refused as a
		// contradiction, which Verify checks only after the signature verified.
		if _, err := manifest.Verify(env, v, manifest.VerifyOptions{}); !errors.Is(err, manifest.ErrContradiction) {
			t.Errorf("verify with the %s key: %v, want the signature good and the dry run's payload refused", name, err)
		}
	}
}

// A publish stage that runs out of time says what it was waiting on: here a server that
// accepts the request and never answers (loopback only).
func TestPublishStageNamesWhatItWaitedOn(t *testing.T) {
	hang := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-hang:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(hang)
	b := &Boot{Root: t.TempDir(), Config: initramfs.ParseCmdline("passage.url=" + srv.URL + "/m"),
		Signed: &manifest.Signed{Envelope: []byte("{}"), Digest: "sha256:00"}}
	var publish stages.Stage
	for _, s := range b.Stages() {
		if s.Name == "publish" {
			publish = s
		}
	}
	publish.Needs = nil // run alone: no network or manifest stage before it
	rs, err := (&stages.Runner{Stages: []stages.Stage{publish}, Timeout: 300 * time.Millisecond, Grace: time.Second}).Run(context.Background(), &stages.State{})
	if err != nil {
		t.Fatal(err)
	}
	if r := rs[0]; r.Status != stages.Failed || r.Err == nil || !strings.Contains(r.Err.Error(), "waiting for a response from "+srv.URL+"/m") {
		t.Errorf("publish: %s %v, want failed naming the response it waited for", r.Status, r.Err)
	} else {
		t.Logf("publish: %v", r.Err)
	}
}
