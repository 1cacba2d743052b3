package manifest_test

import (
	"context"
	"testing"
	"time"

	. "github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// BenchmarkBuildSignWriteEd25519 is the boot stage's manifest step for a whole B300 node
// (8 units x 4 functions): read node identity, fill, sign, write atomically with fsyncs.
func BenchmarkBuildSignWriteEd25519(b *testing.B) {
	root := writeRoot(b, defaultRootFiles())
	dir := b.TempDir()
	s := testSigner(b, 1)
	full := manifesttest.B300(1)
	var size int
	for i := 0; b.Loop(); i++ {
		m, err := Build(root, time.Now())
		if err != nil {
			b.Fatal(err)
		}
		m.Generation, m.Profile, m.Units, m.GuestPlan, m.Stages = uint64(i), full.Profile, full.Units, full.GuestPlan, full.Stages
		signed, err := WriteSigned(context.Background(), m, dir, "manifest.dsse.json", nil, s)
		if err != nil {
			b.Fatal(err)
		}
		size = len(signed.Envelope)
	}
	b.ReportMetric(float64(size), "envelope-bytes")
}

func BenchmarkVerifyEd25519(b *testing.B) {
	signed, err := Sign(context.Background(), manifesttest.B300(1), testSigner(b, 1))
	if err != nil {
		b.Fatal(err)
	}
	v := testVerifier(b, 1)
	for b.Loop() {
		if _, err := Verify(signed.Envelope, v, VerifyOptions{MinGeneration: 1, BootID: testBootID}); err != nil {
			b.Fatal(err)
		}
	}
}
