#!/usr/bin/env bash
# The shell way to plan (and, with --apply, apply) ACS for HGX GPU units: what an operator
# would script with pciutils before passage. It is the baseline `make bench` measures
# passage against, and bench's tests hold its output equal to passage's plan, so keep it
# correct rather than fast.
#
# usage: acs-plan.sh ROOT [--apply]
#   ROOT is a sysfs root ("/" on a node, or a synthetic tree); every lspci/setpci call
#   reads ROOT/sys/bus/pci through pciutils' linux-sysfs backend.
# Prints one line per planned port: "<bdf> <position> <current ctl> <target ctl>".
set -euo pipefail
root=${1:?usage: acs-plan.sh ROOT [--apply]}
apply=${2:-}
sysfs="$root/sys/bus/pci"
pciopt=(-A linux-sysfs -O "sysfs.path=$sysfs")

declare -A ids ptype
while read -r bdf _class id _rest; do
	ids[$bdf]=$id
done < <(lspci "${pciopt[@]}" -D -n)

# Port types from lspci -vvv: "Express (v2) Root Port" / "Downstream Port".
cur=""
while IFS= read -r line; do
	if [[ $line =~ ^([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]) ]]; then
		cur=${BASH_REMATCH[1]}
	elif [[ $line =~ Express\ \(v[0-9]\)\ (Root\ Port|Downstream\ Port) ]]; then
		ptype[$cur]=${BASH_REMATCH[1]}
	fi
done < <(lspci "${pciopt[@]}" -D -vvv 2>/dev/null)

# ancestors BDF: the bridges above a function, nearest first, from its sysfs path.
ancestors() {
	local p
	p=$(readlink -f "$sysfs/devices/$1")
	p=${p%/*}
	while [[ ${p##*/} =~ ^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$ ]]; do
		echo "${p##*/}"
		p=${p%/*}
	done
}

# Passthrough functions: GPUs, ConnectX-8 PFs below a CX-8 switch port, NVMe below a
# Broadcom switch; their downstream-facing ancestors are the ports to plan.
declare -A nicport planned
order=()
for bdf in $(printf '%s\n' "${!ids[@]}" | sort); do
	case ${ids[$bdf]} in
	10de:3182 | 10de:2901 | 144d:a80a) ;;
	15b3:1023 | 15b3:1021)
		# Not "ancestors | head -n1": head exits early, ancestors gets SIGPIPE, and
		# pipefail ends the script.
		up=($(ancestors "$bdf"))
		nicport[${up[0]}]=1
		;;
	*) continue ;;
	esac
	for a in $(ancestors "$bdf"); do
		[[ -n ${ptype[$a]:-} && -z ${planned[$a]:-} ]] || continue
		planned[$a]=1
		order+=("$a")
	done
done

for port in $(printf '%s\n' "${order[@]}" | sort); do
	cap=$((16#$(setpci "${pciopt[@]}" -s "$port" ECAP_ACS+4.w)))
	ctl=$((16#$(setpci "${pciopt[@]}" -s "$port" ECAP_ACS+6.w)))
	mask=$((0x5d & cap)) # SV RR CR UF DT
	if [[ -n ${nicport[$port]:-} ]]; then
		flags=$((0x5d & cap)) pos=nic-port
	else
		flags=$((0x1d & cap)) pos=other
	fi
	target=$(((ctl & ~mask) | flags))
	printf '%s %s 0x%04x 0x%04x\n' "$port" "$pos" "$ctl" "$target"
	if [[ $apply == --apply && $target != "$ctl" ]]; then
		setpci "${pciopt[@]}" -s "$port" ECAP_ACS+6.w="$(printf '%04x' "$target")"
		got=$((16#$(setpci "${pciopt[@]}" -s "$port" ECAP_ACS+6.w)))
		((got == target)) || { echo "$port: read back 0x$(printf %04x $got)" >&2; exit 1; }
	fi
done

if [[ $apply == --apply ]]; then
	for bdf in $(printf '%s\n' "${!ids[@]}" | sort); do
		case ${ids[$bdf]} in 10de:3182 | 10de:2901 | 144d:a80a | 15b3:1023 | 15b3:1021) ;; *) continue ;; esac
		echo vfio-pci >"$sysfs/devices/$bdf/driver_override"
		if [[ -e $sysfs/devices/$bdf/driver ]]; then
			echo "$bdf" >"$sysfs/devices/$bdf/driver/unbind"
		fi
		echo "$bdf" >"$sysfs/drivers_probe"
	done
fi
