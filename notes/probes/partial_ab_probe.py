"""Session s probe: the bench's partial rows (``tiered_kv.tools.bench.kernels._partial``) in one process, as JSON.

Run by ``partial_ab.sh``, which alternates processes of two builds (the installed one and the previous commit's)
on one GPU, so that the rows of both builds come from the same host and card, turn by turn. Prints one JSON line:
the package's path and, per row (tokens, direction), the fraction of a contiguous copy, the awaited one-token
floor and the op's device fraction.
"""

from __future__ import annotations

import asyncio
import json

import tiered_kv
from tiered_kv.tools.bench.kernels import _partial


def main() -> None:
    """One run of the bench's partial section on CUDA (256-block pools, 20 turns)."""
    rows = asyncio.run(_partial("cuda", 256, 10))
    out = {
        "package": tiered_kv.__file__,
        "rows": {
            f"{r['tokens']} {r['direction']}": {
                "fraction": round(r["fraction"], 3),
                "floor_us": round(r["floor_us"], 1),
                "op_dev_fraction": round(r["op_dev_fraction"], 3),
                "vs_bound": round(r["vs_bound"], 3),
                "loop_floor_us": round(r["loop_floor_us"], 1),
            }
            for r in rows
        },
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
