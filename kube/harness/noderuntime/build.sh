#!/bin/bash
# build.sh OUT: builds the container runtime of the node the QEMU guest runs, static, from
# the Go module proxy: containerd, containerd-shim-runc-v2 and ctr (containerd/go.mod), the
# CNI plugins ptp, bridge, host-local, loopback and portmap (cni/go.mod), and runc
# (runc/go.mod), into OUT/containerd-<version>-cni-<version>-runc-<version>-<key>/, and
# prints that directory. The key is a digest of the three go.mod and go.sum files and of
# this script: a second run finds the binaries and builds nothing; a new pin, dependency
# or flag builds a new directory.
#
# Three modules, not one: each program is compiled at exactly the dependency versions its
# own release's go.mod requires. In one module, minimum version selection moved
# containerd's grpc, otel, cilium/ebpf and hcsshim (the CNI plugins' Windows requirements
# reach it) and runc's selinux, cilium/ebpf and go-criu above what those releases were
# tested with; TestNodeRuntimeAtReleasePins holds each module to its release's pins.
#
# The guest has no glibc, so everything is static:
#   - containerd and ctr: CGO_ENABLED=0 with the tags containerd's Makefile gives STATIC=1
#     builds (osusergo netgo static_build; urfave_cli_no_docs always). no_btrfs is implied (the btrfs snapshotter is cgo-only), no_devmapper and
#     no_zfs leave out the snapshotters the node does not use (it uses overlayfs); CRI stays
#     in, the kubelet talks to it.
#   - the shim: as containerd's Makefile builds it (SHIM_CGO_ENABLED=0, the no_grpc tag:
#     it speaks ttrpc only).
#   - the CNI plugins: CGO_ENABLED=0, their version in buildversion.BuildVersion (what
#     a plugin's VERSION command reports).
#   - runc: its nsenter (libcontainer/nsenter) is C and runs before Go's runtime, so it
#     needs cgo; linked as runc's own `make static` does (static PIE, tags netgo osusergo),
#     with seccomp, against Debian's libseccomp.a (libseccomp-dev, image/deps.sh) and
#     glibc's libc.a: pods asking for the RuntimeDefault seccomp profile need it. Not the
#     libpathrs tag (a Rust library Debian 12 does not package): runc then uses its Go
#     path-safety code, as its builds without libpathrs do.
# containerd's version.Version is the module's version (containerd --version prints it);
# a module zip has no VCS, so its Revision is left empty.
set -euo pipefail
out=${1:?usage: build.sh OUT}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out" && out=$(cd "$out" && pwd)
GO=${GO:-go}

pin() { # pin MODDIR MODULE: the version MODDIR's go.mod requires of MODULE
	(cd "$here/$1" && "$GO" list -m -f '{{.Version}}' "$2")
}
cver=$(pin containerd github.com/containerd/containerd/v2)
nver=$(pin cni github.com/containernetworking/plugins)
rver=$(pin runc github.com/opencontainers/runc)
key=$(cat "$here"/{containerd,cni,runc}/go.{mod,sum} "$here/build.sh" | sha256sum | cut -c1-12)
dir=$out/containerd-$cver-cni-$nver-runc-$rver-$key
cni="ptp bridge host-local loopback portmap"
bins="containerd containerd-shim-runc-v2 ctr runc $cni"

have=1
for b in $bins; do [ -x "$dir/$b" ] || have=0; done
if [ $have = 1 ]; then echo "$dir"; exit 0; fi

rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
start=$SECONDS
# -mod=readonly: the go.sum files are the pin, never rewritten here. -trimpath: nothing
# here shares build-cache entries with kube's tests, and the binaries then do not name
# this machine's module cache.
build() { # build MODDIR ENV... -- GOBUILDARGS...
	local mod=$1 env=()
	shift
	while [ "$1" != -- ]; do env+=("$1"); shift; done
	shift
	(cd "$here/$mod" && env "${env[@]}" nice -n 10 "$GO" build -mod=readonly -trimpath "$@")
}
cpkg=github.com/containerd/containerd/v2
cld="-s -w -X $cpkg/version.Version=$cver -X $cpkg/version.Package=$cpkg"
ctags="urfave_cli_no_docs osusergo netgo static_build no_btrfs no_devmapper no_zfs"
echo "noderuntime: building containerd, ctr $cver" >&2
build containerd CGO_ENABLED=0 -- -tags "$ctags" -ldflags "$cld" -o "$dir.tmp/" \
	$cpkg/cmd/containerd $cpkg/cmd/ctr
echo "noderuntime: building containerd-shim-runc-v2 $cver" >&2
build containerd CGO_ENABLED=0 -- -tags "$ctags no_grpc" -ldflags "$cld" -o "$dir.tmp/" \
	$cpkg/cmd/containerd-shim-runc-v2
echo "noderuntime: building the CNI plugins $nver ($cni)" >&2
npkg=github.com/containernetworking/plugins
build cni CGO_ENABLED=0 -- -ldflags "-s -w -X $npkg/pkg/utils/buildversion.BuildVersion=$nver" -o "$dir.tmp/" \
	$npkg/plugins/main/ptp $npkg/plugins/main/bridge $npkg/plugins/ipam/host-local $npkg/plugins/main/loopback $npkg/plugins/meta/portmap
echo "noderuntime: building runc $rver (cgo, static PIE, seccomp)" >&2
[ -e /usr/include/seccomp.h ] || { echo "noderuntime: no /usr/include/seccomp.h: make deps installs libseccomp-dev" >&2; exit 1; }
build runc CGO_ENABLED=1 -- -buildmode=pie -tags "seccomp urfave_cli_no_docs netgo osusergo" \
	-ldflags "-s -w -linkmode external -extldflags -static-pie" -o "$dir.tmp/runc" github.com/opencontainers/runc
for b in $bins; do
	# A program that asks for an ELF interpreter would not start on the guest.
	if readelf -l "$dir.tmp/$b" | grep -q 'Requesting program interpreter'; then
		echo "noderuntime: $b is dynamically linked" >&2
		exit 1
	fi
done
rm -rf "$dir" && mv "$dir.tmp" "$dir"
echo "noderuntime: built in $((SECONDS - start)) s" >&2
echo "$dir"
