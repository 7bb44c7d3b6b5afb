# ruff: noqa: B023 -- every lambda below runs before its loop variables change
"""Session p probe: the copy kernel's device time on partial copies per work-item size (TIERED_KV_COPY_ITEM_BYTES).

The op alone (``ops.copy_blocks``, the engine's geometry: 2 MiB blocks of 32 layers x 2 x 8 heads x 16 tokens x 128
bf16), 128 pairs, as a fraction of one contiguous copy of the same bytes (device time from CUDA events behind a
sleep kernel). GPU->GPU consecutive and scattered blocks, host->GPU consecutive. One child process per item size
(the kernel reads the variable once).

Run on a CUDA machine from notes/probes/: ``python item_probe.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SIZES = (0, 2048, 4096, 8192, 16384)  # 0: the build's default


def child() -> dict[str, float]:
    """Fractions of the op alone against a contiguous copy (this process's item size)."""
    import numpy as np
    import torch

    from tiered_kv import _ext, ops
    from tiered_kv.layout import KVLayout
    from tiered_kv.tools.bench.kperf_probe import dev_seconds

    assert _ext.load()
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    gpu = torch.empty((512, *layout.block_shape), dtype=layout.dtype, device="cuda")
    host = torch.empty((128, *layout.block_shape), dtype=layout.dtype, pin_memory=True)
    a_i, b_i = torch.arange(128), torch.arange(128, 256)
    rng = np.random.default_rng(0)
    sc_a = torch.from_numpy(rng.permutation(256)[:128].copy())
    sc_b = torch.from_numpy(256 + rng.permutation(256)[:128].copy())
    out: dict[str, float] = {}
    for n in (4, 8, 12, 16):
        nbytes = 128 * layout.partial_bytes(n)
        flat = gpu.view(-1).view(torch.uint8)
        fa, fb, fh = flat[:nbytes], flat[nbytes : 2 * nbytes], host.view(-1).view(torch.uint8)[:nbytes]
        d2d = dev_seconds(lambda: fb.copy_(fa, non_blocking=True), 15)
        h2d = dev_seconds(lambda: fa.copy_(fh, non_blocking=True), 15)
        tok = None if n == 16 else n
        k = ops.METHOD_KERNEL
        out[f"d2d{n}"] = d2d / dev_seconds(
            lambda: ops.copy_blocks([gpu], [gpu], a_i, b_i, num_tokens=tok, method=k), 15
        )
        out[f"d2d{n}_scattered"] = d2d / dev_seconds(
            lambda: ops.copy_blocks([gpu], [gpu], sc_a, sc_b, num_tokens=tok, method=k), 15
        )
        out[f"h2d{n}"] = h2d / dev_seconds(
            lambda: ops.copy_blocks([gpu], [host], a_i, a_i, num_tokens=tok, method=k), 15
        )
    return out


def main() -> None:
    """One child per item size; a table."""
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        print(json.dumps(child()))
        return
    rows = {}
    for size in SIZES:
        env = dict(os.environ)
        if size:
            env["TIERED_KV_COPY_ITEM_BYTES"] = str(size)
        res = subprocess.run([sys.executable, __file__, "child"], env=env, capture_output=True, text=True, check=False)
        line = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else "{}"
        rows[size] = json.loads(line) if line.startswith("{") else {"error": res.stderr[-500:]}
    keys = sorted({k for r in rows.values() for k in r if k != "error"})
    print("item bytes  " + " ".join(f"{k:>14s}" for k in keys))
    for size, r in rows.items():
        print(f"{size or 'default':>10}  " + " ".join(f"{r.get(k, float('nan')):14.3f}" for k in keys))
        if "error" in r:
            print(r["error"])


if __name__ == "__main__":
    main()
