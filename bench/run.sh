#!/usr/bin/env bash
# bench/run.sh [benchtable flags]: what `make bench` runs. Builds passage and
# bench/cmd/benchtable, makes sure the image exists (make initramfs, a no-op when it is up
# to date), then prints the table and writes it, with the details, to $BUILD/bench.md
# (build/bench.md): a run's figures are output, not a tracked file.
#   bash bench/run.sh -boot=false -rounds 5    # quick: no QEMU boots, fewer runs
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}
# The image and boot rows read the default kernel's image (make initramfs: IMAGE).
image=${IMAGE:-$build/linux-6.12}

# strace counts the sysfs reads of the passage process (the floor row).
if ! command -v strace >/dev/null; then
	if [[ $(id -u) == 0 ]]; then
		echo "bench: installing strace"
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends strace >/dev/null
	else
		echo "bench: strace missing; run as root or install it" >&2
		exit 1
	fi
fi

boot=1
for a in "$@"; do
	[[ $a == -boot=false || $a == --boot=false ]] && boot=0
done
# The image row reads the initramfs and the boot row boots it: build it when stale.
if ((boot)) || [[ ! -s $image/initramfs.cpio.gz ]]; then
	make --no-print-directory initramfs BUILD="$build" IMAGE="$image"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Static, as make build and the image build it (CGO_ENABLED=0): the binary an operator runs.
CGO_ENABLED=0 go build -o "$tmp/passage" ./cmd/passage
go build -o "$tmp/benchtable" ./bench/cmd/benchtable
# Row O3's start-up floors: a static Go program that does nothing, and one that links every
# package cmd/passage imports and runs only their initialisation. Built from a directory
# in the module (its "_" keeps it out of ./...), removed at once.
fl=$(mktemp -d "$PWD/_startfloor.XXXXXX")
trap 'rm -rf "$tmp" "$fl"' EXIT
mkdir -p "$fl/empty" "$fl/deps"
printf 'package main\n\nfunc main() {}\n' >"$fl/empty/main.go"
{
	printf 'package main\n\nimport (\n'
	go list -f '{{range .Imports}}{{printf "\t_ %q\n" .}}{{end}}' ./cmd/passage
	printf ')\n\nfunc main() {}\n'
} >"$fl/deps/main.go"
CGO_ENABLED=0 go build -o "$tmp/floor-empty" "./${fl#"$PWD"/}/empty"
CGO_ENABLED=0 go build -o "$tmp/floor-deps" "./${fl#"$PWD"/}/deps"
rm -rf "$fl"
mkdir -p "$build"
"$tmp/benchtable" -passage "$tmp/passage" -floor "$tmp/floor-empty,$tmp/floor-deps" -build "$image" -out "$build/bench.md" "$@"
