package deploy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"

	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// The images kustomization.yaml names, as the files name them: plain, for an overlay's
// images: to match.
var imageNames = []string{"passage-control", "passage-dra"}

// An operator's overlay: the registry passage.test, each image by digest.
var digests = map[string]string{
	"passage-control": "sha256:" + strings.Repeat("c0", 32),
	"passage-dra":     "sha256:" + strings.Repeat("d1", 32),
}

// build renders the kustomization in dir as kubectl apply -k does (k8s.io/cli-runtime
// v0.37.2, KustomizeVisitor: krusty's default options, which load files only from
// under each kustomization's own directory and run no plugins, the legacy order, the
// disk) and returns its YAML.
func build(dir string) ([]byte, error) {
	o := krusty.MakeDefaultOptions()
	o.Reorder = krusty.ReorderOptionLegacy
	m, err := krusty.MakeKustomizer(o).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, err
	}
	return m.AsYaml()
}

// object is one decoded document, as JSON decodes it (numbers float64), so the files and
// kustomize's output compare field by field whatever YAML spelled them.
type object = map[string]any

// id is how kubectl tells objects apart.
func id(o object) string {
	md, _ := o["metadata"].(map[string]any)
	if ns, ok := md["namespace"]; ok {
		return fmt.Sprintf("%v %v %v/%v", o["apiVersion"], o["kind"], ns, md["name"])
	}
	return fmt.Sprintf("%v %v %v", o["apiVersion"], o["kind"], md["name"])
}

// decode splits a YAML stream into its objects by id, as kubectl reads a file.
func decode(t *testing.T, what string, b []byte) map[string]object {
	t.Helper()
	objs := map[string]object{}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
	for i := 1; ; i++ {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs
		}
		if err != nil {
			t.Fatalf("%s: document %d: %v", what, i, err)
		}
		j, err := yaml.YAMLToJSON(doc)
		if err != nil {
			t.Fatalf("%s: document %d: %v", what, i, err)
		}
		var o object
		if err := json.Unmarshal(j, &o); err != nil {
			t.Fatalf("%s: document %d: %v", what, i, err)
		}
		if o == nil {
			continue // only comments
		}
		if _, dup := objs[id(o)]; dup {
			t.Fatalf("%s: %s twice", what, id(o))
		}
		objs[id(o)] = o
	}
}

// resources is kustomization.yaml's resources: list.
func resources(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("kustomization.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		Resources []string `json:"resources"`
	}
	if err := yaml.Unmarshal(b, &k); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	return k.Resources
}

// shipped decodes the files kustomization.yaml lists directly, as kubectl apply -f reads
// them.
func shipped(t *testing.T) map[string]object {
	t.Helper()
	objs := map[string]object{}
	for _, f := range resources(t) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for k, o := range decode(t, f, b) {
			if _, dup := objs[k]; dup {
				t.Fatalf("%s: %s is in another file too", f, k)
			}
			objs[k] = o
		}
	}
	return objs
}

// eachImage calls fn with the path of every map in v holding an "image" key (a
// container, wherever its list is) and the map.
func eachImage(v any, path string, fn func(path string, holder map[string]any)) {
	switch v := v.(type) {
	case map[string]any:
		if _, ok := v["image"]; ok {
			fn(path, v)
		}
		for k, e := range v {
			eachImage(e, path+"."+k, fn)
		}
	case []any:
		for i, e := range v {
			eachImage(e, fmt.Sprintf("%s[%d]", path, i), fn)
		}
	}
}

// images maps each image field's path in o to its value.
func images(o object) map[string]string {
	m := map[string]string{}
	eachImage(o, "", func(path string, holder map[string]any) {
		m[path], _ = holder["image"].(string)
	})
	return m
}

// diff names the paths where a and b differ.
func diff(a, b any, path string) []string {
	am, aok := a.(map[string]any)
	bm, bok := b.(map[string]any)
	if aok && bok {
		keys := map[string]bool{}
		for k := range am {
			keys[k] = true
		}
		for k := range bm {
			keys[k] = true
		}
		var d []string
		for k := range keys {
			d = append(d, diff(am[k], bm[k], path+"."+k)...)
		}
		sort.Strings(d)
		return d
	}
	al, aok := a.([]any)
	bl, bok := b.([]any)
	if aok && bok && len(al) == len(bl) {
		var d []string
		for i := range al {
			d = append(d, diff(al[i], bl[i], fmt.Sprintf("%s[%d]", path, i))...)
		}
		return d
	}
	if reflect.DeepEqual(a, b) {
		return nil
	}
	return []string{fmt.Sprintf("%s: %v, want %v", path, a, b)}
}

func writeFile(t *testing.T, path, s string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

// deployFrom is this directory's path relative to dir: kustomize refuses a base given
// by its absolute path ("new root ... cannot be absolute").
func deployFrom(t *testing.T, dir string) string {
	t.Helper()
	abs, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	rel, err := filepath.Rel(dir, abs)
	if err != nil {
		t.Fatal(err)
	}
	return rel
}

// overlay writes an operator's kustomization naming kube/deploy and setting each
// image's registry and digest, then extra, and returns its directory.
func overlay(t *testing.T, extra string) string {
	t.Helper()
	dir := t.TempDir()
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- %s\nimages:\n", deployFrom(t, dir))
	for _, name := range imageNames {
		fmt.Fprintf(&b, "- name: %s\n  newName: passage.test/%s\n  digest: %s\n", name, name, digests[name])
	}
	b.WriteString(extra)
	writeFile(t, filepath.Join(dir, "kustomization.yaml"), b.String())
	return dir
}

// TestKustomizationListsEveryFile: every deploy file is in kustomization.yaml but
// kubevirt-hook.yaml (an example of a tenant's VMI, with KubeVirt's kind), so a file
// added here is applied by kubectl apply -k or left out on purpose.
func TestKustomizationListsEveryFile(t *testing.T) {
	files, err := filepath.Glob("*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	files = slices.DeleteFunc(files, func(f string) bool {
		return f == "kustomization.yaml" || f == "kubevirt-hook.yaml"
	})
	got := slices.Sorted(slices.Values(resources(t)))
	if !slices.Equal(got, files) {
		t.Fatalf("kustomization.yaml lists %v; the deploy files (less kubevirt-hook.yaml) are %v", got, files)
	}
}

// The README's "Deploy" exposes passage.url to the provisioning network with this patch.
const loadBalancer = `patches:
- target: {kind: Service, name: passage-control}
  patch: '[{"op": "add", "path": "/spec/type", "value": "LoadBalancer"}]'
`

// TestKustomization: kube/deploy rendered by kustomize under an operator's overlay (the
// registry passage.test, each image by digest) is every object of the files it lists,
// decoded directly, with nothing changed but the image: each container runs the
// overlay's reference by digest, which the API server defaults to IfNotPresent (no
// container sets imagePullPolicy). With the README's Service patch too, the Service is
// a LoadBalancer and nothing else differs. Alone, kube/deploy names the plain images at
// latest.
func TestKustomization(t *testing.T) {
	// Each file names its images plainly, for the kustomization's images: to match.
	seen := map[string]bool{}
	for k, o := range shipped(t) {
		for path, img := range images(o) {
			if !slices.Contains(imageNames, img) {
				t.Errorf("%s%s: image %q, want one of the plain names %v", k, path, img, imageNames)
			}
			seen[img] = true
		}
	}
	if len(seen) != len(imageNames) {
		t.Fatalf("the files name the images %v, want each of %v", seen, imageNames)
	}

	byDigest := func(plain string) string { return "passage.test/" + plain + "@" + digests[plain] }
	for _, c := range []struct {
		name string
		dir  string
		ref  func(plain string) string
		// What the overlay changes besides the images, made in the files' objects.
		mend func(want map[string]object)
	}{
		{"overlay", overlay(t, ""), byDigest, nil},
		{"overlay exposing the Service", overlay(t, loadBalancer), byDigest, func(want map[string]object) {
			want["v1 Service passage-system/passage-control"]["spec"].(map[string]any)["type"] = "LoadBalancer"
		}},
		{"alone", ".", func(plain string) string { return plain + ":latest" }, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			want := shipped(t)
			if c.mend != nil {
				c.mend(want)
			}
			y, err := build(c.dir)
			if err != nil {
				t.Fatalf("kustomize build %s: %v", c.dir, err)
			}
			got := decode(t, "kustomize's output", y)
			for k, w := range want {
				g, ok := got[k]
				if !ok {
					t.Errorf("%s: not in kustomize's output", k)
					continue
				}
				wantImages := images(w)
				eachImage(g, "", func(path string, holder map[string]any) {
					plain, ok := wantImages[path]
					if !ok {
						t.Errorf("%s%s: image %v, not in the file", k, path, holder["image"])
						return
					}
					delete(wantImages, path)
					if img := holder["image"]; img != c.ref(plain) {
						t.Errorf("%s%s: image %v, want %s", k, path, img, c.ref(plain))
					}
					if p, ok := holder["imagePullPolicy"]; ok {
						t.Errorf("%s%s: imagePullPolicy %v: the API server defaults it from the reference", k, path, p)
					}
					holder["image"] = plain
				})
				for path := range wantImages {
					t.Errorf("%s%s: no image in kustomize's output", k, path)
				}
				for _, d := range diff(g, w, "") {
					t.Errorf("%s: kustomize changed %s", k, d)
				}
			}
			for k := range got {
				if _, ok := want[k]; !ok {
					t.Errorf("%s: in kustomize's output, in no file", k)
				}
			}
		})
	}
}

// TestKustomizationRefuses: what kustomize says to a deploy directory missing a file it
// lists and to overlays it cannot use; kubectl apply -k then applies nothing.
func TestKustomizationRefuses(t *testing.T) {
	// A copy of kube/deploy without daemonset.yaml.
	short := t.TempDir()
	for _, f := range append(resources(t), "kustomization.yaml") {
		if f == "daemonset.yaml" {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		writeFile(t, filepath.Join(short, f), string(b))
	}
	abs, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		// The overlay, with %s where it names kube/deploy relative to itself; none:
		// the copy without daemonset.yaml.
		kustomization, want string
	}{
		{"missing file", "", "daemonset.yaml"},
		{"base not there", "resources:\n- %s/nowhere\n", "nowhere"},
		{"base by its absolute path", "resources:\n- " + abs + "\n", "cannot be absolute"},
		{"not YAML", "resources: [%s\n", "invalid Kustomization"},
		// newTag misspelt: kustomize decodes a kustomization strictly.
		{"unknown field", "resources:\n- %s\nimages:\n- name: passage-dra\n  tag: v1\n", `unknown field "tag"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := short
			if c.kustomization != "" {
				dir = t.TempDir()
				k := c.kustomization
				if strings.Contains(k, "%s") {
					k = fmt.Sprintf(k, deployFrom(t, dir))
				}
				writeFile(t, filepath.Join(dir, "kustomization.yaml"), k)
			}
			y, err := build(dir)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("kustomize build: %v, want an error naming %q\n%s", err, c.want, y)
			}
			t.Logf("kustomize: %v", err)
		})
	}
}

// TestKustomizationUnmatchedImage: an images: entry that matches no image (a misspelt
// name) is no error to kustomize; the image stays as the file names it. What the
// kustomization's comment and the README tell an operator to look for.
func TestKustomizationUnmatchedImage(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "kustomization.yaml"), "resources:\n- "+deployFrom(t, dir)+
		"\nimages:\n- name: passage-dr\n  newName: passage.test/passage-dra\n  digest: "+digests["passage-dra"]+"\n")
	y, err := build(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(y), "image: passage-dra:latest\n") || strings.Contains(string(y), "passage.test") {
		t.Fatalf("an overlay naming passage-dr: want passage-dra left as shipped:\n%s", y)
	}
}

// TestHookImageNotRewritten: the passage-hook image in kubevirt-hook.yaml's sidecar
// annotation is a JSON string to kustomize, which an images: entry does not reach; the
// operator writes the reference into each VMI's annotation (the README's "Deploy").
func TestHookImageNotRewritten(t *testing.T) {
	dir := t.TempDir()
	b, err := os.ReadFile("kubevirt-hook.yaml")
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "kubevirt-hook.yaml"), string(b))
	writeFile(t, filepath.Join(dir, "kustomization.yaml"), "resources:\n- kubevirt-hook.yaml\n"+
		"images:\n- name: passage-hook\n  newName: passage.test/passage-hook\n  digest: sha256:"+strings.Repeat("e2", 32)+"\n")
	y, err := build(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := decode(t, "kubevirt-hook.yaml", b)
	got := decode(t, "kustomize's output", y)
	if len(got) != len(want) {
		t.Fatalf("kustomize's output: %d objects, want %d", len(got), len(want))
	}
	for k, w := range want {
		if d := diff(got[k], w, ""); len(d) > 0 {
			t.Errorf("%s: kustomize changed %v", k, d)
		}
	}
	if strings.Contains(string(y), "passage.test") || !strings.Contains(string(y), `"image": "passage-hook:latest"`) {
		t.Fatalf("the hook's annotation was rewritten:\n%s", y)
	}
}
