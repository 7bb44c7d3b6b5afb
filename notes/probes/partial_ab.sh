#!/usr/bin/env bash
# Session s: the bench's partial rows, this build against the previous one, alternating processes on one GPU.
# Needs the installed build (bash .ci/gpu-run install) and the previous build's tree in $1 (git archive of it);
# writes $OUT/partial-ab.jsonl. Usage: bash notes/probes/partial_ab.sh OLD_TREE [ROUNDS] (a directory, or a .tar.xz of one)
set -uo pipefail
OLD=$1; ROUNDS=${2:-4}
if [ -f "$OLD" ]; then mkdir -p /tmp/ab-old-tree && tar -xJf "$OLD" -C /tmp/ab-old-tree && OLD=/tmp/ab-old-tree; fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
if [ ! -f /tmp/site-old/.ready ]; then
  rm -rf /tmp/site-old
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site-old "$OLD" > "$OUT/ab-install.log" 2>&1 \
    || { tail -5 "$OUT/ab-install.log"; exit 1; }
  (cd /tmp && PYTHONPATH=/tmp/site-old:/tmp/site TIERED_KV_EXT_DIR=/tmp/tiered_kv_ext_old python3 -m tiered_kv build-ext) \
    > "$OUT/ab-build.log" 2>&1 || { tail -5 "$OUT/ab-build.log"; exit 1; }
  touch /tmp/site-old/.ready
fi
for i in $(seq "$ROUNDS"); do
  for build in new old; do
    if [ $build = new ]; then site=/tmp/site; ext=/tmp/tiered_kv_ext; else site=/tmp/site-old:/tmp/site; ext=/tmp/tiered_kv_ext_old; fi
    (cd /tmp && PYTHONPATH=$site TIERED_KV_EXT_DIR=$ext timeout 120 python3 "$here/partial_ab_probe.py") 2>> "$OUT/ab-err.log" \
      | sed "s/^{/{\"build\": \"$build\", \"round\": $i, /" >> "$OUT/partial-ab.jsonl"
  done
done
python3 "$here/ab_summary.py" "$OUT/partial-ab.jsonl"
