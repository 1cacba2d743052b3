#!/usr/bin/env bash
# demo.sh BUILD: boots the image once under QEMU with the default qemu topology
# (passage.handoff=poweroff passage.emit=console), prints the console report, the boot
# timeline and the wall times, then verifies the manifest the guest wrote with
# `passage verify`. Any failure ends the demo with a non-zero status and says which step.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: demo.sh BUILD}
mkdir -p "$build"
build=$(cd "$build" && pwd)
out=$build/demo
keys=$build/demo-key
rm -rf "$out"

echo "demo: building passage"
CGO_ENABLED=0 go build -o "$build/passage" ./cmd/passage # static, as make build and the image

echo "demo: booting $build/initramfs.cpio.gz on $(cat "$build/kernel/release") under QEMU (TCG; about a minute)"
boot_rc=0
go run ./qemu-tests/cmd/qemurun -build "$build" -out "$out" -keydir "$keys" || boot_rc=$?

env=$out/manifest.dsse.json
verify_rc=0
if [[ -s $env ]]; then
	echo
	echo "demo: passage verify (ed25519 key $keys/passage.pub)"
	"$build/passage" verify --pub "$keys/passage.pub" "$env" || verify_rc=$?
else
	echo "demo: FAILED: the guest returned no manifest.dsse.json (console $out/console.log)" >&2
	verify_rc=1
fi

if ((boot_rc != 0)); then
	echo "demo: FAILED: the boot did not finish ok or degraded (exit $boot_rc; console $out/console.log)" >&2
fi
if ((verify_rc != 0)); then
	echo "demo: FAILED: passage verify exited $verify_rc" >&2
fi
if ((boot_rc != 0 || verify_rc != 0)); then
	exit 1
fi
echo "demo: ok"
