#!/usr/bin/env bash
# Run every command of compare_outputs.txt (hybrid's CLI, one per line) on two trees and say which
# outputs differ: stdout byte for byte, stderr with tracing times masked. Used to hold a refactor to
# byte-identical plans (issue 32):  benchmarks/compare_outputs.sh OLD_TREE NEW_TREE
set -u
old=$1 new=$2 here=$(cd "$(dirname "$0")" && pwd) out=$(mktemp -d)
py=${PYTHON:-$here/../.venv/bin/python}
for tree in "$old" "$new"; do
  mkdir -p "$out/$(basename "$tree")"; i=0
  while IFS= read -r line; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    (cd /tmp && PYTHONPATH=$tree timeout 600 "$py" -m hybrid.cli $line >"$out/$(basename "$tree")/$i.out" \
      2>"$out/$(basename "$tree")/$i.err"; echo "rc=$?" >>"$out/$(basename "$tree")/$i.err")
  done <"$here/compare_outputs.txt"
done
a=$out/$(basename "$old") b=$out/$(basename "$new") n=0
for f in "$a"/*.out; do
  k=$(basename "$f" .out)
  cmp -s "$f" "$b/$k.out" || { echo "stdout differs: $(sed -n "${k}p" "$here/compare_outputs.txt")"; n=$((n + 1)); }
  diff -q <(sed 's/[0-9.]*s (/Xs (/' "$a/$k.err") <(sed 's/[0-9.]*s (/Xs (/' "$b/$k.err") >/dev/null ||
    { echo "stderr differs: $(sed -n "${k}p" "$here/compare_outputs.txt")"; n=$((n + 1)); }
done
echo "$(wc -l <"$here/compare_outputs.txt") commands, $n differences (outputs in $out)"
