package control

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	fakediscovery "k8s.io/client-go/discovery/fake"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/rest"
)

// TestCheckServed: passage-control starts only where the API server's discovery lists
// devicetaintrules in resource.k8s.io/v1, and otherwise refuses naming the resource and
// the group version (the real API server's answer: cluster TestClusterServed).
func TestCheckServed(t *testing.T) {
	v1 := func(names ...string) []*metav1.APIResourceList {
		l := &metav1.APIResourceList{GroupVersion: "resource.k8s.io/v1"}
		for _, n := range names {
			l.APIResources = append(l.APIResources, metav1.APIResource{Name: n})
		}
		return []*metav1.APIResourceList{l}
	}
	for _, c := range []struct {
		name      string
		resources []*metav1.APIResourceList
		refused   string
	}{
		{"1.37", v1("deviceclasses", "devicetaintrules", "devicetaintrules/status", "resourceclaims", "resourceslices"), ""},
		{"v1 without devicetaintrules", v1("deviceclasses", "resourceclaims", "resourceslices"), "does not serve devicetaintrules in resource.k8s.io/v1"},
		{"no resource.k8s.io/v1", []*metav1.APIResourceList{{GroupVersion: "resource.k8s.io/v1beta2", APIResources: []metav1.APIResource{{Name: "devicetaintrules"}}}}, "discovery of resource.k8s.io/v1"},
	} {
		kc := fake.NewClientset()
		kc.Discovery().(*fakediscovery.FakeDiscovery).Resources = c.resources
		err := CheckServed(kc.Discovery())
		if c.refused == "" && err != nil || c.refused != "" && (err == nil || !strings.Contains(err.Error(), c.refused)) {
			t.Errorf("%s: %v, want refused: %q", c.name, err, c.refused)
		}
	}
}

// TestUnreachable: an API server that did not answer is told apart from one that
// answered without DeviceTaintRules (passage-control serves on in the first case and
// refuses to start in the second).
func TestUnreachable(t *testing.T) {
	if !Unreachable(fmt.Errorf("discovery: %w", errors.New("dial tcp 127.0.0.1:1: connect: connection refused"))) {
		t.Error("a refused connection is not unreachable")
	}
	if Unreachable(fmt.Errorf("x: %w", ErrNotServed)) || Unreachable(apierrors.NewNotFound(resourcev1.Resource("devicetaintrules"), "v1")) {
		t.Error("an answer counted as unreachable")
	}
}

// TestCheckGates: a gate the API server's own feature series says is off is refused by
// name; both on, or a server whose metrics name neither, passes.
func TestCheckGates(t *testing.T) {
	for _, tc := range []struct{ metrics, want string }{
		{"kubernetes_feature_enabled{name=\"DRADeviceTaints\",stage=\"\"} 1\nkubernetes_feature_enabled{name=\"DRADeviceTaintRules\",stage=\"\"} 1\n", ""},
		{"kubernetes_feature_enabled{name=\"DRADeviceTaints\",stage=\"\"} 1\nkubernetes_feature_enabled{name=\"DRADeviceTaintRules\",stage=\"\"} 0\n", "feature gate DRADeviceTaintRules is off"},
		{"# nothing about gates\n", ""},
	} {
		ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/metrics" {
				http.NotFound(w, r)
				return
			}
			io.WriteString(w, tc.metrics)
		}))
		err := CheckGates(context.Background(), kubernetes.NewForConfigOrDie(&rest.Config{Host: ts.URL}).Discovery().RESTClient())
		ts.Close()
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want) || Unreachable(err)) {
			t.Errorf("%q: %v, want %q", tc.metrics, err, tc.want)
		}
	}
}
