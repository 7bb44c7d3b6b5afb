#!/usr/bin/env bash
# Session 2026-11-25c: recorded fence entries (this build) against the previous commit, alternating processes on one
# GPU: the bench's partial section (partial_ab_probe.py) and the cold probe's split. The kernels are the same in both
# builds, so both use the installed extension. Needs `bash .ci/gpu-run install` first and the previous build's tree
# as a .tar.xz of `git archive` in $1. Usage: bash notes/probes/lazy_ab.sh OLD.tar.xz [ROUNDS]
set -uo pipefail
OLD=$1; ROUNDS=${2:-4}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
if [ ! -f /tmp/site-old/.ready ]; then
  rm -rf /tmp/ab-old-tree /tmp/site-old && mkdir -p /tmp/ab-old-tree && tar -xJf "$OLD" -C /tmp/ab-old-tree
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site-old /tmp/ab-old-tree \
    > "$OUT/ab-install.log" 2>&1 || { tail -5 "$OUT/ab-install.log"; exit 1; }
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
python3 - "$OUT/partial-ab.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
keys = sorted({k for r in runs for k in r["rows"]})
print(f"{'row':<16} {'new fraction (runs)':<36} {'old fraction (runs)':<36} new/old median")
for k in keys:
    got = {b: [r["rows"][k]["fraction"] for r in runs if r["build"] == b and k in r["rows"]] for b in ("new", "old")}
    med = {b: statistics.median(v) if v else float("nan") for b, v in got.items()}
    print(f"{k:<16} {str(got['new']):<36} {str(got['old']):<36} {med['new']:.3f} / {med['old']:.3f}")
PY
