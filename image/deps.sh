#!/usr/bin/env bash
# Installs, from Debian's archive, the tools passage's build and tests use when they are
# missing: pciutils (lspci, our decoding oracle), QEMU, swtpm, e2fsprogs. Nothing is installed when
# everything is already there.
set -euo pipefail
need=()
command -v lspci >/dev/null || need+=(pciutils)
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v swtpm >/dev/null || need+=(swtpm swtpm-tools)
command -v cpio >/dev/null || need+=(cpio)
[[ -e /usr/include/openssl/evp.h ]] || need+=(libssl-dev) # manifest/tpmkey tests: the TPM simulator is cgo and links -lcrypto
# mkfs.ext4 and debugfs: the QEMU tests' disk (passage.out) is made and read without mounting.
{ command -v mkfs.ext4 && command -v debugfs; } >/dev/null || need+=(e2fsprogs)
# libvirt: render's domain is checked by libvirt itself (cmd/passage/libvirt_test.go):
# virt-xml-validate (libvirt-clients, xmllint from libxml2-utils)
# and libvirtd with its QEMU driver, started by the test in a private mount namespace.
command -v virt-xml-validate >/dev/null || need+=(libvirt-clients)
command -v xmllint >/dev/null || need+=(libxml2-utils)
command -v libvirtd >/dev/null || need+=(libvirt-daemon libvirt-daemon-driver-qemu)
if ((${#need[@]})); then
	if [[ $(id -u) != 0 ]]; then
		echo "deps: missing ${need[*]}; run as root or install them" >&2
		exit 1
	fi
	echo "deps: installing ${need[*]}"
	export DEBIAN_FRONTEND=noninteractive
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
