#!/bin/bash
# build.sh OUT: builds the pinned control plane the cluster e2e runs (kube-apiserver,
# kube-scheduler, kube-controller-manager from kubernetes/go.mod, etcd from etcd/go.mod), and
# the kubelet of the node the QEMU guest runs (static), into
# OUT/kubernetes-<version>-etcd-<version>-<key>/ and prints that directory. The key is a
# digest of kubernetes/ and etcd/'s go.mod and go.sum and of this script, so a second run
# finds the binaries and builds nothing, and a new pin, dependency version or build flag
# builds a new directory (with a warm Go build cache, a link of a minute).
# Cold, after make test's unit phase (which compiles the packages it shares with the kube module), it
# took 577 s on 2 idle cores; with nothing shared, the Kubernetes part alone took 670 s.
# The static kubelet adds about 600 s cold (below).
set -euo pipefail
out=${1:?usage: build.sh OUT}
here=$(cd "$(dirname "$0")" && pwd)
# The builds run in the modules' directories: OUT must not be relative to here.
mkdir -p "$out" && out=$(cd "$out" && pwd)
GO=${GO:-go}

pin() { # pin MODDIR MODULE: the version MODDIR's go.mod requires of MODULE
	(cd "$here/$1" && "$GO" list -m -f '{{.Version}}' "$2")
}
kver=$(pin kubernetes k8s.io/kubernetes)
ever=$(pin etcd go.etcd.io/etcd/server/v3)
key=$(cat "$here/kubernetes/go.mod" "$here/kubernetes/go.sum" "$here/etcd/go.mod" "$here/etcd/go.sum" "$here/build.sh" | sha256sum | cut -c1-12)
dir=$out/kubernetes-$kver-etcd-$ever-$key
bins="kube-apiserver kube-scheduler kube-controller-manager kubelet etcd"

have=1
for b in $bins; do [ -x "$dir/$b" ] || have=0; done
if [ $have = 1 ]; then echo "$dir"; exit 0; fi

mkdir -p "$dir.tmp"
start=$SECONDS
# The version stamp is what /version reports; kubectl and the components compare it.
minor=${kver#v1.}; minor=${minor%%.*}
ld="-s -w -X k8s.io/component-base/version.gitVersion=$kver -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
# One go build of the three commands: their shared packages are compiled once, both
# cores busy. -mod=readonly: the go.sum files are the pin, never rewritten here.
# Built as the kube module's tests build (cgo as the go command defaults; -trimpath
# when the Makefile runs it, as it runs the tests: GOFLAGS) and kubernetes/go.mod
# requires the versions kube/go.mod selects of every module both compile: the packages
# they share (k8s.io/api, apimachinery, client-go, grpc, protobuf, ...) are then the
# same Go build-cache entries, compiled once by make test's unit phase and not again
# here (TestControlPlaneSharesKube checks the versions).
echo "cluster: building kube-apiserver, kube-scheduler, kube-controller-manager $kver (cold: about 10 minutes on 2 idle cores)" >&2
(cd "$here/kubernetes" && nice -n 10 "$GO" build -mod=readonly -ldflags "$ld" -o "$dir.tmp/" \
	k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kube-controller-manager)
# The kubelet runs on the QEMU guest's root, which has no glibc: built static,
# CGO_ENABLED=0. Kubernetes' releases link it with cgo against glibc (hack/lib/golang.sh
# leaves kubelet out of KUBE_STATIC_BINARIES; KUBE_STATIC_OVERRIDES=kubelet is its own way
# to build it as here): the only cgo in its graph is net's and os/user's (go list -deps
# -f {{.CgoFiles}}), whose pure-Go resolver and /etc/passwd reader serve instead.
# A go build of its own, since cgo off makes every package that imports net or os/user
# (most of them) another build-cache entry than the control plane's: after the control
# plane's build, 1170 of kubelet's 1800 packages are new with CGO_ENABLED=0 (measured
# cold: 596 s on 2 cores shared with other builds, load 4-7), 105 with cgo (47 s). In the
# control plane's go build, CGO_ENABLED=0 would make all four binaries miss the unit
# phase's cache, so the kubelet is built apart; warm, it is a link (28 s, the whole
# script's five links 131 s, at load 8-9). A cgo build linked -linkmode external
# -extldflags -static would keep the sharing, but puts glibc's NSS (getaddrinfo,
# getpwnam_r, ...) in a static binary: ld warns that they need, at run time, the shared
# libraries the guest does not have.
echo "cluster: building kubelet $kver (static, CGO_ENABLED=0)" >&2
(cd "$here/kubernetes" && CGO_ENABLED=0 nice -n 10 "$GO" build -mod=readonly -ldflags "$ld" -o "$dir.tmp/kubelet" k8s.io/kubernetes/cmd/kubelet)
echo "cluster: building etcd $ever" >&2
# etcd builds the same way, and etcd/go.mod requires the control plane's version of
# every module both compile where etcd v3.7.3 allows it (TestEtcdSharesControlPlane):
# the standard library, protobuf, prometheus, x/sys, ... are then cache hits too.
(cd "$here/etcd" && nice -n 10 "$GO" build -mod=readonly -ldflags "-s -w" -o "$dir.tmp/etcd" go.etcd.io/etcd/server/v3)
rm -rf "$dir" && mv "$dir.tmp" "$dir"
echo "cluster: control plane built in $((SECONDS - start)) s" >&2
echo "$dir"
