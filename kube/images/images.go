// Package images assembles passage's container images without a container daemon, on
// go-containerregistry: a base of Debian packages (each .deb's data.tar one layer, as
// distroless assembles its bases), the accounts layer, the program as one file, and
// the config (entrypoint, user, labels). Every byte is a function of the inputs (the
// .debs, the binary, the labels, the creation time): two builds give the same digest,
// and a layer that did not change keeps its digest between builds. make images writes
// each as an OCI image layout (Write).
package images

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Recipe is one of passage's images: which program, where, run as whom, on which base.
type Recipe struct {
	Name  string // the image's name and the program's (its Go command)
	Path  string // where the program is in the image: the entrypoint
	User  string // the config's User, numeric (kubelet's runAsNonRoot can check only a number)
	Glibc bool   // on the Debian glibc base (Spec.Debs); else on the accounts layer alone
}

// Passage are the images make images writes, named and laid out as kube/deploy runs them.
func Passage() []Recipe {
	return []Recipe{
		// Root: the plugin unbinds, erases, resets and binds back a unit's functions and
		// quotes with the node's TPM (daemonset.yaml runs it privileged). glibc: it is
		// built with cgo, which loads libnvfm (dlopen) for NVLink partitions.
		{Name: "passage-dra", Path: "/usr/bin/passage-dra", User: "0:0", Glibc: true},
		// Static (CGO_ENABLED=0). passage-control.yaml runs it as 65534 with no
		// capabilities; without a pod's runAsUser it is nonroot.
		{Name: "passage-control", Path: "/usr/bin/passage-control", User: "65532:65532"},
		// Static. kubevirt-hook.yaml's sidecar command is /passage-hook; virt-launcher
		// runs its sidecars as its own user (107 in KubeVirt's non-root mode).
		{Name: "passage-hook", Path: "/passage-hook", User: "65532:65532"},
	}
}

// Node are the images the real node test runs (containerd and a kubelet in a QEMU
// guest) that passage does not ship: the pod sandbox and a probe. make images writes them
// beside Passage's; their programs are this package's pause and vfio-probe commands.
func Node() []Recipe {
	return []Recipe{
		// The CRI's sandbox image (containerd's pinned_images.sandbox): every pod's first
		// process, holding its namespaces. /pause as 65535:65535, as Kubernetes'
		// registry.k8s.io/pause is built (build/pause/Dockerfile).
		{Name: "pause", Path: "/pause", User: "65535:65535"},
		// Lists the /dev/vfio the pod was given into its termination message. Nonroot:
		// listing needs no privilege, and the kubelet makes the termination log
		// writable by any user (kuberuntime: chmod 0666).
		{Name: "vfio-probe", Path: "/usr/bin/vfio-probe", User: "65532:65532"},
	}
}

// Spec is everything one image is made of.
type Spec struct {
	Recipe
	Binary []byte // the program
	Debs   []*Deb // the base, when Glibc; their layers go in by package name
	Arch   string // GOARCH and Debian's name alike: amd64, arm64
	// Created is the config's and the history's creation time (make images: the
	// commit's, SOURCE_DATE_EPOCH); zero is written as 0001-01-01T00:00:00Z.
	Created time.Time
	Labels  map[string]string
}

// Label keys (OCI image-spec, annotations.md, "Pre-Defined Annotation Keys").
const (
	LabelSource   = "org.opencontainers.image.source"
	LabelRevision = "org.opencontainers.image.revision"
	LabelVersion  = "org.opencontainers.image.version"
	// LabelDeb prefixes one label per base package: "<version> sha256:<the .deb's>".
	LabelDeb = "io.github.passage-boot.deb."
	// RefName names the image in its layout's index.json.
	RefName = "org.opencontainers.image.ref.name"
)

// PATH is distroless's.
const PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Build assembles the image: the base's packages by name, the accounts, the program;
// an OCI manifest and config.
func Build(s Spec) (v1.Image, error) {
	if s.Name == "" || !path.IsAbs(s.Path) || path.Clean(s.Path) != s.Path || s.Path == "/" {
		return nil, fmt.Errorf("image %q: the program's path %q is not a clean absolute file path", s.Name, s.Path)
	}
	if s.User == "" || s.Arch == "" || len(s.Binary) == 0 {
		return nil, fmt.Errorf("image %s: no user, architecture or program", s.Name)
	}
	if s.Glibc != (len(s.Debs) > 0) {
		return nil, fmt.Errorf("image %s: glibc base %v, %d packages given", s.Name, s.Glibc, len(s.Debs))
	}
	debs := slices.Clone(s.Debs)
	slices.SortFunc(debs, func(a, b *Deb) int { return strings.Compare(a.Package, b.Package) })
	created := v1.Time{Time: s.Created.UTC()}
	labels := maps.Clone(s.Labels)
	if labels == nil {
		labels = map[string]string{}
	}
	var adds []mutate.Addendum
	for i, d := range debs {
		if i > 0 && debs[i-1].Package == d.Package {
			return nil, fmt.Errorf("image %s: package %s given twice (%s, %s)", s.Name, d.Package, debs[i-1].Version, d.Version)
		}
		if d.Architecture != s.Arch && d.Architecture != "all" {
			return nil, fmt.Errorf("image %s: package %s is %s, the image %s", s.Name, d.Package, d.Architecture, s.Arch)
		}
		l, err := d.Layer()
		if err != nil {
			return nil, fmt.Errorf("image %s: %w", s.Name, err)
		}
		labels[LabelDeb+d.Package] = d.Version + " sha256:" + d.SHA256
		adds = append(adds, mutate.Addendum{Layer: l, History: v1.History{Created: created,
			CreatedBy: "passage-images: Debian package " + d.Package + " " + d.Version + " " + d.Architecture}})
	}
	acc, err := accounts()
	if err != nil {
		return nil, err
	}
	bin, err := binaryLayer(s.Path, s.Binary)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", s.Name, err)
	}
	adds = append(adds,
		mutate.Addendum{Layer: acc, History: v1.History{Created: created, CreatedBy: "passage-images: /etc/passwd, /etc/group (root, nobody, nonroot 65532), /tmp"}},
		mutate.Addendum{Layer: bin, History: v1.History{Created: created, CreatedBy: "passage-images: " + s.Path}})

	img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	img, err = mutate.Append(img, adds...)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", s.Name, err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", s.Name, err)
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS, cf.Created = s.Arch, "linux", created
	cf.Config = v1.Config{
		Entrypoint: []string{s.Path},
		User:       s.User,
		Env:        []string{PATH},
		WorkingDir: "/",
		Labels:     labels,
	}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", s.Name, err)
	}
	return img, nil
}

// Write writes img as the only image of an OCI image layout at dir (image-spec
// image-layout.md), named ref in index.json, and returns its manifest's digest: what
// a registry serves it as once pushed (crane push DIR REF and skopeo copy oci:DIR keep
// the manifest's bytes). A layout already at dir is replaced whole, so no blob of an
// earlier build stays; a directory that is not a layout is refused.
func Write(dir string, img v1.Image, ref string) (v1.Hash, error) {
	if _, err := os.Stat(dir); err == nil {
		if _, err := os.Stat(filepath.Join(dir, "oci-layout")); err != nil {
			return v1.Hash{}, fmt.Errorf("layout %s: exists and is not an OCI image layout; not replaced", dir)
		}
		if err := os.RemoveAll(dir); err != nil {
			return v1.Hash{}, err
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return v1.Hash{}, err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return v1.Hash{}, fmt.Errorf("layout %s: %w", dir, err)
	}
	if err := p.WriteImage(img); err != nil {
		return v1.Hash{}, fmt.Errorf("layout %s: %w", dir, err)
	}
	// The descriptor is written here, not by AppendImage, which would add an
	// artifactType (the config's media type) that image-spec gives artifacts, not images.
	var ann map[string]string
	if ref != "" {
		ann = map[string]string{RefName: ref}
	}
	desc, err := descriptor(img, ann)
	if err != nil {
		return v1.Hash{}, err
	}
	if err := p.AppendDescriptor(desc); err != nil {
		return v1.Hash{}, fmt.Errorf("layout %s: %w", dir, err)
	}
	return desc.Digest, nil
}

// descriptor is img's entry in an index (a layout's index.json, Write's and
// WriteTar's): its manifest's media type, size and digest, its platform, annotations.
func descriptor(img v1.Image, annotations map[string]string) (v1.Descriptor, error) {
	cf, err := img.ConfigFile()
	if err != nil {
		return v1.Descriptor{}, err
	}
	mt, err := img.MediaType()
	if err != nil {
		return v1.Descriptor{}, err
	}
	raw, err := img.RawManifest()
	if err != nil {
		return v1.Descriptor{}, err
	}
	digest, err := img.Digest()
	if err != nil {
		return v1.Descriptor{}, err
	}
	return v1.Descriptor{MediaType: mt, Size: int64(len(raw)), Digest: digest,
		Platform: &v1.Platform{OS: cf.OS, Architecture: cf.Architecture}, Annotations: annotations}, nil
}

// Read is the one image of the layout at dir, as Write wrote it.
func Read(dir string) (v1.Image, error) {
	p, err := layout.FromPath(dir)
	if err != nil {
		return nil, err
	}
	idx, err := p.ImageIndex()
	if err != nil {
		return nil, fmt.Errorf("layout %s: %w", dir, err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, fmt.Errorf("layout %s: %w", dir, err)
	}
	if len(m.Manifests) != 1 {
		return nil, fmt.Errorf("layout %s: %d manifests, not one", dir, len(m.Manifests))
	}
	img, err := idx.Image(m.Manifests[0].Digest)
	if err != nil {
		return nil, fmt.Errorf("layout %s: %w", dir, err)
	}
	return img, nil
}
