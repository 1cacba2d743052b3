#!/usr/bin/env bash
# debs.sh DIR PKG[+]... : the Debian packages of an image's base, from this machine's apt
# sources (Debian's archive), in DIR; prints their paths, one a line, sorted by name.
# PKG+ takes PKG and, recursively, what it Depends or Pre-Depends on; PKG alone, only it.
# Each package is its candidate version. A .deb already in DIR under its pool name
# (name_version_arch.deb) whose SHA256 is the one the archive's Packages index lists is
# used again, with no download: the same archive state gives the same files, so the
# same image digests. A package with an alternative or virtual dependency is refused
# (its provider must be named). apt-cache reads every package list on each call (a
# second or more): it is called twice.
set -euo pipefail
dir=$1
shift
mkdir -p "$dir"
want=() closure=()
for p in "$@"; do
	if [[ $p == *+ ]]; then closure+=("${p%+}"); else want+=("$p"); fi
done
# The candidates of the packages named: "name version pool-file sha256", one a line.
candidates() {
	apt-cache show --no-all-versions "$@" 2>/dev/null | awk '
		/^Package: /  { p = $2 } /^Version: / { v = $2 } /^Filename: / { f = $2 } /^SHA256: / { s = $2 }
		/^$/ { if (p != "") print p, v, f, s; p = v = f = s = "" }
		END  { if (p != "") print p, v, f, s }'
}
if ((${#closure[@]})); then
	deps() { apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances "${closure[@]}" 2>/dev/null; }
	# Debian's package lists are not there on a fresh machine (deps.sh updates them only
	# when it installs something).
	if ! d=$(deps) || [[ -z $d ]]; then
		[[ $(id -u) == 0 ]] || { echo "debs: apt knows no ${closure[*]}; run apt-get update as root" >&2; exit 1; }
		apt-get update -qq
		d=$(deps)
	fi
	if grep -q -e '^<' -e '|' <<<"$d"; then
		echo "debs: a virtual package or an alternative among the dependencies of ${closure[*]}; name its provider:" >&2
		grep -e '^<' -e '|' <<<"$d" >&2
		exit 1
	fi
	mapfile -t -O "${#want[@]}" want < <(grep -v '^ ' <<<"$d")
fi
mapfile -t want < <(printf '%s\n' "${want[@]}" | sort -u)
c=$(candidates "${want[@]}")
if [[ $(grep -c . <<<"$c") != "${#want[@]}" && $(id -u) == 0 ]]; then
	apt-get update -qq
	c=$(candidates "${want[@]}")
fi
out=()
for p in "${want[@]}"; do
	read -r _ version file sum < <(awk -v p="$p" '$1 == p' <<<"$c") || true
	if [[ -z ${sum:-} ]]; then
		echo "debs: apt has no candidate for $p (apt-get update?)" >&2
		exit 1
	fi
	deb=$dir/$(basename "$file")
	if [[ ! -e $deb ]] || ! sha256sum --status -c <<<"$sum  $deb"; then
		# apt-get download writes to the working directory (as root, unsandboxed: the
		# _apt user cannot write a root-owned build directory), naming an epoch's colon
		# %3a where the pool's name has none: a directory of its own, then the pool's name.
		tmp=$(mktemp -d "$dir/.download.XXXXXX")
		(cd "$tmp" && apt-get download -qq "$p=$version" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true)
		got=("$tmp"/*.deb)
		if [[ ${#got[@]} != 1 || ! -e ${got[0]} ]] || ! sha256sum --status -c <<<"$sum  ${got[0]}"; then
			rm -rf "$tmp"
			echo "debs: apt-get download $p=$version: no .deb with the archive's sha256 $sum" >&2
			exit 1
		fi
		mv "${got[0]}" "$deb"
		rm -rf "$tmp"
	fi
	out+=("$deb")
	unset version file sum
done
printf '%s\n' "${out[@]}"
