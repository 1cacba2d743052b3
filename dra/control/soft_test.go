package control_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/softtpm"
	"github.com/passage-boot/passage/dra/control"
	"github.com/passage-boot/passage/dra/control/controltest"
	"github.com/passage-boot/passage/initramfs/netboot"
)

// TestSoftNodesBoot: nodes whose TPM is done in software (the boot storm's load
// generator) boot at once through the boot's own exchange (netboot) and are enrolled and
// verified by the unrelaxed control plane; one whose EK certificate is from another CA
// is refused naming it.
func TestSoftNodesBoot(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	ca, err := softtpm.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	if e.srv.EKCA, err = attest.CAPool(ca.PEM()); err != nil {
		t.Fatal(err)
	}
	fw, err := softtpm.NewFirmware(e.log)
	if err != nil {
		t.Fatal(err)
	}
	stranger, err := softtpm.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	const n = 4
	nodes := make([]*controltest.SoftNode, n+1)
	for i := range nodes {
		ek, err := softtpm.GenerateEK()
		if err != nil {
			t.Fatal(err)
		}
		issuer := ca
		if i == n {
			issuer = stranger
		}
		if nodes[i], err = controltest.NewSoftNode(ctx, issuer, ek, fw, fmt.Sprintf("soft-%d", i), 1); err != nil {
			t.Fatal(err)
		}
	}
	p := netboot.PublishPolicy{Tries: 1}
	errs := make([]error, len(nodes))
	times := make([]*controltest.BootTimes, len(nodes))
	var wg sync.WaitGroup
	for i, sn := range nodes {
		wg.Go(func() { times[i], errs[i] = sn.Boot(ctx, e.hc, e.url, p) })
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil || !times[i].Enrolled || times[i].Requests != 5 {
			t.Fatalf("soft-%d: %v (%+v), want enrolled and verified in 5 requests (envelope, nonce, attestation, answer, attestation)", i, errs[i], times[i])
		}
		var sum time.Duration
		for ph, d := range times[i].Phase {
			if d <= 0 {
				t.Fatalf("soft-%d: phase %s took %v", i, controltest.Phase(ph), d)
			}
			sum += d
		}
		if sum != times[i].End.Sub(times[i].Start) {
			t.Fatalf("soft-%d: the phases add up to %v, the boot took %v", i, sum, times[i].End.Sub(times[i].Start))
		}
		name := fmt.Sprintf("soft-%d", i)
		if rec := e.record(t, name); rec.Status.Verdict != control.VerdictVerified || len(rec.Spec.EKPublic) == 0 {
			t.Fatalf("%s: record %s: %s", name, rec.Status.Verdict, rec.Status.Reason)
		}
		if r := e.rule(t, name); r != nil {
			t.Fatalf("%s: verified, still tainted: %+v", name, r.Spec.Taint)
		}
	}
	if err := errs[n]; err == nil || !strings.Contains(err.Error(), "ek certificate") || !strings.Contains(err.Error(), "not the operator's EK CA") {
		t.Fatalf("a node whose EK certificate is from another CA: %v, want refused naming the EK certificate", err)
	}
	if rec := e.record(t, fmt.Sprintf("soft-%d", n)); len(rec.Spec.EKPublic) != 0 || rec.Status.Verdict == control.VerdictVerified {
		t.Fatalf("the refused node's record: enrolled %v, %s", len(rec.Spec.EKPublic) != 0, rec.Status.Verdict)
	}
}
