"""tiered_kv's verified file tier as an SGLang HiCache storage backend (L3 behind SGLang's host pool).

Primitives:

* :class:`TieredKVHiCacheStorage` -- a ``HiCacheStorage`` loaded by SGLang's own factory with
  ``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "tiered_kv",
  "module_path": "tiered_kv.integrations.sglang", "class_name": "TieredKVHiCacheStorage", "interface_v1": 1,
  "file_dir": DIR, "file_blocks": N}'``: ``get`` / ``set`` / ``exists`` / ``batch_get`` / ``batch_set``, the
  zero-copy v1 path (``batch_get_v1`` / ``batch_set_v1`` straight from SGLang's host pool indices: one
  ``copy_chunks`` call gathers or scatters every page of a batch between SGLang's host pool and tiered_kv's
  staging blocks), ``batch_exists`` (the length of the hit prefix), ``clear``, ``get_stats``, ``close``.

Every page read is verified (layout fingerprint, content key, xxh3-128 checksum): a page that fails is a
miss (``False`` / ``None``), its slot is dropped, and it is never copied into SGLang's pool. Content keys are
SGLang's page hashes salted with the model, the TP/PP rank and size, MLA and the host layout, so a rank never
reads another rank's shard. Page bytes are fixed by the first page seen (``register_mem_pool_host``, or the
first ``set``); extra-config keys: ``file_dir``, ``file_blocks`` (required), ``staging_blocks`` (64),
``file_timeout`` (seconds one file I/O call may take, default the file tier's: a hung disk makes a page a miss
within that time, and the page stays indexed for a later get).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from .. import ops
from ..engine import TransferEngine
from ..file import FileTierConfig, FileTimeout
from ..layout import KVLayout
from ..pools import Tier
from .loop import LoopThread

__all__ = ["TieredKVHiCacheStorage"]


def _bytes_layout(page_bytes: int) -> KVLayout:
    return KVLayout(
        num_layers=1, num_kv_heads=1, head_dim=page_bytes, tokens_per_block=1, dtype=torch.uint8, kv_factor=1
    )


class TieredKVHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang L3 storage on tiered_kv's file tier (see the module docstring).

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (its ``extra_config`` holds our keys).
        kwargs: what SGLang's dynamic factory passes (unused).

    Raises:
        ValueError: missing or bad ``file_dir`` / ``file_blocks``.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if "file_dir" not in extra or not isinstance(extra.get("file_blocks"), int) or extra["file_blocks"] < 1:
            raise ValueError("TieredKVHiCacheStorage needs extra_config 'file_dir' and a positive int 'file_blocks'")
        staging = extra.get("staging_blocks", 64)
        if isinstance(staging, bool) or not isinstance(staging, int) or staging < 1:
            raise ValueError(f"extra_config 'staging_blocks' must be a positive int, got {staging!r}")
        timeout = extra.get("file_timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or
                                    not 0 < timeout < float("inf")):
            raise ValueError(f"extra_config 'file_timeout' must be a positive number of seconds, got {timeout!r}")
        self.file_timeout = None if timeout is None else float(timeout)
        c = storage_config
        self.config = c
        self.file_blocks = int(extra["file_blocks"])
        self.staging_blocks = staging
        self.directory = Path(extra["file_dir"]) / f"tp{c.tp_rank}of{c.tp_size}-pp{c.pp_rank}of{c.pp_size}"
        self._salt = (
            f"tiered_kv-sglang|model={c.model_name}|tp={c.tp_rank}/{c.tp_size}|pp={c.pp_rank}/{c.pp_size}"
            f"|cp={c.attn_cp_rank}/{c.attn_cp_size}|mla={c.is_mla_model}|page_first={c.is_page_first_layout}"
            f"|dp={getattr(c, 'dp_rank', 0)}"
        ).encode()
        self._lock = threading.RLock()
        self._loop = LoopThread("tiered_kv-sglang")
        self._engine: TransferEngine | None = None
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()  # page hash -> slot (LRU)
        self._free: list[int] = []
        self._stats: collections.Counter[str] = collections.Counter()
        self.mem_pool_host: Any = None

    # ------------------------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands its host pool; its page size fixes the file tier's slot size."""
        self.mem_pool_host = mem_pool_host
        _ptrs, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(mem_pool_host.page_size))
        self._open(int(sum(sizes)))

    def _open(self, page_bytes: int) -> TransferEngine:
        with self._lock:
            if self._engine is not None:
                if self._engine.layout.bytes_per_block != page_bytes:
                    raise ValueError(
                        f"pages of {page_bytes} bytes, but this storage holds {self._engine.layout.bytes_per_block}"
                    )
                return self._engine
            self.directory.mkdir(parents=True, exist_ok=True)
            timeout = {} if self.file_timeout is None else {"timeout": self.file_timeout}
            engine = TransferEngine(
                _bytes_layout(page_bytes),
                host_blocks=self.staging_blocks,
                device="cpu",
                file_config=FileTierConfig.from_env(self.directory, self.file_blocks, **timeout),
            )
            tier = engine.file_tier
            used: set[int] = set()
            tag = self._tag()
            for slot in range(self.file_blocks):  # warm restart: pages the slab verified at open are found again
                key = tier.key_of(slot)
                if isinstance(key, bytes) and key.startswith(b"sg:") and key.endswith(tag):
                    self._index[key[3 : -len(tag)].decode()] = slot
                    used.add(slot)
            self._free = [s for s in range(self.file_blocks - 1, -1, -1) if s not in used]
            self._engine = engine
            return engine

    def _tag(self) -> bytes:
        return b"|" + hashlib.blake2b(self._salt, digest_size=8).hexdigest().encode()

    def _content(self, key: str) -> bytes:
        """The slab's content key of one page: SGLang's page hash plus the salt's digest."""
        return b"sg:" + key.encode() + self._tag()

    # ------------------------------------------------------------------------------ index

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The number of leading keys that are stored."""
        with self._lock:
            for i, k in enumerate(keys):
                if k not in self._index:
                    return i
            return len(keys)

    def _slot_for(self, key: str) -> int | None:
        if key in self._index:
            self._index.move_to_end(key)
            return self._index[key]
        if self._free:
            return self._free.pop()
        if self._index:  # evict the least recently used page
            _old, slot = self._index.popitem(last=False)
            self._stats["evictions"] += 1
            return slot
        return None

    # ------------------------------------------------------------------------------ core moves

    def _write(self, keys: list[str], fill: Any) -> list[bool]:
        """Write pages: ``fill(staging_tensor, rows)`` puts page ``i`` of the batch into staging block ``rows[i]``."""
        engine = self._engine
        assert engine is not None
        staging = engine.pool(Tier.HOST).tensor.view(self.staging_blocks, -1)
        out: list[bool] = []
        for start in range(0, len(keys), self.staging_blocks):
            batch = keys[start : start + self.staging_blocks]
            rows = list(range(len(batch)))
            fill(staging, rows, start)
            slots = []
            for k in batch:
                slot = self._slot_for(k)
                self._index.pop(k, None)  # not visible until its write is done
                slots.append(slot)

            async def go(rows: list[int], slots: list[int | None], batch: list[str]) -> list[BaseException | None]:
                ts = [
                    engine.copy(Tier.HOST, [r], Tier.FILE, [s], keys=[self._content(k)])
                    for r, s, k in zip(rows, slots, batch, strict=True)
                    if s is not None
                ]
                return [
                    None if not isinstance(x, BaseException) else x
                    for x in await asyncio.gather(*ts, return_exceptions=True)
                ]

            results = iter(self._loop.run(go(rows, slots, batch)))
            for k, s in zip(batch, slots, strict=True):
                ok = s is not None and next(results) is None
                if ok:
                    self._index[k] = s  # type: ignore[assignment]
                elif s is not None:
                    self._free.append(s)
                self._stats["writes" if ok else "write_failures"] += 1
                out.append(ok)
        return out

    def _read(self, keys: list[str], drain: Any) -> list[bool]:
        """Read verified pages into staging, then ``drain(staging, [(batch index, row)], start)`` copies them out."""
        engine = self._engine
        if engine is None:
            return [False] * len(keys)
        staging = engine.pool(Tier.HOST).tensor.view(self.staging_blocks, -1)
        out: list[bool] = []
        for start in range(0, len(keys), self.staging_blocks):
            batch = keys[start : start + self.staging_blocks]
            slots = [self._index.get(k) for k in batch]

            async def go(slots: list[int | None], batch: list[str]) -> list[BaseException | bool]:
                ts = [
                    engine.copy(Tier.FILE, [s], Tier.HOST, [r], keys=[self._content(k)])
                    for r, (s, k) in enumerate(zip(slots, batch, strict=True))
                    if s is not None
                ]
                res = await asyncio.gather(*ts, return_exceptions=True)
                return [x if isinstance(x, BaseException) else True for x in res]

            got = iter(self._loop.run(go(slots, batch)))
            ok_rows = []
            for i, (k, s) in enumerate(zip(batch, slots, strict=True)):
                result = next(got) if s is not None else False
                ok = result is True
                if isinstance(result, FileTimeout):  # a hung disk: a miss now; the slot still holds the page
                    self._stats["timeouts"] += 1
                elif s is not None and not ok:  # failed verification: the slot was dropped; a miss from now on
                    self._index.pop(k, None)
                    self._free.append(s)
                    self._stats["verify_failures"] += 1
                self._stats["hits" if ok else "misses"] += 1
                if ok:
                    ok_rows.append((i, i))
                out.append(ok)
            if ok_rows:
                drain(staging, ok_rows, start)
        return out

    # ------------------------------------------------------------------------------ zero-copy v1

    def _host_chunks(self, host_indices: torch.Tensor, n: int) -> tuple[list[torch.Tensor], np.ndarray, np.ndarray]:
        """SGLang's host pool pages as (buffers, buffer index per chunk, byte offset per chunk).

        Chunks are chunk-major per page.
        """
        pool = self.mem_pool_host
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        kv = pool.kv_buffer
        buffers = list(kv) if isinstance(kv, (list, tuple)) else [kv]
        flat = [b.view(-1).view(torch.uint8) for b in buffers]
        starts = np.array([b.data_ptr() for b in flat], dtype=np.int64)
        ends = starts + np.array([b.numel() for b in flat], dtype=np.int64)
        p = np.asarray(ptrs, dtype=np.int64)
        which = np.full(p.size, -1, dtype=np.int64)
        for i, (a, b) in enumerate(zip(starts, ends, strict=True)):
            which[(p >= a) & (p < b)] = i
        if (which < 0).any():
            raise ValueError("SGLang's host pool returned a page pointer outside its kv_buffer")
        if p.size % n or len(set(sizes)) != 1:
            raise ValueError("SGLang's host pool pages have uneven pieces")
        return flat, which, p - starts[which]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store pages straight from SGLang's host pool (``host_indices``: ``page_size`` token slots per key)."""
        if not keys:
            return []
        with self._lock:
            flat, which, offs = self._host_chunks(host_indices, len(keys))
            per = which.size // len(keys)
            piece = (self._engine.layout.bytes_per_block if self._engine else 0) // per

            def fill(staging: torch.Tensor, rows: list[int], start: int) -> None:
                sel = np.arange(start * per, (start + len(rows)) * per)
                table = np.stack(
                    [
                        which[sel],
                        offs[sel],
                        np.zeros(sel.size, dtype=np.int64),
                        (
                            np.repeat(np.asarray(rows, dtype=np.int64), per) * staging.shape[1]
                            + np.tile(np.arange(per, dtype=np.int64) * piece, len(rows))
                        ),
                        np.full(sel.size, piece, dtype=np.int64),
                    ],
                    axis=1,
                )
                ops.copy_chunks([staging], flat, torch.from_numpy(np.ascontiguousarray(table)))

            return self._write(list(keys), fill)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load verified pages straight into SGLang's host pool; a page that fails verification is ``False``."""
        if not keys:
            return []
        with self._lock:
            if self._engine is None:
                return [False] * len(keys)
            flat, which, offs = self._host_chunks(host_indices, len(keys))
            per = which.size // len(keys)
            piece = self._engine.layout.bytes_per_block // per

            def drain(staging: torch.Tensor, rows: list[tuple[int, int]], start: int) -> None:
                idx = np.asarray([start + i for i, _ in rows], dtype=np.int64)
                r = np.asarray([row for _, row in rows], dtype=np.int64)
                sel = (idx[:, None] * per + np.arange(per)[None, :]).reshape(-1)
                src_off = np.repeat(r, per) * staging.shape[1] + np.tile(np.arange(per, dtype=np.int64) * piece, r.size)
                table = np.stack(
                    [
                        np.zeros(sel.size, dtype=np.int64),
                        src_off,
                        which[sel],
                        offs[sel],
                        np.full(sel.size, piece, dtype=np.int64),
                    ],
                    axis=1,
                )
                ops.copy_chunks(flat, [staging], torch.from_numpy(np.ascontiguousarray(table)))

            return self._read(list(keys), drain)

    # ------------------------------------------------------------------------------ tensor API

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store whole pages given as tensors (any dtype; their bytes are stored)."""
        if not keys:
            return True
        vals = [v.detach().contiguous().view(-1).view(torch.uint8).cpu() for v in values]
        with self._lock:
            self._open(vals[0].numel())

            def fill(staging: torch.Tensor, rows: list[int], start: int) -> None:
                for r in rows:
                    staging[r].copy_(vals[start + r])

            return all(self._write(list(keys), fill))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        [out] = self.batch_get([key], [target_location] if target_location is not None else None)
        return out

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Verified pages into ``target_locations`` (tensors of the page's size), or new uint8 tensors.

        A miss is ``None``.
        """
        out: list[torch.Tensor | None] = [None] * len(keys)
        with self._lock:
            if self._engine is None:
                return out
            size = self._engine.layout.bytes_per_block

            def drain(staging: torch.Tensor, rows: list[tuple[int, int]], start: int) -> None:
                for i, row in rows:
                    j = start + i
                    if target_locations is not None:
                        t = target_locations[j]
                        t.view(-1).view(torch.uint8).copy_(staging[row])
                    else:
                        t = staging[row].clone()
                    out[j] = t

            ok = self._read(list(keys), drain)
        assert all((o is not None) == g for o, g in zip(out, ok, strict=True)), size
        return out

    # ------------------------------------------------------------------------------ lifecycle

    def clear(self) -> None:
        """Forget every page (slots are reused; nothing stale is ever served: keys are checked on read)."""
        with self._lock:
            self._free.extend(self._index.values())
            self._index.clear()

    def get_stats(self) -> dict[str, int]:
        """Counters: writes, write_failures, hits, misses, verify_failures, evictions."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """Drain and close the file tier (idempotent)."""
        with self._lock:
            if self._engine is not None:
                self._loop.run(self._engine.close())
                self._engine = None
            self._loop.close()
