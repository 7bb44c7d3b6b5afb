"""TieredKVHiCacheStorage loaded by SGLang's real storage backend factory, on CPU.

What runs from SGLang (0.5.x wheel, installed ``--no-deps``): ``StorageBackendFactory.create_backend("dynamic",
...)``, ``HiCacheStorageConfig``, the ``HiCacheStorage`` base class and SGLang's failure injector
(``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE``). SGLang's host pool class (``pool_host.mha``) cannot be
imported on a CPU-only torch (its import chain needs torchvision, whose wheel does not load against the CPU
torch vLLM pins), so ``HostPool`` below reproduces ``MHATokenToKVPoolHost``'s buffer shapes and its
``get_page_buffer_meta`` pointer arithmetic for both layouts. The SGLang server itself needs a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_import import require
from hung_disk import hang_file_reads

require("sglang.srt.mem_cache.storage.backend_factory")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageFailureInjector  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from tiered_kv.integrations.sglang import TieredKVHiCacheStorage  # noqa: E402

LAYERS, HEADS, DIM, PAGE, SIZE = 3, 2, 16, 4, 64


class HostPool:
    """``MHATokenToKVPoolHost``'s kv_buffer and ``get_page_buffer_meta`` (layer_first / page_first)."""

    def __init__(self, layout: str) -> None:
        self.layout, self.page_size, self.size, self.layer_num = layout, PAGE, SIZE, LAYERS
        self.head_num, self.head_dim, self.dtype = HEADS, DIM, torch.float16
        shape = (2, LAYERS, SIZE, HEADS, DIM) if layout == "layer_first" else (2, SIZE, LAYERS, HEADS, DIM)
        self.kv_buffer = torch.zeros(shape, dtype=torch.float16)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        ptrs: list[int] = []
        base, item = self.kv_buffer.data_ptr(), self.dtype.itemsize
        idx = indices.tolist()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        if self.layout == "layer_first":
            for i in range(0, len(idx), self.page_size):
                for layer in range(self.layer_num):
                    k = (base + idx[i] * self.head_num * self.head_dim * item
                         + layer * self.size * self.head_num * self.head_dim * item)
                    ptrs += [k, k + v_offset]
            size = item * self.page_size * self.head_num * self.head_dim
        else:
            for i in range(0, len(idx), self.page_size):
                k = base + idx[i] * self.layer_num * self.head_num * self.head_dim * item
                ptrs += [k, k + v_offset]
            size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)

    def page(self, p: int) -> torch.Tensor:
        """Every byte of page ``p`` (K and V of every layer), for comparisons."""
        sl = slice(p * PAGE, (p + 1) * PAGE)
        t = self.kv_buffer[:, :, sl] if self.layout == "layer_first" else self.kv_buffer[:, sl]
        return t.clone()


def _config(tmp_path: Path, layout: str = "page_first", **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=layout == "page_first", model_name="tiny",
        extra_config={"backend_name": "tiered_kv", "module_path": "tiered_kv.integrations.sglang",
                      "class_name": "TieredKVHiCacheStorage", "interface_v1": 1, "file_dir": str(tmp_path),
                      "file_blocks": 32, "staging_blocks": 4, **extra})


def _make(tmp_path: Path, layout: str) -> tuple[Any, HostPool]:
    pool = HostPool(layout)
    backend = StorageBackendFactory.create_backend("dynamic", _config(tmp_path, layout), pool)
    backend.register_mem_pool_host(pool)
    return backend, pool


def _pages(first: int, n: int) -> torch.Tensor:
    return torch.arange(first * PAGE, (first + n) * PAGE, dtype=torch.int64)


@pytest.fixture(autouse=True)
def _no_injector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", raising=False)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", raising=False)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_v1_round_trip_through_sglang_factory(tmp_path: Path, layout: str) -> None:
    backend, pool = _make(tmp_path, layout)
    try:
        assert isinstance(backend, TieredKVHiCacheStorage)
        pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer))
        keys = [f"hash-{i}" for i in range(6)]  # 6 pages through 4 staging blocks: two batches
        originals = [pool.page(p) for p in range(2, 8)]
        assert backend.batch_set_v1(keys, _pages(2, 6)) == [True] * 6
        assert backend.batch_exists(keys) == 6 and backend.batch_exists([*keys[:3], "nope", keys[4]]) == 3
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(keys, _pages(8, 6)) == [True] * 6
        for i, want in enumerate(originals):
            assert torch.equal(pool.page(8 + i), want), f"page {i} not bit-exact"
        assert not pool.page(2).any()  # nothing written outside the target pages
    finally:
        backend.close()


def test_tensor_api_round_trip(tmp_path: Path) -> None:
    backend = StorageBackendFactory.create_backend("dynamic", _config(tmp_path), None)
    try:
        pages = [torch.randn(2, LAYERS, PAGE, HEADS, DIM, dtype=torch.float16) for _ in range(5)]
        assert backend.set("a", pages[0]) and backend.exists("a") and not backend.exists("b")
        assert backend.batch_set(["b", "c", "d", "e"], pages[1:])
        got = backend.get("a", torch.empty_like(pages[0]))
        assert got is not None and torch.equal(got, pages[0])
        outs = backend.batch_get(["c", "zz", "e"], [torch.empty_like(pages[0]) for _ in range(3)])
        assert outs[1] is None and torch.equal(outs[0], pages[2]) and torch.equal(outs[2], pages[4])
        backend.clear()
        assert backend.batch_exists(["a", "b"]) == 0 and backend.get("a") is None
    finally:
        backend.close()


def test_corrupted_page_is_a_miss_and_never_copied(tmp_path: Path) -> None:
    backend, pool = _make(tmp_path, "page_first")
    try:
        pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer))
        keys = ["k0", "k1", "k2"]
        assert backend.batch_set_v1(keys, _pages(0, 3)) == [True] * 3
        want = [pool.page(p) for p in range(3)]
        tier = backend._engine.file_tier
        slot = backend._index["k1"]
        with open(tier.path, "r+b") as fh:  # flip one payload byte of k1's slot
            at = 4096 + slot * tier.slot_size + 4096 + 5
            fh.seek(at)
            b = fh.read(1)
            fh.seek(at)
            fh.write(bytes([b[0] ^ 0x55]))
        pool.kv_buffer.fill_(7)
        sentinel = pool.page(4)
        assert backend.batch_get_v1(keys, _pages(3, 3)) == [True, False, True]
        assert torch.equal(pool.page(3), want[0]) and torch.equal(pool.page(5), want[2])
        assert torch.equal(pool.page(4), sentinel)  # the failed page was never copied into SGLang's pool
        assert not backend.exists("k1") and backend.batch_exists(keys) == 1
        assert backend.get_stats()["verify_failures"] == 1
    finally:
        backend.close()


def test_warm_restart_finds_pages_again(tmp_path: Path) -> None:
    backend, pool = _make(tmp_path, "layer_first")
    pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer))
    want = pool.page(1)
    assert backend.batch_set_v1(["w"], _pages(1, 1)) == [True]
    backend.close()
    again, pool2 = _make(tmp_path, "layer_first")
    try:
        assert again.exists("w")
        assert again.batch_get_v1(["w"], _pages(2, 1)) == [True]
        assert torch.equal(pool2.page(2), want)
    finally:
        again.close()


def test_under_sglang_failure_injector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    backend, pool = _make(tmp_path, "page_first")
    try:
        assert isinstance(backend, HiCacheStorageFailureInjector)
        rng = np.random.RandomState(0)
        truth: dict[str, torch.Tensor] = {}
        failures = successes = 0
        for step in range(40):
            pool.kv_buffer[:, 0:PAGE * 2].copy_(torch.randn(2, PAGE * 2, LAYERS, HEADS, DIM, dtype=torch.float16))
            keys = [f"s{step}-a", f"s{step}-b"]
            res = backend.batch_set_v1(keys, _pages(0, 2))
            for i, (k, ok) in enumerate(zip(keys, res, strict=True)):
                if ok:
                    truth[k] = pool.page(i)
            probe = list(rng.choice(sorted(truth), size=min(3, len(truth)), replace=False)) if truth else []
            if probe:
                got = backend.batch_get_v1(probe, _pages(4, len(probe)))
                for i, (k, ok) in enumerate(zip(probe, got, strict=True)):
                    if ok:
                        successes += 1
                        assert torch.equal(pool.page(4 + i), truth[k]), f"{k} served wrong bytes"
                    else:
                        failures += 1
        assert successes > 10 and failures > 0
        assert os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"] == "0.3"
    finally:
        backend._backend.close()


def test_a_hung_disk_makes_a_page_a_miss_within_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through SGLang's factory with ``file_timeout``: reads that hang end as misses within the deadline, the pages stay
    indexed, and once the disk answers again they are served, bit-exact."""
    import time

    hang, faulty = hang_file_reads(monkeypatch)
    pool = HostPool("page_first")
    backend = StorageBackendFactory.create_backend("dynamic", _config(tmp_path, file_timeout=0.5), pool)
    backend.register_mem_pool_host(pool)
    try:
        pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer))
        want = [pool.page(p) for p in range(2)]
        assert backend.batch_set_v1(["h0", "h1"], _pages(0, 2)) == [True, True]
        hang.on = True
        t0 = time.monotonic()
        assert backend.batch_get_v1(["h0", "h1"], _pages(2, 2)) == [False, False]
        assert time.monotonic() - t0 < 5.0  # the deadline is 0.5 s a call; never a wait without end
        assert backend.get_stats()["timeouts"] >= 1
        assert backend.batch_exists(["h0", "h1"]) == 2  # a hung read is a miss, not a bad slot
        hang.on = False
        faulty[0].release()
        deadline = time.monotonic() + 10
        while backend.batch_get_v1(["h0", "h1"], _pages(4, 2)) != [True, True]:
            assert time.monotonic() < deadline, "the pages never came back once the disk answered"
            time.sleep(0.2)
        assert torch.equal(pool.page(4), want[0]) and torch.equal(pool.page(5), want[1])
    finally:
        faulty[0].release()
        backend.close()
