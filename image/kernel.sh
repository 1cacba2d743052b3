#!/usr/bin/env bash
# kernel.sh DEST: unpacks (never installs) Debian's current linux-image-<flavour>-amd64
# into DEST, so the initramfs build and the QEMU tests run on the same kernel a node
# would PXE-boot. Writes DEST/vmlinuz, DEST/lib/modules/<kver>/... and DEST/release.
# Idempotent: a DEST with vmlinuz, release and its module tree is left as it is.
set -euo pipefail
dest=${1:?usage: kernel.sh DEST}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)

if [[ -s $dest/vmlinuz && -s $dest/release && -d $dest/lib/modules/$(cat "$dest/release")/kernel ]]; then
	echo "kernel: $(cat "$dest/release") already in $dest"
	exit 0
fi

start=$(date +%s.%N)
# apt-cache knows nothing before the first update on a fresh machine.
flavour() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'; }
pkg=$(flavour || true)
if [[ -z $pkg ]]; then
	echo "kernel: apt-get update (no package lists yet)"
	apt-get update -qq
	pkg=$(flavour)
fi
if [[ -z $pkg ]]; then
	echo "kernel: apt-cache depends linux-image-amd64 names no linux-image-<version> package" >&2
	exit 1
fi
kver=${pkg#linux-image-}

cache=$dest/../kernel-deb
mkdir -p "$cache"
deb=$(ls "$cache"/"${pkg}"_*.deb 2>/dev/null | head -n1 || true)
if [[ -z $deb ]]; then
	echo "kernel: downloading $pkg"
	# apt-get download writes into the current directory; as root it warns about the
	# _apt sandbox user being unable to write there, which is harmless.
	(cd "$cache" && apt-get download -q "$pkg" 2>&1 | grep -v -e '^W: Download is performed unsandboxed' || true)
	deb=$(ls "$cache"/"${pkg}"_*.deb 2>/dev/null | head -n1 || true)
	[[ -n $deb ]] || { echo "kernel: apt-get download $pkg produced no .deb in $cache" >&2; exit 1; }
fi

tmp=$(mktemp -d "$dest/.unpack.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
dpkg -x "$deb" "$tmp"
vmlinuz=$(ls "$tmp"/boot/vmlinuz-* 2>/dev/null | head -n1 || true)
[[ -n $vmlinuz ]] || { echo "kernel: $deb has no boot/vmlinuz-*" >&2; exit 1; }
[[ -d $tmp/lib/modules/$kver/kernel ]] || { echo "kernel: $deb has no lib/modules/$kver/kernel" >&2; exit 1; }

rm -rf "$dest/boot" "$dest/lib" "$dest/usr" "$dest/etc"
for d in "$tmp"/*; do mv "$d" "$dest/"; done
cp "$dest/boot/$(basename "$vmlinuz")" "$dest/vmlinuz"
echo "$kver" >"$dest/release.tmp" && mv "$dest/release.tmp" "$dest/release"
end=$(date +%s.%N)
printf 'kernel: %s unpacked into %s in %.1f s (%s)\n' "$kver" "$dest" "$(awk -v a="$start" -v b="$end" 'BEGIN{print b-a}')" "$(basename "$deb")"
