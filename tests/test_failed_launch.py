"""A copy that failed at launch stays failed when a later copy that waited for it stream-side completes first."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tiered_kv import KVLayout, Tier, TransferEngine
from tiered_kv.copyops import Copier
from tiered_kv.errors import TransferError

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype=torch.float32)


async def test_a_failed_copy_is_not_completed_as_a_success_by_one_that_waited_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_build = Copier.build

    def build(self: Copier, src_pool: Any, s: Any, dst_pool: Any, d: Any, num_tokens: Any, **kw: Any) -> Any:
        op = real_build(self, src_pool, s, dst_pool, d, num_tokens, **kw)
        if dst_pool.tier is not Tier.HOST:
            return op

        def failing() -> None:
            raise RuntimeError("injected: the copy could not be launched")

        return failing

    monkeypatch.setattr(Copier, "build", build)
    async with TransferEngine(LAYOUT, gpu_blocks=4, host_blocks=4, device="cpu") as engine:
        offload = engine.stream("offload")
        notify = offload.notify

        def late_notify(callback: Any, **kw: Any) -> Any:  # the failed copy's own completion comes 0.3 s late
            def late() -> None:
                time.sleep(0.3)
                callback()

            return notify(late, **kw)

        monkeypatch.setattr(offload, "notify", late_notify)
        failed = engine.copy(Tier.GPU, [0], Tier.HOST, [1])
        reader = engine.copy(Tier.HOST, [1], Tier.GPU, [2])  # reads what `failed` writes: waits for it stream-side
        with pytest.raises(TransferError, match="a copy this one reads from failed: injected"):
            await reader  # the bytes it read never arrived: it fails too
        assert failed.done()  # completed with the reader, which the device ran after it
        error = failed.exception()
        assert isinstance(error, RuntimeError) and "injected" in str(error), error
        with pytest.raises((RuntimeError, TransferError)):
            await failed
