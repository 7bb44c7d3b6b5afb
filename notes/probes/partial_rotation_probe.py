"""Session o probe: do the partial rows' side measures (loop floor, op alone) slow the engine copy they take turns with?

The kernels bench's partial rows rotate five calls per turn: the engine copy, the contiguous copy, the engine's
1-token floor, the bare loop floor and the op alone (``ops.copy_blocks`` with CPU index tensors, synchronized). The
engine copy took 126 us there (4 of 16, H100) against 92 us in ``turnphase_probe.py``'s rotation of the first four.

Variants (the bench's ``_partial`` with ``in_turns`` replaced):

* ``bench``: the five in one rotation (as the bench);
* ``split3``: engine, contiguous and floor in one rotation; loop floor and op alone in a rotation of their own;
* ``split2``: engine and contiguous in one rotation; the floor; the loop floor and the op alone.

Run on a CUDA machine: ``python partial_rotation_probe.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys

import torch

from tiered_kv.tools.bench import kernels
from tiered_kv.tools.bench.common import in_turns

COLS = ("fraction", "engine_GBps", "contiguous_GBps", "floor_us", "loop_floor_us", "op_wall_fraction", "bound_fraction")


def splitter(groups: list[int]):  # type: ignore[no-untyped-def]
    """An ``in_turns`` that runs the calls in consecutive rotations of ``groups`` calls each."""
    async def run(calls, turns):  # type: ignore[no-untyped-def]
        if len(calls) != sum(groups):
            return await in_turns(calls, turns)
        out = []
        start = 0
        for g in groups:
            out.extend(await in_turns(calls[start : start + g], turns))
            start += g
        return out

    return run


async def main() -> None:
    """Each variant twice; the gpu->gpu rows (all rows with ``all`` on the command line)."""
    variants = {"bench": [5], "split3": [3, 2], "split2": [2, 1, 2]}
    names = [a for a in sys.argv[1:] if a in variants] or list(variants)
    print(f"# partial_rotation_probe on {torch.cuda.get_device_name()}")
    for rep in range(2):
        for name in names:
            kernels.in_turns = splitter(variants[name])  # type: ignore[assignment]
            rows = await kernels._partial("cuda", 256, 10)
            for r in rows:
                if r["direction"] != "gpu->gpu" and "all" not in sys.argv:
                    continue
                vals = "  ".join(f"{c}={r[c]:.3f}" for c in COLS)
                print(f"{rep} {name:7s} {r['tokens']:5s} {r['direction']:9s} {vals}", flush=True)
    print("# done", statistics.__name__)


if __name__ == "__main__":
    torch.cuda.init()
    asyncio.run(main())
