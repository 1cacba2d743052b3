#!/usr/bin/env bash
# Installs, from Debian's archive, the tools passage's build and tests use when they are
# missing: pciutils (lspci, our decoding oracle), QEMU, swtpm, e2fsprogs, runc. Nothing is installed when
# everything is already there.
set -euo pipefail
need=()
command -v lspci >/dev/null || need+=(pciutils)
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v swtpm >/dev/null || need+=(swtpm swtpm-tools)
command -v cpio >/dev/null || need+=(cpio)
# gcc: kube/fabricmanager's tests build their stand-in libnvfm.so (fmstub.c); cgo builds need it too.
command -v gcc >/dev/null || need+=(gcc)
[[ -e /usr/include/openssl/evp.h ]] || need+=(libssl-dev) # manifest/tpmkey tests: the TPM simulator is cgo and links -lcrypto
# promtool: metrics/ checks the exposition (promtool check metrics) and runs the alert rules' tests.
command -v promtool >/dev/null || need+=(prometheus)
# stages/boot pushes a boot's metrics to a real Pushgateway on loopback.
command -v prometheus-pushgateway >/dev/null || need+=(prometheus-pushgateway)
# mkfs.ext4 and debugfs: the QEMU tests' disk (passage.out) is made and read without mounting.
{ command -v mkfs.ext4 && command -v debugfs; } >/dev/null || need+=(e2fsprogs)
# libvirt: render's domain is checked by libvirt itself (cmd/passage/libvirt_test.go):
# virt-xml-validate (libvirt-clients, xmllint from libxml2-utils)
# and libvirtd with its QEMU driver, started by the test in a private mount namespace.
command -v virt-xml-validate >/dev/null || need+=(libvirt-clients)
command -v xmllint >/dev/null || need+=(libxml2-utils)
command -v libvirtd >/dev/null || need+=(libvirt-daemon libvirt-daemon-driver-qemu)
# Network boot under Secure Boot (qemu-tests scenario 8, image/uki.sh): OVMF's Secure Boot
# firmware with the snakeoil test key enrolled; the iPXE option ROMs QEMU loads for the NIC;
# systemd's EFI stub for the unified kernel image; objcopy to assemble it; sbsign to sign it;
# openssl to read the snakeoil key.
[[ -e /usr/share/OVMF/OVMF_VARS_4M.snakeoil.fd ]] || need+=(ovmf)
[[ -e /usr/lib/ipxe/qemu/efi-e1000e.rom ]] || need+=(ipxe-qemu)
[[ -e /usr/lib/systemd/boot/efi/linuxx64.efi.stub ]] || need+=(systemd-boot-efi)
command -v objcopy >/dev/null || need+=(binutils)
command -v sbsign >/dev/null || need+=(sbsigntool)
command -v openssl >/dev/null || need+=(openssl)
# sfdisk: the switch_root scenario's GPT root disk, and rootdev's test against blkid.
command -v sfdisk >/dev/null || need+=(fdisk)
# udev: systemd-hwdb, which pciids' test uses to build a hardware database of its own, and
# the system's hwdb.bin (made by udev's postinst), the second source lspci takes names from.
command -v systemd-hwdb >/dev/null || need+=(udev)
# runc: kube/images runs the passage-dra image as a node's runtime would (TestRuncRunsDRA).
# make images reads the base's .debs itself; apt-get download fetches them (below).
command -v runc >/dev/null || need+=(runc)
# libseccomp-dev: kube/harness/noderuntime/build.sh links the node's runc statically with
# seccomp (pods asking for the RuntimeDefault profile need it): seccomp.h and libseccomp.a.
[[ -e /usr/include/seccomp.h && -e /usr/lib/x86_64-linux-gnu/libseccomp.a ]] || need+=(libseccomp-dev)
if ((${#need[@]})); then
	if [[ $(id -u) != 0 ]]; then
		echo "deps: missing ${need[*]}; run as root or install them" >&2
		exit 1
	fi
	echo "deps: installing ${need[*]}"
	export DEBIAN_FRONTEND=noninteractive
	# Packages with daemons (prometheus, prometheus-pushgateway, libvirt) must not start
	# them, listening on every address: passage's tests start their own on loopback. Debian's
	# policy-rc.d (exit 101) tells invoke-rc.d and deb-systemd-invoke not to start any
	# service during this install; it is removed afterwards unless it was there before.
	policy=/usr/sbin/policy-rc.d
	if [[ ! -e $policy ]]; then
		printf '#!/bin/sh\nexit 101\n' >"$policy"
		chmod 755 "$policy"
		trap 'rm -f "$policy"' EXIT
	fi
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# libvirtd's QEMU driver looks its default user up before it reads any qemu.conf:
# libvirt-daemon-system would create it, with services this project does not want.
if ! getent passwd libvirt-qemu >/dev/null; then
	if [[ $(id -u) != 0 ]]; then
		echo "deps: no libvirt-qemu user; run as root or create it" >&2
		exit 1
	fi
	useradd --system --no-create-home --home-dir /var/lib/libvirt --shell /usr/sbin/nologin libvirt-qemu
fi
# The daemons installed above do not start at the machine's next boot either, where systemd
# runs: the tests start their own.
for s in prometheus prometheus-pushgateway; do
	if [[ " ${need[*]-} " == *" $s "* ]] && command -v systemctl >/dev/null; then
		systemctl disable --quiet "$s" 2>/dev/null || true
	fi
done
# passage-dra's glibc base (kube/images/glibc-base), the Debian packages make images and
# kube/images's TestRuncRunsDRA put under the image: fetched here, with the other
# downloads, so no test reaches the network. debs.sh downloads only what is not already in
# $BUILD/images/debs at the archive's version (a second or two of apt-cache otherwise);
# glibc-base.list there names this base's .debs, under the digest of the glibc-base it
# was made from, and the test refuses a list of another.
root=$(cd "$(dirname "$0")/.." && pwd)
debs=${BUILD:-$root/build}/images/debs
mkdir -p "$debs"
base=$root/kube/images/glibc-base
got=$(bash "$root/kube/images/debs.sh" "$debs" $(grep -v '^#' "$base")) || exit 1
{
	echo "# kube/images/glibc-base sha256:$(sha256sum <"$base" | cut -d' ' -f1)"
	for p in $got; do basename "$p"; done
} >"$debs/glibc-base.list.tmp"
mv "$debs/glibc-base.list.tmp" "$debs/glibc-base.list"
