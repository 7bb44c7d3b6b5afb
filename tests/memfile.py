"""A test double of the file tier: an in-memory pool routed through the engine's host threads.

Until the file tier (issue 4) is merged, this lets the cache's third tier run end to end: copies with a
FILE side run off-stream (lane ``None``), so the engine orders them with loop-side fence waits, as it
will a real file tier's I/O.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tiered_kv import engine as engine_mod
from tiered_kv.engine import TransferEngine
from tiered_kv.pools import BlockPool, Tier

_FILE_ROUTES = [(Tier.HOST, Tier.FILE), (Tier.FILE, Tier.HOST), (Tier.FILE, Tier.GPU), (Tier.GPU, Tier.FILE)]


@contextlib.contextmanager
def memory_file_tier(engine: TransferEngine, blocks: int) -> Iterator[BlockPool]:
    layout = engine.layout
    pool = BlockPool(Tier.FILE, layout, torch.zeros((blocks, *layout.block_shape), dtype=layout.dtype))
    engine._pools[Tier.FILE] = pool
    added = [r for r in _FILE_ROUTES if r not in engine_mod._ROUTES]
    for r in added:
        engine_mod._ROUTES[r] = None
    try:
        yield pool
    finally:
        for r in added:
            engine_mod._ROUTES.pop(r, None)
