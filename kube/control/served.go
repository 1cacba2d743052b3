package control

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"

	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/rest"
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
// ignoring the rules; discovery cannot see that: CheckGates does.
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
var ErrNotServed = errors.New("passage-control cannot start")

// Unreachable says whether err is CheckServed's for an API server that did not answer
// (no connection, a timeout), rather than one that answered without the resource.
func Unreachable(err error) bool {
	var se apierrors.APIStatus
	return err != nil && !errors.Is(err, ErrNotServed) && !errors.As(err, &se)
}

// Gates are the kube-apiserver feature gates passage-control needs on: with
// DRADeviceTaintRules off, a 1.37 API server still serves v1 DeviceTaintRules (its
// registry has no gate) while the scheduler ignores them; with DRADeviceTaints off,
// no taint reaches the allocator at all.
var Gates = []string{"DRADeviceTaints", "DRADeviceTaintRules"}

// CheckGates reads the API server's own kubernetes_feature_enabled series (its /metrics;
// passage-control's role may get that path and nothing else of it) and refuses when a
// gate of Gates is off, naming it: discovery cannot see that the rules it serves are
// ignored. An API server that does not answer is Unreachable; one whose metrics do not
// name a gate is taken at its discovery's word.
func CheckGates(ctx context.Context, rc rest.Interface) error {
	body, err := rc.Get().AbsPath("/metrics").Do(ctx).Raw()
	if err != nil {
		return fmt.Errorf("the API server's /metrics (its feature gates): %w", err)
	}
	var off []string
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "kubernetes_feature_enabled{") {
			continue
		}
		for _, g := range Gates {
			if strings.Contains(line, `name="`+g+`"`) && strings.HasSuffix(line, " 0") {
				off = append(off, g)
			}
		}
	}
	if len(off) > 0 {
		return fmt.Errorf("%w: feature gate %s is off on kube-apiserver: DeviceTaintRules would be stored and ignored, and no verdict would reach the scheduler (turn it on in kube-apiserver, kube-scheduler and kube-controller-manager)", ErrNotServed, strings.Join(off, " and "))
	}
	return nil
}
