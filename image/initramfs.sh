#!/usr/bin/env bash
# initramfs.sh IMAGE [SHARED]: builds IMAGE/initramfs.cpio.gz for the kernel unpacked in
# IMAGE/kernel (image/kernel.sh). Two parts, each rebuilt only when its inputs change:
#   SHARED/uroot.cpio   u-root (pinned in go.mod by a tool directive): `passage boot` as
#                       the uinit, gosh as the shell, a few core commands for debugging at
#                       the console. The same for every kernel: built once.
#   the kernel's part   the modules passage boot loads, with their dependency closure
#                       (image/modsel: decompressed, with a modules.dep), under
#                       /lib/modules/<release>/kernel/... as in the .deb, and the names of
#                       the devices the profiles know; added to uroot.cpio by u-root's own
#                       -base merge.
# Nothing is downloaded but Go modules. Reproducible: the same inputs give the same bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: initramfs.sh IMAGE [SHARED]}
shared=${2:-$build}
mkdir -p "$build" "$shared"
build=$(cd "$build" && pwd)
shared=$(cd "$shared" && pwd)
kernel=$build/kernel
[[ -s $kernel/release ]] || { echo "initramfs: no kernel in $kernel (run make kernel)" >&2; exit 1; }
release=$(cat "$kernel/release")
out=$build/initramfs.cpio.gz

# What passage boot loads (vfio stack first, then host drivers for kept devices) plus
# the disk the QEMU tests give it for passage.out= (virtio_blk, ext4 and the crc32c
# that ext4's journal checksums request by alias at mount time: the initramfs has no
# modprobe to answer request_module).
modules=(vfio vfio_iommu_type1 vfio-pci
	nvme virtio_pci virtio_net e1000e e1000
	virtio_blk crc32c_generic ext4)

# The busybox links these u-root commands with passage; keep the set small.
urootcmds=(init gosh ls cat dmesg ip mount umount lsmod pci ps echo mkdir grep readlink
	uptime poweroff)
# goshsmall: gosh reads plain lines, which the kernel's line discipline echoes and edits
# (backspace, ^U, ^W), instead of running its full-screen editor (bubbline on bubbletea
# v0.24.1). The console an operator falls into is a serial line, often serial-over-LAN:
# under QEMU the editor hung for good after an Enter in 4 boots of 5, its renderer
# deadlocked as it quit (standardRenderer.stop sends on its done channel holding the
# mutex its ticker's flush waits for: bubbletea #741, fixed in v0.24.2), and it redraws
# the whole padded line for every key typed.
gotags=(goshsmall)
pkgs=()
for c in "${urootcmds[@]}"; do pkgs+=("github.com/u-root/u-root/cmds/core/$c"); done
pkgs+=(github.com/passage-boot/passage/cmd/passage)

# Inputs: the u-root part is what `passage` is built from (the Go and embedded files of
# the packages it links from this module, as they are in the tree, and go.mod and go.sum
# for the rest), the Go toolchain and the commands; the
# kernel's part adds the kernel package, the module list, the tools that select them
# (image/) and the names database.
# sources PKG...: sha256 of every Go and embedded file of this module's packages that
# PKG links.
sources() {
	go list -deps -f '{{if .Module}}{{if eq .Module.Path "github.com/passage-boot/passage"}}{{range .GoFiles}}{{$.Dir}}/{{.}}{{"\n"}}{{end}}{{range .EmbedFiles}}{{$.Dir}}/{{.}}{{"\n"}}{{end}}{{end}}{{end}}' "$@" |
		LC_ALL=C sort | xargs -r sha256sum
}
# The build passage reports (buildinfo), stamped from git: it is an input, so a new
# commit rebuilds the u-root part, as it changes a go-built binary.
# u-root's gobusybox builds in GOPATH mode, where the Go toolchain assumes go 1.20's
# GODEBUG defaults (panicnil=1, tlsrsakex=1, tls3des=1, x509negativeserial=1, ...); the
# runtime takes its defaults from runtime.godebugDefault, which a later -X replaces, so
# the image runs with the defaults `go build ./cmd/passage` gives passage (its go.mod's).
godebug=$(go list -f '{{.DefaultGODEBUG}}' ./cmd/passage)
ldflags="-s -w -buildid= -X=runtime.godebugDefault=$godebug $(bash image/buildstamp.sh)"
core_stamp=$({
	echo "$ldflags"
	sources ./cmd/passage
	sha256sum go.mod go.sum
	go version
	echo "${urootcmds[*]} tags ${gotags[*]}"
} | sha256sum | cut -d' ' -f1)
stamp=$({
	echo "$core_stamp"
	sources ./image/modsel ./image/pciids
	find image -maxdepth 1 -type f | LC_ALL=C sort | xargs -r sha256sum
	sha256sum /usr/share/misc/pci.ids 2>/dev/null || true
	echo "$release $(cat "$kernel/package" 2>/dev/null) ${modules[*]}"
} | sha256sum | cut -d' ' -f1)
if [[ -s $out && -f $out.stamp && $(cat "$out.stamp") == "$stamp" ]]; then
	echo "initramfs: $out up to date ($(stat -c %s "$out") bytes)"
	exit 0
fi

start=$(date +%s.%N)
core=$shared/uroot.cpio
export CGO_ENABLED=0 GOOS=linux GOARCH=amd64
# u-root v0.16 warns that it was tested up to Go 1.22; it builds fine with this Go.
quiet() { grep -v -e 'recommended Go versions' -e 'Some packages may not compile' \
	-e 'golang.org/doc/install' -e 'golang.org/dl/go1' || true; }
if [[ ! -s $core || ! -f $core.stamp || $(cat "$core.stamp") != "$core_stamp" ]]; then
	# -uinitcmd="passage boot" links /bin/uinit to passage and writes "boot" to
	# /etc/uinit.flags; u-root's init puts uroot.uinitargs= from the kernel command line
	# *before* those flags, so passage's configuration comes only from passage.* arguments.
	# A second -ldflags replaces u-root's own, so $ldflags repeats its "-s -w -buildid=".
	go tool u-root -o "$core.tmp" -uinitcmd="passage boot" -defaultsh=gosh -go-build-tags="$(IFS=,; echo "${gotags[*]}")" -go-extra-args="-ldflags=$ldflags" "${pkgs[@]}" 2>&1 | quiet
	mv "$core.tmp" "$core"
	echo "$core_stamp" >"$core.stamp"
	printf 'initramfs: u-root part %s built in %.1f s\n' "$core" "$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')"
fi

stage=$build/initramfs-stage
rm -rf "$stage"
mkdir -p "$stage"
go run ./image/modsel -kernel "$kernel" -out "$stage" "${modules[@]}" >"$build/initramfs-modules.txt"
tail -n1 "$build/initramfs-modules.txt" | sed 's/^/initramfs: /'
# Names for the devices the profiles know (not the whole database) at the path lspci and
# passage read; without the build machine's pci.ids the node shows IDs only.
files=(-files "$stage/lib:lib")
if [[ -f /usr/share/misc/pci.ids ]]; then
	go run ./image/pciids -out "$stage/usr/share/misc/pci.ids" | sed 's/^/initramfs: pci.ids subset: /'
	files+=(-files "$stage/usr:usr")
fi

# The kernel's part goes into a copy of the u-root part: -nocmd builds nothing, and
# the empty -initcmd/-uinitcmd/-defaultsh keep the base's own links.
go tool u-root -nocmd -base "$core" -initcmd= -uinitcmd= -defaultsh= -o "$build/initramfs.cpio.tmp" \
	"${files[@]}" 2>&1 | quiet | { grep -v 'Successfully built' || true; }
gzip -9 -n -c "$build/initramfs.cpio.tmp" >"$out.tmp"
mv "$build/initramfs.cpio.tmp" "$build/initramfs.cpio"
mv "$out.tmp" "$out"
echo "$stamp" >"$out.stamp"
end=$(date +%s.%N)
printf 'initramfs: %s: %d bytes (%.2f MiB) gzip -9, %d bytes uncompressed, built in %.1f s\n' \
	"$out" "$(stat -c %s "$out")" "$(awk -v s="$(stat -c %s "$out")" 'BEGIN{print s/1048576}')" \
	"$(stat -c %s "$build/initramfs.cpio")" "$(awk -v a="$start" -v b="$end" 'BEGIN{print b-a}')"
limit=$((16 << 20))
if (($(stat -c %s "$out") >= limit)); then
	echo "initramfs: $out is over the 16 MiB budget" >&2
	exit 1
fi
