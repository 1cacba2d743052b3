package plugin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	"github.com/passage-boot/passage/kube/dra/resources"
)

// dropTaints makes a fake API server answer a ResourceSlice create as one with
// DRADeviceTaints off does: the slice without its devices' taints.
func dropTaints(kc *fake.Clientset) {
	kc.PrependReactor("create", "resourceslices", func(a k8stesting.Action) (bool, runtime.Object, error) {
		s := a.(k8stesting.CreateAction).GetObject().(*resourceapi.ResourceSlice).DeepCopy()
		for i := range s.Spec.Devices {
			s.Spec.Devices[i].Taints = nil
		}
		return true, s, nil
	})
}

// TestCheckDeviceTaints: the dry-run slice comes back with its taint (start), without
// (refused with ErrTaintsDropped, naming the gate), or not at all (an error that is not
// ErrTaintsDropped: the check could not be made). The real API server's answers:
// cluster TestClusterServed.
func TestCheckDeviceTaints(t *testing.T) {
	ctx := context.Background()
	kc := fake.NewClientset()
	var dryRun []string
	kc.PrependReactor("create", "resourceslices", func(a k8stesting.Action) (bool, runtime.Object, error) {
		dryRun = a.(k8stesting.CreateActionImpl).GetCreateOptions().DryRun
		return false, nil, nil
	})
	if err := CheckDeviceTaints(ctx, kc, "node-a", "b300-a"); err != nil {
		t.Fatalf("taints kept: %v", err)
	}
	if len(dryRun) != 1 || dryRun[0] != metav1.DryRunAll {
		t.Fatalf("the check created a slice with dryRun %v, want [All]", dryRun)
	}

	kc = fake.NewClientset()
	dropTaints(kc)
	err := CheckDeviceTaints(ctx, kc, "node-a", "b300-a")
	if !errors.Is(err, ErrTaintsDropped) || !strings.Contains(err.Error(), "DRADeviceTaints") || !strings.Contains(err.Error(), "node-a") {
		t.Fatalf("taints dropped: %v, want ErrTaintsDropped naming the gate and the node", err)
	}

	kc = fake.NewClientset()
	kc.PrependReactor("create", "resourceslices", func(a k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, fmt.Errorf("resourceslices is forbidden")
	})
	if err := CheckDeviceTaints(ctx, kc, "node-a", "b300-a"); err == nil || errors.Is(err, ErrTaintsDropped) || !strings.Contains(err.Error(), "forbidden") {
		t.Fatalf("create refused: %v", err)
	}
}

// TestTaintsDroppedNotRecoverable: the publisher's report of a slice stored without its
// quarantine taint (resourceslice.DroppedFieldsError, wrapped recoverable by the
// helper) reaches Errors as ErrTaintsDropped and not recoverable, even with the channel
// full; another dropped field stays recoverable.
func TestTaintsDroppedNotRecoverable(t *testing.T) {
	ctx := context.Background()
	desired := &resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Devices: []resourceapi.Device{{Name: "gpu0-0000-1b-00-0",
		Taints: []resourceapi.DeviceTaint{{Key: TaintQuarantined, Value: "erase", Effect: resourceapi.DeviceTaintEffectNoSchedule}}}}}}
	actual := desired.DeepCopy()
	actual.Spec.Devices[0].Taints = nil
	d := &Driver{errs: make(chan error, 1)}
	d.errs <- errors.New("an earlier error filling the channel")
	// As kubeletplugin's ErrorHandler wraps what the publisher reports.
	d.HandleError(ctx, wrapRecoverable(&resourceslice.DroppedFieldsError{PoolName: "b300-a", DesiredSlice: desired, ActualSlice: actual}), "publish")
	<-d.errs
	err := <-d.errs
	if !errors.Is(err, ErrTaintsDropped) || errors.Is(err, kubeletplugin.ErrRecoverable) || !strings.Contains(err.Error(), "pool b300-a") {
		t.Fatalf("taints dropped: %v, want ErrTaintsDropped, not recoverable, naming the pool", err)
	}

	other := desired.DeepCopy()
	other.Spec.Devices[0].Taints = nil
	other.Spec.Devices[0].AllowMultipleAllocations = new(bool)
	d.HandleError(ctx, wrapRecoverable(&resourceslice.DroppedFieldsError{PoolName: "b300-a", DesiredSlice: other, ActualSlice: actual}), "publish")
	if err := <-d.errs; errors.Is(err, ErrTaintsDropped) || !errors.Is(err, kubeletplugin.ErrRecoverable) {
		t.Fatalf("another field dropped: %v, want it recoverable", err)
	}
}

// wrapRecoverable is an error that Is kubeletplugin.ErrRecoverable and unwraps to err,
// as the helper's own wrapping does.
func wrapRecoverable(err error) error { return recoverable{err} }

type recoverable struct{ error }

func (r recoverable) Is(other error) bool { return other == kubeletplugin.ErrRecoverable }
func (r recoverable) Unwrap() error       { return r.error }

// TestWithdraw deletes the node's slices of this driver and no other.
func TestWithdraw(t *testing.T) {
	ctx := context.Background()
	slice := func(name, node, driver string) *resourceapi.ResourceSlice {
		return &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: resourceapi.ResourceSliceSpec{Driver: driver, NodeName: &node, Pool: resourceapi.ResourcePool{Name: node}}}
	}
	kc := fake.NewClientset(slice("a-0", "node-a", resources.DriverName), slice("a-1", "node-a", resources.DriverName),
		slice("a-gpu", "node-a", "gpu.example.com"), slice("b-0", "node-b", resources.DriverName))
	if err := Withdraw(ctx, kc, "node-a"); err != nil {
		t.Fatal(err)
	}
	l, err := kc.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	for _, s := range l.Items {
		left = append(left, s.Name)
	}
	if strings.Join(left, " ") != "a-gpu b-0" {
		t.Fatalf("slices left %v, want a-gpu b-0", left)
	}
}
