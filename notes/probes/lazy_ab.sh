#!/usr/bin/env bash
# Session 2026-11-25c: recorded fence entries (this build) against the previous commit, alternating processes on one
# GPU: the bench's partial section (partial_ab_probe.py) and the cold probe's split. The builds differ only in Python
# files, so the old one is the installed package with those files replaced, and both use the installed extension.
# Needs `bash .ci/gpu-run install` first and, in directory $1, the previous commit's versions of the changed files
# (`git show OLD:tiered_kv/fences.py > DIR/fences.py`, ...). Usage: bash notes/probes/lazy_ab.sh DIR [ROUNDS]
set -uo pipefail
OLD=$1; ROUNDS=${2:-4}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
if [ ! -f /tmp/site-old/.ready ]; then
  rm -rf /tmp/site-old && mkdir -p /tmp/site-old && cp -r /tmp/site/tiered_kv /tmp/site-old/
  cp "$OLD"/*.py /tmp/site-old/tiered_kv/ && find /tmp/site-old -name __pycache__ -prune -exec rm -rf {} +
  touch /tmp/site-old/.ready
fi
for i in $(seq "$ROUNDS"); do
  for build in new old; do
    if [ $build = new ]; then site=/tmp/site; else site=/tmp/site-old:/tmp/site; fi
    (cd /tmp && PYTHONPATH=$site TIERED_KV_EXT_DIR=/tmp/tiered_kv_ext timeout 150 python3 "$here/partial_ab_probe.py") \
      2>> "$OUT/ab-err.log" | sed "s/^{/{\"build\": \"$build\", \"round\": $i, /" >> "$OUT/partial-ab.jsonl"
  done
done
for build in new old; do
  if [ $build = new ]; then site=/tmp/site; else site=/tmp/site-old:/tmp/site; fi
  (cd /tmp && PYTHONPATH=$site TIERED_KV_EXT_DIR=/tmp/tiered_kv_ext timeout 200 python3 -m tiered_kv.tools.bench.cold_probe \
     --calls 100 --json "$OUT/cold-$build.json") > "$OUT/cold-$build.txt" 2>&1
done
python3 "$here/ab_summary.py" "$OUT/partial-ab.jsonl"
