package control_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/softtpm"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/control/controltest"
)

// softEnv is newEnv with a software EK CA and the fixture's firmware for soft nodes.
func softEnv(t *testing.T) (*env, *softtpm.CA, *softtpm.Firmware) {
	t.Helper()
	e := newEnv(t)
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
	return e, ca, fw
}

func softNode(t *testing.T, ca *softtpm.CA, fw *softtpm.Firmware, host string) *controltest.SoftNode {
	t.Helper()
	ek, err := softtpm.GenerateEK()
	if err != nil {
		t.Fatal(err)
	}
	n, err := controltest.NewSoftNode(context.Background(), ca, ek, fw, host, 1)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestRecordWritesReadOnce: a first boot reads its record twice (the two attestations'
// look-ups: absent, then enrolled) and writes its status once, with the resourceVersion
// the second read found. When that write conflicts the record is read again (spending
// the nonce is decided on what is there now) and the boot still ends enrolled and
// verified.
func TestRecordWritesReadOnce(t *testing.T) {
	for _, conflicts := range []bool{false, true} {
		t.Run(fmt.Sprintf("conflicts=%v", conflicts), func(t *testing.T) {
			e, ca, fw := softEnv(t)
			fake := e.dyn.(*dynamicfake.FakeDynamicClient)
			var mu sync.Mutex
			gets, statusWrites, last := 0, 0, ""
			fake.PrependReactor("*", "passagenodes", func(a k8stesting.Action) (bool, runtime.Object, error) {
				mu.Lock()
				defer mu.Unlock()
				switch {
				case a.GetVerb() == "get":
					gets++
				case a.GetVerb() == "update" && a.GetSubresource() == "status":
					statusWrites++
					// The first try of each write: a status not tried before.
					u := a.(k8stesting.UpdateAction).GetObject().(*unstructured.Unstructured)
					verdict, _, _ := unstructured.NestedString(u.Object, "status", "verdict")
					reason, _, _ := unstructured.NestedString(u.Object, "status", "reason")
					first := verdict+reason != last
					last = verdict + reason
					if conflicts && first {
						return true, nil, apierrors.NewConflict(control.NodeResource.GroupResource(), "soft-0", fmt.Errorf("injected"))
					}
				}
				return false, nil, nil
			})
			n := softNode(t, ca, fw, "soft-0")
			if _, err := n.Boot(context.Background(), e.hc, e.url, netboot.PublishPolicy{Tries: 1}); err != nil {
				t.Fatal(err)
			}
			rec := e.record(t, "soft-0")
			if rec.Status.Verdict != control.VerdictVerified || rec.Status.Generation != 1 || len(rec.Spec.EKPublic) == 0 {
				t.Fatalf("record: %s %q gen %d", rec.Status.Verdict, rec.Status.Reason, rec.Status.Generation)
			}
			want := 2
			if conflicts {
				want = 2 + 1
			}
			if gets-1 != want { // e.record's own read
				t.Fatalf("%d reads of the record for %d status writes, want %d", gets-1, statusWrites, want)
			}
		})
	}
}

// TestSoftNodesBoot: nodes whose TPM is done in software (the boot storm's load
// generator) boot at once through the boot's own exchange (netboot) and are enrolled and
// verified by the unrelaxed control plane; one whose EK certificate is from another CA
// is refused naming it.
func TestSoftNodesBoot(t *testing.T) {
	e, ca, fw := softEnv(t)
	ctx := context.Background()
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
	if _, err := e.srv.Store.Node(ctx, fmt.Sprintf("soft-%d", n)); !errors.Is(err, control.ErrNoRecord) {
		t.Fatalf("the refused node has a record: %v", err)
	}
}
