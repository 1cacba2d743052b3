package controltest

import (
	"context"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	metadatafake "k8s.io/client-go/metadata/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/passage-boot/passage/dra/control"
)

// FakeStore is a Store on the fake API (client-go's fakes), for tests of the handler
// without an API server. The fake metadata client keeps objects of its
// own, so its lists are answered from the dynamic client's objects, as the API server
// answers both from one store; creates are stamped with a creationTimestamp and updates keep
// it, as the API server does.
func FakeStore() *control.Store {
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{
		control.NodeResource: "PassageNodeList", control.NonceResource: "PassageNonceList"})
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
	meta := metadatafake.NewSimpleMetadataClient(metadatafake.NewTestScheme())
	meta.PrependReactor("list", "*", func(a k8stesting.Action) (bool, runtime.Object, error) {
		l, err := dyn.Resource(a.GetResource()).List(context.Background(), metav1.ListOptions{
			LabelSelector: a.(k8stesting.ListAction).GetListRestrictions().Labels.String()})
		if err != nil {
			return true, nil, err
		}
		// The fake metadata client takes a metav1.List of PartialObjectMetadata.
		out := &metav1.List{}
		for _, u := range l.Items {
			out.Items = append(out.Items, runtime.RawExtension{Object: &metav1.PartialObjectMetadata{TypeMeta: metav1.TypeMeta{APIVersion: u.GetAPIVersion(), Kind: u.GetKind()},
				ObjectMeta: metav1.ObjectMeta{Name: u.GetName(), Labels: u.GetLabels(), ResourceVersion: u.GetResourceVersion(), CreationTimestamp: u.GetCreationTimestamp()}}})
		}
		return true, out, nil
	})
	return &control.Store{Client: dyn, Meta: meta}
}
