package plugin

import (
	"context"
	"errors"
	"fmt"
	"slices"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	"github.com/passage-boot/passage/kube/dra/resources"
)

// ErrTaintsDropped is the API server keeping a ResourceSlice without the device taints
// the plugin gave it: feature gate DRADeviceTaints is off on kube-apiserver (the default
// in Kubernetes 1.33-1.35; Kubernetes v1.37.2's pkg/features/kube_features.go: alpha and
// off from 1.33, beta and on in 1.36, GA in 1.37, where it can still be turned off). A
// quarantined unit would then be offered untainted: the plugin refuses to run its
// turnaround there.
var ErrTaintsDropped = errors.New("the API server dropped the device taints of a ResourceSlice (feature gate DRADeviceTaints is off on kube-apiserver; it is on by default from Kubernetes 1.36): a quarantined unit would be published untainted. Turn DRADeviceTaints on in kube-apiserver and kube-scheduler, or run passage-dra with --turnaround=false (a released unit then waits for passage recycle on the host)")

// CheckDeviceTaints asks the API server whether it keeps a device taint in a
// ResourceSlice, before anything is published: a server-side dry run (nothing stored)
// creates a slice of the node's pool with one device carrying the quarantine taint, and
// the slice the API server answers with, the one it would store, must still carry it.
// The plugin's own credentials do it (creating its node's slices is what its role
// allows). An error that is not ErrTaintsDropped says the check could not be made.
func CheckDeviceTaints(ctx context.Context, kube kubernetes.Interface, node, pool string) error {
	want := resourceapi.DeviceTaint{Key: TaintQuarantined, Value: "check", Effect: resourceapi.DeviceTaintEffectNoSchedule}
	s := &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{GenerateName: node + "-" + "taint-check-"},
		Spec: resourceapi.ResourceSliceSpec{
			Driver:   resources.DriverName,
			Pool:     resourceapi.ResourcePool{Name: pool, ResourceSliceCount: 1},
			NodeName: &node,
			Devices:  []resourceapi.Device{{Name: "taint-check", Taints: []resourceapi.DeviceTaint{want}}},
		},
	}
	got, err := kube.ResourceV1().ResourceSlices().Create(ctx, s, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	if err != nil {
		return fmt.Errorf("device taint check (a dry-run ResourceSlice for node %s): %w", node, err)
	}
	if len(got.Spec.Devices) != 1 || !slices.ContainsFunc(got.Spec.Devices[0].Taints, func(t resourceapi.DeviceTaint) bool {
		return t.Key == want.Key && t.Value == want.Value && t.Effect == want.Effect
	}) {
		return fmt.Errorf("device taint check (a dry-run ResourceSlice for node %s): %w", node, ErrTaintsDropped)
	}
	return nil
}

// taintsDropped is err, reported by the slice publisher, when it is the API server
// storing a slice without the taints the plugin published in it: the publisher compares
// each slice as the API server stored it (its answer to the create or update) with what
// was asked for (resourceslice.DroppedFieldsError). The result is not recoverable.
func taintsDropped(err error) error {
	var dropped *resourceslice.DroppedFieldsError
	if !errors.As(err, &dropped) || !slices.Contains(dropped.DisabledFeatures(), "DRADeviceTaints") {
		return nil
	}
	return fmt.Errorf("pool %s: published with device taints, stored without: %w", dropped.PoolName, ErrTaintsDropped)
}

// Withdraw deletes the node's ResourceSlices of this driver, once the plugin is stopped
// (Stop: its publisher would put them back): a plugin that stops because the API server
// dropped a quarantine taint leaves no slice offering the quarantined unit untainted.
// Without it the kubelet would wipe them only once the plugin stayed unregistered for
// its 30 s.
func Withdraw(ctx context.Context, kube kubernetes.Interface, node string) error {
	sel := fields.Set{resourceapi.ResourceSliceSelectorNodeName: node, resourceapi.ResourceSliceSelectorDriver: resources.DriverName}.AsSelector().String()
	list, err := kube.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: sel})
	if err != nil {
		return fmt.Errorf("withdraw node %s's slices: %w", node, err)
	}
	var errs []error
	for _, s := range list.Items {
		if s.Spec.Driver != resources.DriverName || s.Spec.NodeName == nil || *s.Spec.NodeName != node {
			continue // a fake client does not filter by fields
		}
		if err := kube.ResourceV1().ResourceSlices().Delete(ctx, s.Name, metav1.DeleteOptions{}); err != nil {
			errs = append(errs, fmt.Errorf("withdraw slice %s: %w", s.Name, err))
		}
	}
	return errors.Join(errs...)
}
