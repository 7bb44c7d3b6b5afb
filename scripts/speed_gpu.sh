#!/usr/bin/env bash
# Issue 14's GPU run: the "before" and "after" trees side by side in ONE run (same machine, same-run ratios).
# Usage on the GPU machine, from the repo root, with .whl/ and the two trees carried:
#   bash AFTER/scripts/speed_gpu.sh BEFORE_DIR AFTER_DIR
# Builds both extensions (in parallel), profiles
# one awaited 1-block copy() in both trees (scripts/percall_probe.py), runs `tiered-kv bench --only engine
# kernels` in BEFORE and `... engine kernels overlap --compare before.json` in AFTER; the gpu tests run last with
# the time left. Everything under $OUT.
set -uo pipefail
BEFORE=$(cd "$1" && pwd); AFTER=$(cd "$2" && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export TIERED_KV_EXT_DIR=/tmp/tiered_kv_ext
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/build.txt"
for tree in BEFORE AFTER; do
  dir=${!tree}
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir python3 -m tiered_kv build-ext > "/tmp/build-$tree.txt" 2>&1; echo "rc=$?" >> "/tmp/build-$tree.txt") &
done
wait; stamp "built"; tail -n 2 /tmp/build-*.txt | tee -a "$OUT/build.txt"
cp "$AFTER/scripts/percall_probe.py" /tmp/percall_probe.py
for tree in BEFORE AFTER; do
  dir=${!tree}
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 60 python3 /tmp/percall_probe.py --device cuda --out "/tmp/probe-$tree" \
    > "/tmp/probe-$tree.log" 2>&1; cp "/tmp/probe-$tree/percall-cuda.json" "$OUT/percall-$tree.json" || tail -5 "/tmp/probe-$tree.log")
  stamp "probe $tree rc=$?"
done
(cd "$BEFORE" && PYTHONPATH=/tmp/site:$BEFORE timeout ${BENCH_BUDGET:-140} python3 -m tiered_kv bench --only engine kernels \
  --json "$OUT/bench-before.json" > "$OUT/bench-before.txt" 2>&1)
stamp "bench before rc=$?"
(cd "$AFTER" && PYTHONPATH=/tmp/site:$AFTER timeout ${BENCH_BUDGET:-140} python3 -m tiered_kv bench --only engine kernels overlap \
  --json "$OUT/bench-after.json" --compare "$OUT/bench-before.json" > "$OUT/bench-after.txt" 2>&1)
stamp "bench after rc=$?"
tail -n 45 "$OUT/bench-after.txt"
# the gpu tests of this work, with the time that is left (the whole command must end within ${TOTAL:-575} s)
left=$(( ${TOTAL:-575} - ($(date +%s) - T0) ))
cd "$AFTER" && PYTHONPATH=/tmp/site:$AFTER timeout $(( left > 20 ? left : 20 )) python3 -X faulthandler -m pytest -m gpu -v -p no:cacheprovider \
  tests/test_percall.py tests/test_layerwise.py tests/test_ops.py tests/test_ordering.py tests/test_engine_api.py \
  tests/test_layer_major.py > "$OUT/pytest-gpu-after.log" 2>&1
stamp "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR" "$OUT/pytest-gpu-after.log" | tail -n 5; grep -B2 -A25 "Fatal Python" "$OUT/pytest-gpu-after.log" | head -60
# the device tool returns at most 8 files: $OUT holds build.txt, percall-{BEFORE,AFTER}.json, bench-{before,after}.json,
# bench-{before,after}.txt and pytest-gpu-after.log
