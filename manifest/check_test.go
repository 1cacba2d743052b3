package manifest_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	. "github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// A payload signed by the node's own key that contradicts itself is refused by Verify
// (so by verify, render, metrics and the units view), each with its reason; the
// signature is checked first, so the kind also says the signature was good.
func TestVerifyRefusesContradictions(t *testing.T) {
	erased := func(m *Manifest, policy string) *UnitErase {
		e := &UnitErase{Policy: policy, ResetClears: ResetClears,
			NVMe:   []NVMeErase{{BDF: m.Units[0].Functions[3].BDF, Method: "sanitize-crypto-erase", VerifiedLBAs: 64}},
			Resets: []Reset{{BDF: m.Units[0].Functions[0].BDF, Methods: "flr", Result: "done"}}}
		return e
	}
	for _, tc := range []struct {
		name   string
		edit   func(m *Manifest)
		reason string // "" : accepted
	}{
		{"as built", func(m *Manifest) {}, ""},
		{"erased under require", func(m *Manifest) { m.Units[0].Erase = erased(m, "require") }, ""},
		{"failed unit on nvme", func(m *Manifest) {
			m.Units[0].Status = StatusFailed
			m.Units[0].Functions[3].DriverAfter = "nvme"
			m.Units[0].Functions[0].IOMMUGroup = -1
		}, ""},
		{"ready on nvme", func(m *Manifest) { m.Units[0].Functions[3].DriverAfter = "nvme" }, `unit "gpu0" is ready: function 0000:24:00.0: driver_after "nvme", want vfio-pci`},
		{"degraded unbound", func(m *Manifest) { m.Units[1].Status = StatusDegraded; m.Units[1].Functions[0].DriverAfter = "" }, `unit "gpu1" is degraded: function 0000:42:00.0: driver_after "", want vfio-pci`},
		{"ready without a group", func(m *Manifest) { m.Units[0].Functions[0].IOMMUGroup = -1 }, `function 0000:22:00.0: iommu_group -1: no IOMMU group`},
		{"same BDF in two units", func(m *Manifest) { m.Units[1].Functions[2].BDF = m.Units[0].Functions[1].BDF }, `unit "gpu1": function "0000:1f:00.0" also in unit "gpu0"`},
		{"same BDF twice in a unit", func(m *Manifest) { m.Units[2].Functions[2].BDF = m.Units[2].Functions[1].BDF }, `unit "gpu2": function "0000:5f:00.0" also in unit "gpu2"`},
		{"status Ready", func(m *Manifest) { m.Units[3].Status = "Ready" }, `unit "gpu3": status "Ready": want ready, degraded or failed`},
		{"status empty", func(m *Manifest) { m.Units[3].Status = "" }, `unit "gpu3": status ""`},
		{"unit twice", func(m *Manifest) {
			m.Units[4].ID = "gpu5"
		}, `unit "gpu5": listed twice`},
		{"unit without id", func(m *Manifest) { m.Units[4].ID = "" }, `unit #4: no id`},
		{"ready, require, not erased", func(m *Manifest) {
			e := erased(m, "require")
			e.NVMe[0].Method, e.NVMe[0].Error = "", "sanitize: aborted"
			m.Units[0].Erase = e
		}, `unit "gpu0" is ready under erase policy require: erase 0000:24:00.0: sanitize: aborted`},
		{"ready, require, no method", func(m *Manifest) {
			e := erased(m, "require")
			e.NVMe[0].Method = ""
			m.Units[0].Erase = e
		}, `erase 0000:24:00.0: not erased`},
		{"ready, require, zero blocks verified", func(m *Manifest) {
			e := erased(m, "require")
			e.NVMe[0].VerifiedLBAs = 0
			m.Units[0].Erase = e
		}, `erase 0000:24:00.0: 0 blocks verified`},
		{"ready, require, reset not done", func(m *Manifest) {
			e := erased(m, "require")
			e.Resets[0].Result = "flr: timed out"
			m.Units[0].Erase = e
		}, `reset 0000:22:00.0: flr: timed out`},
		{"ready, require, unit error", func(m *Manifest) {
			e := erased(m, "require")
			e.Error = "stage deadline"
			m.Units[0].Erase = e
		}, `erase: stage deadline`},
		// Under auto a unit whose erase failed is degraded, and may be: the record says so.
		{"degraded, auto, not erased", func(m *Manifest) {
			e := erased(m, "auto")
			e.NVMe[0].Method, e.NVMe[0].Error = "", "no method"
			m.Units[0].Erase, m.Units[0].Status = e, StatusDegraded
		}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := manifesttest.B300(3)
			tc.edit(m)
			s, err := Sign(context.Background(), m, testSigner(t, 1))
			if err != nil {
				t.Fatal(err)
			}
			_, err = Verify(s.Envelope, testVerifier(t, 1), VerifyOptions{})
			if tc.reason == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrContradiction) || !strings.Contains(err.Error(), tc.reason) {
				t.Fatalf("got %v\nwant %v naming %q", err, ErrContradiction, tc.reason)
			}
			if strings.Contains(err.Error(), "\n") {
				t.Errorf("reason spans lines: %q", err)
			}
		})
	}
}
