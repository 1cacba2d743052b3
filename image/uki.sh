#!/usr/bin/env bash
# uki.sh OUTDIR KERNEL INITRD CMDLINE KEY CERT: writes OUTDIR/passage.efi, a unified kernel
# image (systemd-stub with the kernel, the initramfs and the command line as PE sections)
# signed for UEFI Secure Boot with KEY/CERT (sbsign), and OUTDIR/boot.ipxe, the iPXE
# script that chains it. The firmware verifies the whole image (kernel, initramfs and
# command line) against its db before it runs any of it: a node boots only what the
# holder of KEY signed, whatever the network between them did. CMDLINE is the text of
# the command line (systemd-stub ignores a loader's arguments under Secure Boot).
set -euo pipefail
(($# == 6)) || { echo "usage: uki.sh OUTDIR KERNEL INITRD CMDLINE KEY CERT" >&2; exit 2; }
out=$1 kernel=$2 initrd=$3 cmdline=$4 key=$5 cert=$6
# The kernel keeps 2047 bytes of its command line (x86 COMMAND_LINE_SIZE 2048, its NUL
# included: arch/x86/include/asm/setup.h; the boot protocol's cmdline_size) and drops the
# rest without a word, passage.plan= and pci=config_acs= entries first (make uki puts
# them last): a longer line is refused before anything is signed, and so is one of
# exactly 2047 bytes, which the boot cannot tell from a cut one (decision.MaxCmdline).
bytes=$(printf '%s' "$cmdline" | LC_ALL=C wc -c)
((bytes <= 2046)) || {
	echo "uki: the command line is $bytes bytes, at most 2046 sign (the kernel keeps 2047, x86 COMMAND_LINE_SIZE 2048 less its NUL, and a line that long cannot be told from a cut one): refused, nothing signed" >&2
	exit 1
}
stub=/usr/lib/systemd/boot/efi/linuxx64.efi.stub
for f in "$kernel" "$initrd" "$key" "$cert" "$stub"; do
	[[ -s $f ]] || { echo "uki: $f: missing or empty" >&2; exit 1; }
done
command -v sbsign >/dev/null || { echo "uki: sbsign missing (make deps installs sbsigntool)" >&2; exit 1; }
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '%s' "$cmdline" >"$tmp/cmdline"
# Section addresses as systemd 252's ukify lays them out: each section past the end of
# the one before, the kernel (up to 16 MiB) at 0x2000000 and the initramfs above it.
kend=$((0x2000000 + $(stat -c %s "$kernel")))
iaddr=$(( (kend + 0xfffff) & ~0xfffff ))
((iaddr >= 0x3000000)) || iaddr=0x3000000
objcopy \
	--add-section .osrel=/usr/lib/os-release --change-section-vma .osrel=0x20000 \
	--add-section .cmdline="$tmp/cmdline" --change-section-vma .cmdline=0x30000 \
	--add-section .linux="$kernel" --change-section-vma .linux=0x2000000 \
	--add-section .initrd="$initrd" --change-section-vma .initrd="$(printf '0x%x' "$iaddr")" \
	"$stub" "$tmp/passage.efi"
sbsign --key "$key" --cert "$cert" --output "$tmp/signed.efi" "$tmp/passage.efi" 2>"$tmp/sbsign.log" ||
	{ cat "$tmp/sbsign.log" >&2; exit 1; }
mv "$tmp/signed.efi" "$out/passage.efi"
sha=$(sha256sum "$out/passage.efi" | cut -d' ' -f1)
cat >"$out/boot.ipxe.tmp" <<IPXE
#!ipxe
# passage: a signed unified kernel image (kernel, initramfs, command line), sha256 $sha.
# The firmware's Secure Boot check (LoadImage against db) decides whether it runs; this
# script and the network that carried it are not trusted with that.
chain passage.efi || goto refused
:refused
echo passage: passage.efi did not boot: refused by the firmware (not signed by a key in db, or altered) or not fetched
IPXE
mv "$out/boot.ipxe.tmp" "$out/boot.ipxe"
echo "uki: wrote $out/passage.efi (sha256 $sha) and $out/boot.ipxe"
