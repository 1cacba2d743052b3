#!/usr/bin/env bash
# bench/verify-many.sh [N]: a fleet's manifests verified by one `passage verify` process
# (a directory, in parallel, each node's key from a key directory) against N runs of
# single-file `passage verify`, one per manifest with its node's key, as a script looping
# over a fleet would. Prints a Markdown table. N defaults to 1000.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-1000}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
go build -o "$tmp/passage" ./cmd/passage
go run ./bench/cmd/fleetgen -dir "$tmp/fleet" -n "$n" -keys "$n" >/dev/null
m=$tmp/fleet/manifests k=$tmp/fleet/keys

now() { date +%s.%N; }
t0=$(now)
"$tmp/passage" verify --pub "$k" "$m" >"$tmp/many.out"
t1=$(now)
for ((i = 0; i < n; i++)); do
	id=$(printf %04d "$i")
	"$tmp/passage" verify --pub "$k/node-key-$id.pub" "$m/node-$id.dsse.json" >/dev/null
done
t2=$(now)

ok=$(grep -c '^OK ' "$tmp/many.out")
[[ $ok == "$n" ]] || { echo "verify-many: $ok of $n verified in one process" >&2; exit 1; }
awk -v n="$n" -v a="$t0" -v b="$t1" -v c="$t2" -v cpus="$(nproc)" 'BEGIN {
	one = b - a; runs = c - b
	printf "| %d signed B300 manifests (%d CPUs) | wall time | per manifest |\n", n, cpus
	print  "|---|---:|---:|"
	printf "| `passage verify --pub KEYDIR DIR` (one process, parallel) | %.3f s | %.3f ms |\n", one, one * 1000 / n
	printf "| %d x `passage verify --pub KEY FILE` | %.3f s | %.3f ms |\n", n, runs, runs * 1000 / n
	printf "| ratio | %.1fx | |\n", runs / one
}'
