package images

import (
	"archive/tar"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// ContainerdName names an image in an index for containerd: its importer (ctr images
// import, the CRI's) takes this annotation's full reference as the image's name, and
// RefName only when it is missing (containerd core/images/archive/importer.go,
// client/import.go imageName).
const ContainerdName = "io.containerd.image.name"

// WriteTar writes img as an OCI image layout in one tar file at path (image-spec
// image-layout.md: oci-layout, index.json, blobs/sha256/...), the form `ctr images
// import` reads, and returns its manifest's digest, the same Write gives. ref is a full
// reference (REGISTRY/REPOSITORY:TAG): index.json's one manifest carries it as both
// RefName and ContainerdName, so containerd names the image ref on import. The tar is
// a function of img and ref: entries in a fixed order, dated 1970, owned by root; a layer
// given twice is one blob. The file is written beside path and renamed over it.
func WriteTar(path string, img v1.Image, ref string) (v1.Hash, error) {
	if _, err := name.NewTag(ref, name.StrictValidation); err != nil {
		return v1.Hash{}, fmt.Errorf("archive %s: reference %q: %w", path, ref, err)
	}
	desc, err := descriptor(img, map[string]string{RefName: ref, ContainerdName: ref})
	if err != nil {
		return v1.Hash{}, err
	}
	digest := desc.Digest
	raw, err := img.RawManifest()
	if err != nil {
		return v1.Hash{}, err
	}
	rawCf, err := img.RawConfigFile()
	if err != nil {
		return v1.Hash{}, err
	}
	cfDigest, err := img.ConfigName()
	if err != nil {
		return v1.Hash{}, err
	}
	index, err := json.Marshal(v1.IndexManifest{
		SchemaVersion: 2,
		MediaType:     types.OCIImageIndex,
		Manifests:     []v1.Descriptor{desc},
	})
	if err != nil {
		return v1.Hash{}, err
	}
	layers, err := img.Layers()
	if err != nil {
		return v1.Hash{}, err
	}

	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return v1.Hash{}, err
	}
	defer os.Remove(tmp.Name()) // after the rename, nothing to remove
	defer tmp.Close()
	tw := tar.NewWriter(tmp)
	entry := func(name string, typ byte, size int64) error {
		mode := int64(0o644)
		if typ == tar.TypeDir {
			mode = 0o755
		}
		return tw.WriteHeader(&tar.Header{Typeflag: typ, Name: name, Size: size, Mode: mode, ModTime: epoch, Format: tar.FormatPAX})
	}
	small := func(name string, b []byte) error {
		if err := entry(name, tar.TypeReg, int64(len(b))); err != nil {
			return err
		}
		_, err := tw.Write(b)
		return err
	}
	blob := func(h v1.Hash) string { return "blobs/" + h.Algorithm + "/" + h.Hex }
	if err := small("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)); err != nil {
		return v1.Hash{}, fmt.Errorf("archive %s: %w", path, err)
	}
	if err := small("index.json", index); err != nil {
		return v1.Hash{}, fmt.Errorf("archive %s: %w", path, err)
	}
	for _, d := range []string{"blobs/", "blobs/sha256/"} {
		if err := entry(d, tar.TypeDir, 0); err != nil {
			return v1.Hash{}, fmt.Errorf("archive %s: %w", path, err)
		}
	}
	if err := small(blob(digest), raw); err != nil {
		return v1.Hash{}, fmt.Errorf("archive %s: %w", path, err)
	}
	if err := small(blob(cfDigest), rawCf); err != nil {
		return v1.Hash{}, fmt.Errorf("archive %s: %w", path, err)
	}
	seen := map[v1.Hash]bool{}
	for _, l := range layers {
		h, err := l.Digest()
		if err != nil {
			return v1.Hash{}, err
		}
		if seen[h] {
			continue
		}
		seen[h] = true
		size, err := l.Size()
		if err != nil {
			return v1.Hash{}, err
		}
		rc, err := l.Compressed()
		if err != nil {
			return v1.Hash{}, err
		}
		err = entry(blob(h), tar.TypeReg, size)
		if err == nil {
			_, err = io.Copy(tw, rc)
		}
		rc.Close()
		if err != nil {
			return v1.Hash{}, fmt.Errorf("archive %s: layer %s: %w", path, h, err)
		}
	}
	if err := tw.Close(); err != nil {
		return v1.Hash{}, fmt.Errorf("archive %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return v1.Hash{}, err
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return v1.Hash{}, err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return v1.Hash{}, err
	}
	return digest, nil
}
