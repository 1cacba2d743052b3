package main

import (
	"context"
	"crypto/ed25519"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/google/go-tpm-tools/simulator"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/passage-boot/passage/bench"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/manifest/tpmkey"
)

// nodeFiles are the /proc and /sys files manifest.Build reads, as on a B300 node.
var nodeFiles = map[string]string{
	"proc/sys/kernel/random/boot_id":  manifesttest.BootID + "\n",
	"proc/sys/kernel/hostname":        "b300-r07-n3\n",
	"proc/sys/kernel/osrelease":       "6.12.48\n",
	"proc/cmdline":                    "console=ttyS0 passage.handoff=poweroff\n",
	"sys/class/dmi/id/product_serial": "S3R1AL-0042\n",
	"sys/class/dmi/id/product_uuid":   "4c4c4544-0042-3810-8057-b3c04f4b4d32\n",
	"sys/class/dmi/id/sys_vendor":     "Supermicro\n",
	"sys/class/dmi/id/product_name":   "SYS-A22GA-NBRT\n",
	"sys/class/dmi/id/board_name":     "X14DBG-AP\n",
}

// buildB300 is the boot stage's manifest content for a whole B300 node: identity from the
// root, units, guest plan and stages from the fixture.
func buildB300(root string, gen uint64) (*manifest.Manifest, error) {
	m, err := manifest.Build(root, time.Now())
	if err != nil {
		return nil, err
	}
	full := manifesttest.B300(gen)
	m.Generation, m.Profile, m.Units, m.GuestPlan, m.Stages = gen, full.Profile, full.Units, full.GuestPlan, full.Stages
	return m, nil
}

func rowManifest(e *env, t *table, w io.Writer) error {
	root := filepath.Join(e.scratch, "manifest-root")
	for rel, content := range nodeFiles {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			return err
		}
	}
	// The manifest is written where the boot stage writes it: a real file system, with
	// the fsyncs that cost there (tmpfs would hide them).
	outDir, err := os.MkdirTemp("", "passage-bench-manifest-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(outDir)

	_, priv, err := ed25519.GenerateKey(nil)
	if err != nil {
		return err
	}
	ed, err := manifest.NewEd25519Signer(priv)
	if err != nil {
		return err
	}
	edv, err := manifest.NewVerifier(priv.Public())
	if err != nil {
		return err
	}
	sim, err := simulator.Get()
	if err != nil {
		return fmt.Errorf("tpm simulator: %w", err)
	}
	k, err := tpmkey.New(transport.FromReadWriteCloser(sim))
	if err != nil {
		sim.Close()
		return fmt.Errorf("tpm simulator: %w", err)
	}
	defer k.Close()
	tpmv, err := manifest.NewVerifier(k.Public())
	if err != nil {
		return err
	}
	ctx := context.Background()
	var edEnv, tpmEnv []byte
	gen := uint64(0)
	s, err := bench.Measure(e.rounds,
		bench.Side{Name: "ed25519 build+sign+write", Run: func() error {
			gen++
			m, err := buildB300(root, gen)
			if err != nil {
				return err
			}
			signed, err := manifest.WriteSigned(ctx, m, outDir, "ed.dsse.json", nil, ed)
			if err == nil {
				edEnv = signed.Envelope
			}
			return err
		}},
		bench.Side{Name: "ed25519 verify", Run: func() error {
			_, err := manifest.Verify(edEnv, edv, manifest.VerifyOptions{BootID: manifesttest.BootID})
			return err
		}},
		bench.Side{Name: "tpm build+sign+write+extend", Run: func() error {
			g, src, err := manifest.NextGeneration(k)
			if err != nil {
				return err
			}
			m, err := buildB300(root, g)
			if err != nil {
				return err
			}
			m.GenerationSource = src
			signed, err := manifest.WriteSigned(ctx, m, outDir, "tpm.dsse.json", k, k)
			if err == nil {
				tpmEnv = signed.Envelope
			}
			return err
		}},
		bench.Side{Name: "tpm verify", Run: func() error {
			_, err := manifest.Verify(tpmEnv, tpmv, manifest.VerifyOptions{BootID: manifesttest.BootID})
			return err
		}},
	)
	if err != nil {
		return err
	}
	in := "B300 manifest (8 units, 32 fns)"
	add := func(id, what string, sm bench.Sample, note string) {
		t.add(row{id: id, what: what, input: in, passage: dur(sm.Median), note: note})
	}
	add("5a", "manifest: build+sign+write, ed25519", s[0], fmt.Sprintf("envelope %d B; atomic write with fsyncs on %s", len(edEnv), os.TempDir()))
	add("5b", "manifest: verify, ed25519", s[1], "")
	add("5c", "manifest: build+sign+write+PCR extend, TPM", s[2], fmt.Sprintf("go-tpm-tools simulator in-process (no bus latency); NV counter generation; envelope %d B", len(tpmEnv)))
	add("5d", "manifest: verify, TPM key (ECDSA P-256)", s[3], "")
	return nil
}
