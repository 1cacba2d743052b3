package control

import (
	"errors"
	"fmt"

	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/discovery"
)

// ServedResource is what the control plane's verdicts are written as: DeviceTaintRules
// in resource.k8s.io/v1 (Taints).
const ServedResource = "devicetaintrules"

// CheckServed asks the API server's discovery whether it serves DeviceTaintRules in
// resource.k8s.io/v1, and refuses naming what is missing: without them no verdict
// reaches the scheduler, and every unverified or failed node would stay schedulable.
// The v1 DeviceTaintRule is new in 1.37 (k8s.io/api's prerelease-lifecycle tag); in
// Kubernetes v1.37.2's feature table (pkg/features/kube_features.go)
// DRADeviceTaintRules is alpha (off) in 1.35, beta but off in 1.36 (v1beta2 only), GA
// and on from 1.37. --runtime-config=resource.k8s.io/v1/devicetaintrules=false turns
// the resource off. Measured on v1.37.2: --feature-gates=DRADeviceTaintRules=false
// leaves the v1 resource served (the registry has no gate), with the scheduler then
// ignoring the rules; discovery cannot see that, and this check does not catch it.
func CheckServed(dc discovery.DiscoveryInterface) error {
	gv := resourcev1.SchemeGroupVersion.String()
	list, err := dc.ServerResourcesForGroupVersion(gv)
	if err != nil {
		return fmt.Errorf("the API server's discovery of %s: %w (passage-control needs %s in it: Kubernetes 1.37 or later)", gv, err, ServedResource)
	}
	for _, r := range list.APIResources {
		if r.Name == ServedResource {
			return nil
		}
	}
	return fmt.Errorf("%w: the API server does not serve %s in %s: passage-control writes its verdicts as DeviceTaintRules and refuses to start without them (Kubernetes 1.37 or later serves them by default: resource.k8s.io/v1 has them from 1.37 on, 1.36 only in v1beta2 and off; do not turn off runtime-config resource.k8s.io/v1/%s, and keep feature gates DRADeviceTaints and DRADeviceTaintRules on in kube-apiserver, kube-scheduler and kube-controller-manager)", ErrNotServed, ServedResource, gv, ServedResource)
}

// ErrNotServed is an API server that answered without DeviceTaintRules.
var ErrNotServed = errors.New("not served")

// Unreachable says whether err is CheckServed's for an API server that did not answer
// (no connection, a timeout), rather than one that answered without the resource.
func Unreachable(err error) bool {
	var se apierrors.APIStatus
	return err != nil && !errors.Is(err, ErrNotServed) && !errors.As(err, &se)
}
