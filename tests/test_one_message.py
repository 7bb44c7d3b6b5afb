"""Issue 41, item 7 (the CPU-checkable parts): one rule and one clear message per failure.

An index beyond int64 is out of range (not "negative" nor "got object"); a small slab's sizes show in a unit
that shows them (not "0.00 GiB"); an engine dropped without ``close()`` leaves no emulator thread running.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from tiered_kv import KVLayout, TransferEngine
from tiered_kv.file import place

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=16, dtype=torch.float16)


@pytest.mark.parametrize(
    ("indices", "shown"),
    [
        ([np.uint64(2**63)], str(2**63)),
        (np.array([2**63, 1], dtype=np.uint64), str(2**63)),
        ([2**70], str(2**70)),
        ([0, 2**70], str(2**70)),
    ],
    ids=["np.uint64 scalar", "uint64 array", "2**70", "mixed"],
)
@pytest.mark.parametrize("side", ["source", "destination"])
async def test_an_index_beyond_int64_is_out_of_range(indices: object, shown: str, side: str) -> None:
    async with TransferEngine(LAYOUT, gpu_blocks=4, host_blocks=4, device="cpu") as engine:
        n = len(indices)  # type: ignore[arg-type]
        other = list(range(n))
        src, dst = (indices, other) if side == "source" else (other, indices)
        with pytest.raises(ValueError, match="out of range") as info:
            engine.copy("gpu", src, "host", dst)  # type: ignore[arg-type]
        message = str(info.value)
        assert message.startswith(f"{side} indices") and shown in message and "too large" in message
        assert "negative" not in message and "object" not in message


async def test_a_huge_negative_index_is_negative_and_a_non_integer_names_its_type() -> None:
    async with TransferEngine(LAYOUT, gpu_blocks=4, host_blocks=4, device="cpu") as engine:
        with pytest.raises(ValueError, match=r"negative block index \(-"):
            engine.copy("gpu", [-(2**70)], "host", [0])
        with pytest.raises(TypeError, match="must be integers, got NoneType"):
            engine.copy("gpu", [2**70, None], "host", [0, 1])  # type: ignore[list-item]
        # still usable: nothing was enqueued by the refused calls
        await engine.copy("gpu", [0], "host", [1])


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(0, "0 B"), (512, "512 B"), (4096, "4.00 KiB"), (2_621_440, "2.50 MiB"), (3 << 30, "3.00 GiB")],
)
def test_sizes_are_shown_in_a_unit_that_shows_them(nbytes: int, text: str) -> None:
    assert place._size(nbytes) == text


def test_a_small_slab_that_does_not_fit_says_its_sizes(tmp_path: object) -> None:
    from tiered_kv.errors import StorageError
    from tiered_kv.file.place import check_space

    with pytest.raises(StorageError) as info:
        check_space("/proc/kv.slab", 8192, 1)
    assert "needs 8.00 KiB" in str(info.value) and "0 B free" in str(info.value)
    assert "0.00 GiB" not in str(info.value)


def _tiered_kv_threads(before: set[int | None]) -> list[str]:
    return [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("tiered_kv")]


def test_an_engine_dropped_without_close_leaves_no_thread_running() -> None:
    before = {t.ident for t in threading.enumerate()}

    def use_and_drop() -> None:
        engine = TransferEngine(LAYOUT, gpu_blocks=4, host_blocks=4, device="cpu")

        async def one_copy() -> None:
            await engine.copy("gpu", [0], "host", [1])

        asyncio.run(one_copy())
        assert _tiered_kv_threads(before)  # the emulator's stream threads run while the engine lives

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        use_and_drop()
        # a stream's worker may still hold the last work it ran for a moment: collect until the engine goes
        deadline = time.monotonic() + 2.0
        while not any("unclosed" in str(w.message) for w in caught) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
    assert any(issubclass(w.category, ResourceWarning) and "unclosed" in str(w.message) for w in caught)
    deadline = time.monotonic() + 2.0
    while _tiered_kv_threads(before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _tiered_kv_threads(before) == []
