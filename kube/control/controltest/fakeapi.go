package controltest

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/passage-boot/passage/kube/control"
)

// FakeStore is a Store on the fake API (client-go's fakes), for tests of the handler
// without an API server. Creates are stamped with a creationTimestamp and updates keep
// it, as the API server does.
func FakeStore() *control.Store {
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{
		control.NodeResource: "PassageNodeList", control.EKResource: "PassageEKList"})
	dyn.PrependReactor("create", "*", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if u, ok := a.(k8stesting.CreateAction).GetObject().(*unstructured.Unstructured); ok {
			u.SetCreationTimestamp(metav1.Now())
		}
		return false, nil, nil
	})
	// An update keeps the creationTimestamp (the API server's is immutable; a client's
	// object, made afresh, carries none).
	dyn.PrependReactor("update", "*", func(a k8stesting.Action) (bool, runtime.Object, error) {
		u, ok := a.(k8stesting.UpdateAction).GetObject().(*unstructured.Unstructured)
		if !ok {
			return false, nil, nil
		}
		if old, err := dyn.Tracker().Get(a.GetResource(), "", u.GetName()); err == nil {
			if o, ok := old.(*unstructured.Unstructured); ok {
				u.SetCreationTimestamp(o.GetCreationTimestamp())
			}
		}
		return false, nil, nil
	})
	return &control.Store{Client: dyn}
}
