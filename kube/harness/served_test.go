//go:build cluster

package harness_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"

	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/harness"
	"github.com/passage-boot/passage/kube/internal/noderig"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// TestClusterServed: what each component needs of the API server, asked of the real
// kube-apiserver. On the default control plane (v1.37.2): deploy/'s files pass a
// server-side dry run (kubectl apply --dry-run=server, decoded strictly, the API
// server's field validation strict), passage-control's CheckServed finds
// devicetaintrules, and a passage-dra plugin process with its turnaround on, as the
// DaemonSet's account, keeps the device taint of its dry-run slice and publishes. On one
// started with the device taint gates off and v1 devicetaintrules off: CheckServed
// refuses naming devicetaintrules, and the same plugin process exits REFUSED naming
// DRADeviceTaints, its node with no slice.
func TestClusterServed(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	work := t.TempDir()
	draBin := goBuild(t, work, "passage-dra")
	bin := os.Getenv("PASSAGE_CONTROL_PLANE")
	if bin == "" {
		t.Fatal("PASSAGE_CONTROL_PLANE: the directory of the control plane's binaries (make cluster-test builds them)")
	}
	fw, err := os.ReadFile("../../attest/testdata/ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}

	for _, c := range []struct {
		name string
		opts harness.Options
		// refused: the components refuse to start (else they start).
		refused bool
		// gateOff: passage-control alone refuses, naming this gate.
		gateOff string
	}{
		{name: "default"},
		{name: "taints-off", opts: harness.Options{FeatureGates: "DRADeviceTaints=false,DRADeviceTaintRules=false",
			RuntimeConfig: "resource.k8s.io/v1/devicetaintrules=false"}, refused: true},
		// v1 DeviceTaintRules still served, ignored by the scheduler: only the API
		// server's own feature series tells.
		{name: "rules-gate-off", opts: harness.Options{FeatureGates: "DRADeviceTaintRules=false"}, gateOff: "DRADeviceTaintRules"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(work, c.name)
			os.MkdirAll(filepath.Join(dir, "cp"), 0o755)
			cl, err := harness.StartWith(ctx, bin, filepath.Join(dir, "cp"), c.opts)
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if t.Failed() {
					for _, l := range cl.Logs() {
						t.Log(harness.Tail(l, 3000))
					}
				}
				cl.Stop()
			}()
			api := cl.Client
			if !c.refused {
				dryRunDeploy(t, ctx, cl)
			}

			// passage-control's checks, as its main makes them, with its own account.
			err = control.CheckServed(api.Discovery())
			t.Logf("passage-control's CheckServed: %v", err)
			if c.refused != (err != nil) || c.refused && !strings.Contains(err.Error(), "does not serve devicetaintrules in resource.k8s.io/v1") {
				t.Fatalf("CheckServed: %v, want refused: %v", err, c.refused)
			}
			if !c.refused {
				ctlConfig := filepath.Join(dir, "passage-control.kubeconfig")
				deployControlRBAC(t, ctx, cl, ctlConfig)
				rc, err := clientcmdConfig(ctlConfig)
				if err != nil {
					t.Fatal(err)
				}
				err = control.CheckGates(ctx, kubernetes.NewForConfigOrDie(rc).Discovery().RESTClient())
				t.Logf("passage-control's CheckGates: %v", err)
				if (c.gateOff != "") != (err != nil) || c.gateOff != "" && !strings.Contains(err.Error(), "feature gate "+c.gateOff+" is off") {
					t.Fatalf("CheckGates: %v, want refused naming %q", err, c.gateOff)
				}
			}

			// passage-dra, as the DaemonSet's account, its turnaround on: a node with a
			// TPM, the control plane's URL and CA (nothing is released: nothing dials it).
			kubeconfig := filepath.Join(dir, "passage-dra.kubeconfig")
			deployRBAC(t, ctx, cl, kubeconfig)
			keys := filepath.Join(dir, "keys")
			r := noderig.New(t, manifesttest.NodeUUID(1), "b300-a", 1, keys)
			ca, _ := r.ForTurnaround(t, fw)
			caFile := filepath.Join(dir, "ca.crt")
			if err := os.WriteFile(caFile, ca.PEM(t), 0o644); err != nil {
				t.Fatal(err)
			}
			addNode(t, ctx, api, "b300-a")
			n := &node{name: "b300-a", rig: r, dir: filepath.Join(dir, "b300-a")}
			n.run(t, draBin, "plugin", "--pub", keys, "--manifest", r.Path, "--root", r.Root, "--cdi-dir", n.cdi(),
				"--registry-dir", filepath.Join(n.dir, "registry"), "--plugin-dir", n.plugin(), "--kubeconfig", kubeconfig,
				"--passage-url", "https://127.0.0.1:1/", "--passage-ca", caFile, "--tpm", "on")
			sel := metav1.ListOptions{FieldSelector: resourceapi.ResourceSliceSelectorNodeName + "=b300-a"}
			if c.refused {
				select {
				case <-n.done:
				case <-time.After(time.Minute):
					t.Fatalf("passage-dra still running a minute after its start: %s", harness.Tail(n.log, 2000))
				}
				log, _ := os.ReadFile(n.log)
				if n.cmd.ProcessState.ExitCode() != 1 || !bytes.Contains(log, []byte("REFUSED")) || !bytes.Contains(log, []byte("DRADeviceTaints")) {
					t.Fatalf("passage-dra: %v, want exit 1 REFUSED naming DRADeviceTaints:\n%s", n.cmd.ProcessState, log)
				}
				t.Logf("passage-dra: %v: %s", n.cmd.ProcessState, strings.TrimSpace(string(log)))
				if l, err := api.ResourceV1().ResourceSlices().List(ctx, sel); err != nil || len(l.Items) != 0 {
					t.Fatalf("slices of the refused node: %d (%v)", len(l.Items), err)
				}
				// The check, in process: the API server's answer itself.
				if err := plugin.CheckDeviceTaints(ctx, api, "b300-a", "b300-a"); !errors.Is(err, plugin.ErrTaintsDropped) {
					t.Fatalf("CheckDeviceTaints: %v, want ErrTaintsDropped", err)
				}
				return
			}
			waitFor(t, ctx, time.Minute, "b300-a's slices published", func() (bool, string) {
				l, err := api.ResourceV1().ResourceSlices().List(ctx, sel)
				if err != nil {
					return false, err.Error()
				}
				devs := 0
				for _, s := range l.Items {
					devs += len(s.Spec.Devices)
				}
				select {
				case <-n.done:
					t.Fatalf("passage-dra exited: %s", harness.Tail(n.log, 2000))
				default:
				}
				return devs == 32, harness.Tail(n.log, 500)
			})
		})
	}
}

// dryRunDeploy sends every object of deploy/'s files through the API server as kubectl
// apply --dry-run=server would (nothing stored): decoded strictly (unknown or duplicate
// fields refused), created with dryRun All and strict field validation, namespaced ones
// into their namespace, which is made for real first (a dry-run Namespace does not make
// it). kubevirt-hook.yaml is left out: its VirtualMachineInstance is KubeVirt's kind, not
// served here.
func dryRunDeploy(t *testing.T, ctx context.Context, cl *harness.Cluster) {
	t.Helper()
	rc, err := clientcmd.BuildConfigFromFlags("", cl.Admin)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	dec := kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme.Scheme, scheme.Scheme, kjson.SerializerOptions{Yaml: true, Strict: true})
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(discovery.NewDiscoveryClientForConfigOrDie(rc)))
	opts := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}, FieldValidation: metav1.FieldValidationStrict}
	for _, file := range []string{"daemonset.yaml", "passage-control-crd.yaml", "passage-control.yaml"} {
		b, err := os.ReadFile(filepath.Join("..", "deploy", file))
		if err != nil {
			t.Fatal(err)
		}
		r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
		for i := 1; ; i++ {
			doc, err := r.Read()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			u := &unstructured.Unstructured{}
			obj, gvk, err := dec.Decode(doc, nil, nil)
			switch {
			case runtime.IsNotRegisteredError(err):
				// A kind client-go has no type for (CustomResourceDefinition): duplicate
				// fields refused here, unknown ones by the API server's strict validation.
				j, jerr := yaml.YAMLToJSONStrict(doc)
				if jerr != nil {
					t.Fatalf("deploy/%s document %d: %v", file, i, jerr)
				}
				if jerr := u.UnmarshalJSON(j); jerr != nil {
					t.Fatalf("deploy/%s document %d: %v", file, i, jerr)
				}
				g := u.GroupVersionKind()
				gvk = &g
			case err != nil:
				t.Fatalf("deploy/%s document %d: %v", file, i, err)
			default:
				m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
				if err != nil {
					t.Fatal(err)
				}
				u.Object = m
				u.SetGroupVersionKind(*gvk)
			}
			mapping, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
			if err != nil {
				t.Fatalf("deploy/%s document %d (%s): %v", file, i, gvk.Kind, err)
			}
			var ri dynamic.ResourceInterface = dyn.Resource(mapping.Resource)
			if mapping.Scope.Name() == "namespace" {
				ri = dyn.Resource(mapping.Resource).Namespace(u.GetNamespace())
			}
			if gvk.Kind == "Namespace" {
				// Made for real: the namespaced objects after it are dry-run into it.
				if _, err := ri.Create(ctx, u, metav1.CreateOptions{FieldValidation: metav1.FieldValidationStrict}); err != nil {
					t.Fatalf("deploy/%s document %d (Namespace %s): %v", file, i, u.GetName(), err)
				}
				continue
			}
			got, err := ri.Create(ctx, u, opts)
			if err != nil {
				t.Fatalf("deploy/%s document %d (%s %s): the API server refused it: %v", file, i, gvk.Kind, u.GetName(), err)
			}
			if got.GetUID() == "" {
				t.Fatalf("deploy/%s %s %s: no object in the dry run's answer", file, gvk.Kind, u.GetName())
			}
			t.Logf("deploy/%s: %s %s accepted (dry run)", file, gvk.Kind, u.GetName())
			if _, err := ri.Get(ctx, u.GetName(), metav1.GetOptions{}); err == nil && gvk.Kind != "Namespace" {
				t.Fatalf("deploy/%s %s %s: stored by a dry run", file, gvk.Kind, u.GetName())
			}
		}
	}
}
