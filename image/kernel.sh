#!/usr/bin/env bash
# kernel.sh DEST [CHOICE]: unpacks (never installs) one of Debian's signed kernel packages
# into DEST, so the initramfs build and the QEMU tests run on the kernel a node would
# boot. CHOICE is a kernel line or a package name:
#   6.12 (default)  the current line of Debian 13 (trixie): programs pci=config_acs= itself
#   6.1             Debian 12 (bookworm), the line the project started on
#   linux-image-…   that exact package, looked up in trixie, bookworm-backports, bookworm
# The package lists come from a sources list of the project's own (build/apt/<suite>),
# on the mirror the host's own apt uses; apt is only asked to download, never to install,
# and the host's package state is not touched.
# Writes DEST/vmlinuz, DEST/lib/modules/<kver>/... (trixie's package keeps modules under
# usr/lib/modules: they are moved to lib/modules, where the image and the node look),
# DEST/release and DEST/package. Idempotent: a DEST with all of them for the same choice
# is left as it is.
set -euo pipefail
dest=${1:?usage: kernel.sh DEST [6.12|6.1|linux-image-PACKAGE]}
choice=${2:-6.12}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)

if [[ -s $dest/vmlinuz && -s $dest/release && -s $dest/choice && $(cat "$dest/choice") == "$choice" &&
	-d $dest/lib/modules/$(cat "$dest/release")/kernel ]]; then
	echo "kernel: $(cat "$dest/release") already in $dest"
	exit 0
fi

case $choice in
6.12) suites=(trixie) line=6.12 ;;
6.1) suites=(bookworm) line=6.1 ;;
linux-image-*) suites=(trixie bookworm-backports bookworm) line= ;;
*)
	echo "kernel: choice $choice: want 6.12, 6.1 or a linux-image-<version>-amd64 package name" >&2
	exit 2
	;;
esac

# mirror is the Debian archive the host's apt already uses (KERNEL_MIRROR overrides it).
mirror() {
	if [[ -n ${KERNEL_MIRROR:-} ]]; then
		echo "$KERNEL_MIRROR"
		return
	fi
	{
		grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{for (i = 2; i <= NF; i++) print $i}'
		grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list |
			awk '{for (i = 2; i <= NF; i++) if ($i !~ /^\[/) {print $i; break}}'
	} | grep -E '/debian/?$' | head -n1
}
base=$(mirror || true)
[[ -n $base ]] || { echo "kernel: no Debian archive in the host's apt sources (set KERNEL_MIRROR=)" >&2; exit 1; }

cachedir=${KERNEL_CACHE:-$dest/..}
mkdir -p "$cachedir"
cachedir=$(cd "$cachedir" && pwd) # apt takes relative paths as relative to its own dirs
aptdir=$cachedir/apt
# apt_suite SUITE ARGS...: apt-get or apt-cache against SUITE's own lists only.
apt_suite() {
	local suite=$1 tool=$2
	shift 2
	local d=$aptdir/$suite
	mkdir -p "$d/lists/partial" "$d/cache/archives/partial"
	[[ -s $d/sources.list ]] || echo "deb $base $suite main" >"$d/sources.list"
	"$tool" -q -o Dir::Etc::sourcelist="$d/sources.list" -o Dir::Etc::sourceparts=/dev/null \
		-o Dir::State::lists="$d/lists" -o Dir::Cache="$d/cache" -o Dir::State::status=/dev/null "$@"
}
lists() { # the suite's lists, fetched once (make clean refetches)
	local suite=$1
	if ! compgen -G "$aptdir/$suite/lists/*_Packages*" >/dev/null; then
		echo "kernel: fetching the $suite package lists"
		apt_suite "$suite" apt-get update >/dev/null
	fi
}

pkg= suite=
for s in "${suites[@]}"; do
	lists "$s"
	if [[ -n $line ]]; then
		p=$(apt_suite "$s" apt-cache depends linux-image-amd64 2>/dev/null |
			awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
		[[ $p == linux-image-$line.* ]] || {
			echo "kernel: $s's linux-image-amd64 depends on ${p:-nothing}, not a $line kernel" >&2
			exit 1
		}
	else
		p=$choice
		apt_suite "$s" apt-cache show "$p" >/dev/null 2>&1 || continue
	fi
	pkg=$p suite=$s
	break
done
[[ -n $pkg ]] || { echo "kernel: $choice is in none of ${suites[*]}" >&2; exit 1; }
kver=${pkg#linux-image-}

start=$(date +%s.%N)
cache=$cachedir/kernel-deb
mkdir -p "$cache"
deb=$(ls "$cache"/"${pkg}"_*.deb 2>/dev/null | head -n1 || true)
if [[ -z $deb ]]; then
	echo "kernel: downloading $pkg from $suite"
	# apt-get download writes into the current directory; as root it warns about the
	# _apt sandbox user being unable to write there, which is harmless.
	(cd "$cache" && apt_suite "$suite" apt-get download "$pkg" 2>&1 | grep -v -e '^W: Download is performed unsandboxed' || true)
	deb=$(ls "$cache"/"${pkg}"_*.deb 2>/dev/null | head -n1 || true)
	[[ -n $deb ]] || { echo "kernel: apt-get download $pkg produced no .deb in $cache" >&2; exit 1; }
fi

tmp=$(mktemp -d "$dest/.unpack.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
dpkg-deb -x "$deb" "$tmp"
vmlinuz=$(ls "$tmp"/boot/vmlinuz-* 2>/dev/null | head -n1 || true)
[[ -n $vmlinuz ]] || { echo "kernel: $deb has no boot/vmlinuz-*" >&2; exit 1; }
if [[ ! -d $tmp/lib/modules/$kver/kernel && -d $tmp/usr/lib/modules/$kver/kernel ]]; then
	mkdir -p "$tmp/lib/modules"
	mv "$tmp/usr/lib/modules/$kver" "$tmp/lib/modules/$kver"
fi
[[ -d $tmp/lib/modules/$kver/kernel ]] || { echo "kernel: $deb has no lib/modules/$kver/kernel (nor under usr/)" >&2; exit 1; }

rm -rf "$dest/boot" "$dest/lib" "$dest/usr" "$dest/etc"
mkdir -p "$dest/boot" "$dest/lib"
mv "$vmlinuz" "$dest/boot/"
mv "$tmp/lib/modules" "$dest/lib/modules"
cp "$dest/boot/$(basename "$vmlinuz")" "$dest/vmlinuz"
echo "$pkg $(dpkg-deb -f "$deb" Version) $suite" >"$dest/package"
echo "$kver" >"$dest/release.tmp" && mv "$dest/release.tmp" "$dest/release"
echo "$choice" >"$dest/choice"
end=$(date +%s.%N)
printf 'kernel: %s (%s) unpacked into %s in %.1f s\n' "$kver" "$suite" "$dest" "$(awk -v a="$start" -v b="$end" 'BEGIN{print b-a}')"
