#!/usr/bin/env bash
# ipxe.sh BUILD: writes BUILD/boot.ipxe, the iPXE script that PXE-boots a node into
# passage: Debian's kernel (BUILD/kernel/vmlinuz) and BUILD/initramfs.cpio.gz, served
# next to the script over HTTP(S) (iPXE fetches paths relative to the script's URL).
# The kernel arguments are passage's: the script's comment lists every one
# initramfs/README.md documents (a test keeps the two in step); edit the `set` lines or
# override them from the DHCP server's iPXE options.
set -euo pipefail
build=${1:?usage: ipxe.sh BUILD}
[[ -s $build/initramfs.cpio.gz && -s $build/kernel/vmlinuz ]] ||
	{ echo "ipxe: $build has no kernel/vmlinuz or initramfs.cpio.gz (run make initramfs)" >&2; exit 1; }
release=$(cat "$build/kernel/release")
cp "$build/kernel/vmlinuz" "$build/vmlinuz"
initrd_sha=$(sha256sum "$build/initramfs.cpio.gz" | cut -d' ' -f1)
kernel_sha=$(sha256sum "$build/vmlinuz" | cut -d' ' -f1)
cat >"$build/boot.ipxe.tmp" <<IPXE
#!ipxe
# passage: early-boot provisioning stage for HGX B300 passthrough hosts.
# kernel $release  sha256 $kernel_sha
# initrd initramfs.cpio.gz  sha256 $initrd_sha
#
# Kernel arguments (unknown or malformed passage.* ones are recorded in the manifest and
# the boot goes on with defaults):
#   intel_iommu=on             the IOMMU that vfio needs (on by default in Debian's kernel; explicit here)
#   console=ttyS0,115200       the serial console the BMC shows: passage's stage lines and unit table
#   panic=-1                   reboot at once on a kernel panic instead of hanging the node
#   rdinit=/bbin/passage       passage is the initramfs's init (PID 1), which switch_root
#                              needs: the real root's init must become PID 1. Without it
#                              u-root's init runs passage as its uinit (poweroff/shell/hold)
#   passage.profile=b300       labelling profile: b300, b200, qemu, or an operator's
#   passage.key=PATH           ed25519 signing key in the initramfs (default /etc/passage/key)
#   passage.tpm=auto           sign with the TPM-resident key and extend a PCR when a TPM is there (on|off|auto)
#   passage.ats=prefer         a CX-8 function without ATS degrades its unit; require fails it
#   passage.erase=require      off|auto|require (default: the profile's; b300's is require): erase each
#                              unit's NVMe (sanitize or format, read back) and reset its functions before
#                              vfio binding, on EVERY boot; require fails a unit not erased, auto degrades
#                              it, off keeps the NVMe data; passage.erase_timeout=30m bounds the stage
#   passage.plan=sha256:HEX    the saved plan a signed image carries with its pci=config_acs= (make uki PLAN=);
#                              this unsigned script carries none: its ACS is written by passage, which a
#                              locked-down (Secure Boot) kernel refuses
#   passage.hostname=NAME      the node's name (RFC 1123), set before the manifest signs it; given below from
#                              iPXE's \${hostname} (DHCP option 12 as iPXE got it, or a per-machine script's
#                              set hostname); without it passage takes DHCP option 12 itself, waiting for the
#                              network before the manifest; with neither the manifest signs no name
#   passage.net=auto           management NIC for DHCPv4 (IFACE|auto|off); passage.net_timeout=30s
#   passage.url=URL            where the signed manifest envelope is POSTed (none: no publish); https, or
#                              plain http only to loopback or with passage.url_insecure=1
#   passage.publish_for=30m    keep trying passage.url that long in a boot storm (Retry-After and jitter honoured;
#                              default: 5 tries within passage.stage_timeout); the handoff waits for it
#   passage.push=URL           Prometheus Pushgateway for the manifest's metrics (none: no push)
#   passage.out=/run           or DEV:PATH on a block device, which also keeps the generation counter
#   passage.handoff=switch_root   switch_root|poweroff|shell|hold once the manifest is written
#   passage.root=ROOT          the real root for switch_root, by identity: UUID=, LABEL= or PARTUUID=
#                              (not /dev/nvmeXnY: NVMe names follow probe order, and passthrough NVMe
#                              are rebound during the boot); passage.rootwait=30s, passage.rootfstype=FS,
#                              passage.init=/sbin/init
#   passage.host_modules=e1000e,igb  host drivers for kept devices, loaded after vfio binding
#   passage.emit=off           console: print /run/passage/* as base64 blocks (the QEMU tests' channel)
#   passage.stage_timeout=60s  deadline of each stage; passage.log=/run/passage/log.jsonl
#   passage.emergency=hold     hold|shell|reboot|poweroff instead of the handoff when the boot fails, after the
#                              manifest; passage.emergency_on=failed (failed|degraded|never): which verdicts
#                              take it (with failed, a node with a failed unit does not switch_root)
#   passage.debug=on           whole stage errors on the console, waits shown every second (off by default)
# Do not set uroot.uinitargs=: u-root's init puts them before the image's "boot".
#
# The sha256 sums above are for the operator's eyes: nothing here verifies them, and
# anything on the path between the server and the node can replace this script, the
# kernel or the initramfs. A node that must run only what its operator signed boots a
# signed unified kernel image under UEFI Secure Boot instead (image/uki.sh, make uki).

set profile b300
set handoff switch_root
set root LABEL=root
# passage_url may come from the DHCP server (option 175 / iPXE settings); none: no publish.
set urlarg
isset \${passage_url} && set urlarg passage.url=\${passage_url} ||
# The node's name, per machine: iPXE's hostname setting (what its DHCP answer carried, or
# what a script chained per MAC sets). None: passage asks DHCP, and says when there is none.
set hostarg
isset \${hostname} && set hostarg passage.hostname=\${hostname} ||

kernel vmlinuz initrd=initramfs.cpio.gz console=ttyS0,115200 intel_iommu=on panic=-1 rdinit=/bbin/passage passage.profile=\${profile} passage.handoff=\${handoff} passage.root=\${root} \${hostarg} \${urlarg}
initrd initramfs.cpio.gz
boot
IPXE
mv "$build/boot.ipxe.tmp" "$build/boot.ipxe"
echo "ipxe: wrote $build/boot.ipxe (serve it with $build/vmlinuz and $build/initramfs.cpio.gz)"
