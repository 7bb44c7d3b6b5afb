"""Mooncake's answers to a batch get: an object still being written, absent, or whose lease expired is a miss;
any other negative code is a store error (the tier backs off). An object being put by another node while this one
reads it is routine: backing off the whole tier for it would turn every lookup into a miss for seconds."""

from __future__ import annotations

from typing import Any

import numpy as np

from tiered_kv.remote.stores import MISSING, MooncakeStore
from tiered_kv.remote.url import parse_store_url


class _Client:
    def __init__(self, codes: list[int]) -> None:
        self.codes = codes

    def batch_get_into(self, names: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        return self.codes


async def test_a_replica_not_ready_is_a_miss_and_other_codes_are_errors() -> None:
    store = MooncakeStore(parse_store_url("mooncake://127.0.0.1:50051"))
    client = _Client([64, -703, -704, -707, -900])
    store._require = lambda: client  # type: ignore[method-assign]
    try:
        out: list[Any] = [np.empty(64, np.uint8) for _ in range(5)]
        got = await store.get([f"tkv1/0/{i}" for i in range(5)], out)
    finally:
        store._pool.shutdown()
    assert got == [64, MISSING, MISSING, MISSING, -900]
