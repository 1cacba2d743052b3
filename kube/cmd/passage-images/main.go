// Command passage-images writes passage's container images (package images), and the
// images the real node test runs (images.Node: pause, vfio-probe), with no container
// daemon: make images runs it.
//
//	passage-images -bin DIR -out DIR [flags] DEB...
//
// -bin holds the programs, one file per image name (passage-dra, built with cgo;
// passage-control, passage-hook, pause and vfio-probe, static). The DEBs are
// passage-dra's glibc base. Each image goes to OUT/NAME (an OCI image layout, named -tag
// in its index.json) and to OUT/NAME.oci.tar (the same layout as one tar, named
// REGISTRY/NAME:TAG, for ctr images import), its manifest's digest to OUT/NAME.digest,
// the base's packages to OUT/debs.lock; a table of the images, their references and the
// packages is printed.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/go-containerregistry/pkg/name"

	"github.com/passage-boot/passage/kube/images"
)

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("passage-images", flag.ContinueOnError)
	fs.SetOutput(stderr)
	bin := fs.String("bin", "", "`DIR` holding the programs, one file named as each image")
	out := fs.String("out", "", "`DIR` the layouts, digests and lock file are written to")
	arch := fs.String("arch", runtime.GOARCH, "the images' and the packages' architecture")
	created := fs.String("created", os.Getenv("SOURCE_DATE_EPOCH"), "the images' creation time, Unix `SECONDS` (default $SOURCE_DATE_EPOCH; none: 0001-01-01)")
	source := fs.String("source", "", "label "+images.LabelSource+": the source repository's `URL`")
	revision := fs.String("revision", "", "label "+images.LabelRevision+": the commit")
	version := fs.String("version", "", "label "+images.LabelVersion)
	tag := fs.String("tag", "latest", "each image's name in its layout ("+images.RefName+"), as the deploy files' image: references it, and its tar's tag")
	registry := fs.String("registry", "passage.test", "the `HOST` of each tar's reference, HOST/NAME:TAG (no registry serves it: ctr images import gives the name)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: passage-images -bin DIR -out DIR [flags] DEB...  (the DEBs: passage-dra's glibc base)")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *bin == "" || *out == "" || fs.NArg() == 0 {
		fs.Usage()
		return 2
	}
	if _, err := name.NewRegistry(*registry, name.StrictValidation); err != nil {
		fmt.Fprintf(stderr, "passage-images: -registry %q: %v\n", *registry, err)
		return 2
	}
	if _, err := name.NewTag(*registry+"/passage-images:"+*tag, name.StrictValidation); err != nil {
		fmt.Fprintf(stderr, "passage-images: -registry %q -tag %q: %v\n", *registry, *tag, err)
		return 2
	}
	var when time.Time
	if *created != "" {
		s, err := strconv.ParseInt(*created, 10, 64)
		if err != nil {
			fmt.Fprintf(stderr, "passage-images: -created %q: not Unix seconds\n", *created)
			return 2
		}
		when = time.Unix(s, 0).UTC()
	}
	labels := map[string]string{}
	for k, v := range map[string]string{images.LabelSource: *source, images.LabelRevision: *revision, images.LabelVersion: *version} {
		if v != "" {
			labels[k] = v
		}
	}
	var debs []*images.Deb
	for _, p := range fs.Args() {
		d, err := images.OpenDeb(p)
		if err != nil {
			fmt.Fprintf(stderr, "passage-images: %v\n", err)
			return 1
		}
		debs = append(debs, d)
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		fmt.Fprintf(stderr, "passage-images: %v\n", err)
		return 1
	}
	var lock strings.Builder
	for _, d := range debs {
		fmt.Fprintln(&lock, d)
	}
	if err := os.WriteFile(filepath.Join(*out, "debs.lock"), []byte(lock.String()), 0o644); err != nil {
		fmt.Fprintf(stderr, "passage-images: %v\n", err)
		return 1
	}
	tw := tabwriter.NewWriter(stdout, 0, 8, 2, ' ', 0)
	var refs strings.Builder
	for _, r := range append(images.Passage(), images.Node()...) {
		s := images.Spec{Recipe: r, Arch: *arch, Created: when, Labels: labels}
		var err error
		if s.Binary, err = os.ReadFile(filepath.Join(*bin, r.Name)); err != nil {
			fmt.Fprintf(stderr, "passage-images: %s: %v\n", r.Name, err)
			return 1
		}
		if r.Glibc {
			s.Debs = debs
		}
		img, err := images.Build(s)
		if err != nil {
			fmt.Fprintf(stderr, "passage-images: %v\n", err)
			return 1
		}
		dir := filepath.Join(*out, r.Name)
		digest, err := images.Write(dir, img, *tag)
		if err != nil {
			fmt.Fprintf(stderr, "passage-images: %s: %v\n", r.Name, err)
			return 1
		}
		ref := *registry + "/" + r.Name + ":" + *tag
		if d, err := images.WriteTar(dir+".oci.tar", img, ref); err != nil || d != digest {
			fmt.Fprintf(stderr, "passage-images: %s: %v (digest %s, the layout's %s)\n", r.Name, err, d, digest)
			return 1
		}
		fmt.Fprintf(&refs, "%s@%s\t%s\n", ref, digest, dir+".oci.tar")
		if err := os.WriteFile(dir+".digest", []byte(digest.String()+"\n"), 0o644); err != nil {
			fmt.Fprintf(stderr, "passage-images: %v\n", err)
			return 1
		}
		m, err := img.Manifest()
		if err != nil {
			fmt.Fprintf(stderr, "passage-images: %s: %v\n", r.Name, err)
			return 1
		}
		var size int64
		for _, l := range m.Layers {
			size += l.Size
		}
		base := "static"
		if r.Glibc {
			base = fmt.Sprintf("glibc: %d Debian packages", len(debs))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d layers, %.1f MB compressed\t%s\n", r.Name, digest, dir, len(m.Layers), float64(size)/1e6, base)
	}
	tw.Flush()
	fmt.Fprintf(stdout, "references (ctr -n k8s.io images import --digests NAME.oci.tar names each):\n%s", refs.String())
	fmt.Fprintf(stdout, "base packages (%s):\n%s", filepath.Join(*out, "debs.lock"), lock.String())
	return 0
}
