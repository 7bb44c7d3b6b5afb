"""Session p probe: the bench's partial rows alone (``kernels._partial``), per copy-kernel work-item size.

One child process per ``TIERED_KV_COPY_ITEM_BYTES`` value (the kernel reads it once; empty: the build's default);
prints each row's fraction, op device fraction and floors. Run on a CUDA machine from notes/probes/:
``python partial_rows_probe.py [item bytes ...]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys


def child() -> None:
    """The partial rows in this process, as JSON lines."""
    from tiered_kv.tools.bench.kernels import _partial

    for row in asyncio.run(_partial("cuda", 256, 10)):
        keep = ("tokens", "direction", "fraction", "op_dev_fraction", "floor_us", "loop_floor_us", "vs_bound")
        print(json.dumps({k: row.get(k) for k in keep}))


def main() -> None:
    """One child per item size given (default: the build's default and 16 KiB)."""
    if sys.argv[1:2] == ["child"]:
        child()
        return
    for size in sys.argv[1:] or ["", "16384"]:
        env = dict(os.environ)
        if size:
            env["TIERED_KV_COPY_ITEM_BYTES"] = size
        out = subprocess.run([sys.executable, __file__, "child"], env=env, capture_output=True, text=True, check=False)
        print(f"# item bytes: {size or 'default'}")
        print(out.stdout.strip() or out.stderr[-800:], flush=True)


if __name__ == "__main__":
    main()
