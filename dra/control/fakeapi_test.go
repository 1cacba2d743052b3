package control_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	metadatafake "k8s.io/client-go/metadata/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/passage-boot/passage/dra/control"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// fakeStore is a Store on the fake API. The fake metadata client keeps objects of its
// own, so its lists are answered from the dynamic client's objects, as the API server
// answers both from one store; creates are stamped with a creationTimestamp and updates keep
// it, as the API server does.
func fakeStore() *control.Store {
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schemaGVR]string{
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

// unsignedEnvelope is a well-formed manifest envelope naming host, signed by no one: a
// record not enrolled takes it, as it takes anyone's.
func unsignedEnvelope(t *testing.T, host string) []byte {
	t.Helper()
	m := manifesttest.B300(1)
	m.Node.Hostname = host
	payload, err := manifest.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	env, err := json.Marshal(manifest.Envelope{PayloadType: manifest.PayloadType, Payload: base64.StdEncoding.EncodeToString(payload)})
	if err != nil {
		t.Fatal(err)
	}
	return env
}
