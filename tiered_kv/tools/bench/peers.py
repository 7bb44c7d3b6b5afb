"""tiered_kv next to LMCache 0.5.x: one prefix's KV stored from and retrieved into vLLM's paged GPU layout.

``tiered-kv bench --only peers`` or ``python -m tiered_kv.tools.bench.peers --device cuda [--quick] [--dir D]
[--json F]``; the files go to ``--dir``, else ``TIERED_KV_BENCH_DIR``, else a temporary directory. It refuses in one
line, before measuring anything, unless the device is CUDA and LMCache's compiled ops load (:func:`check_lmcache`;
LMCache itself falls back to plain torch ops when they do not).

The KV is Llama-3-8B's shape (32 layers, 8 KV heads, head_dim 128, bf16) in vLLM's FlashAttention paged layout,
one ``(2, blocks, 16, 8, 128)`` tensor per layer; a prefix of 8k and of 32k tokens (1k and 4k with ``--quick``)
in scattered blocks. Both libraries move the same blocks of the same tensors through their public APIs: tiered_kv
``await engine.copy(...)`` of a ``TransferEngine`` over ``pool_kinds.flash_attn(layout, kv)`` with a host pool and
a file tier (``gds="off"``), blocks of 16 tokens; LMCache ``engine.store`` / ``engine.retrieve(tokens,
kvcaches=kv, slot_mapping=...)`` of an ``LMCacheEngine`` with the connector vLLM's integration creates
(``CreateGPUConnector``), chunks of 256 tokens, a ``local_cpu`` engine for host and a ``local_disk`` one for disk
(:class:`LMCachePeer`).

Rows (``bench``, ``direction``, ``tokens``): ``lmcache`` gpu->cpu, cpu->gpu, gpu->disk, disk->gpu; ``per_block``
gpu->cpu, cpu->gpu next to the copy loop of vLLM's CPU offload (per layer, for K and V, per block
``dst[block].copy_(src[block], non_blocking=True)``, then one synchronize). Fields: ``tiered_kv_GBps``,
``peer_GBps``, ``ratio`` (tiered_kv's throughput over the peer's: the median over turns of peer seconds /
tiered_kv seconds), ``line_GBps`` (one pinned ``copy_`` of the same bytes between contiguous buffers; for disk,
raw writes or reads of the same bytes), ``tiered_kv_exact`` / ``peer_exact`` (a retrieve into zeroed blocks gave
back the exact bytes) and ``verified`` (both). Target: ``ratio >= 1`` and ``verified``. The three take turns in
rotating order after a warm-up turn, each call timed from a synchronized GPU to the GPU synchronized after it; the
page cache of every file in the directory is dropped before every disk read.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Protocol

import torch

from ...backends.posix import DIRECT_ALIGN, aligned_empty, direct_io_supported
from ...device import resolve_device
from ...engine import TransferEngine
from ...file import FileTierConfig
from ...layout import KVLayout
from ...pool_kinds import flash_attn
from ...pools import Tier
from .common import bench_main, in_turns, machine_info, sync

__all__ = ["SHAPE_8B", "KVShape", "LMCachePeer", "PagedKV", "Peer", "PeerUnavailable", "main", "measure", "run"]

INSTALL = "pip install 'lmcache>=0.5,<0.6'"
THREADS = 4  # disk I/O threads: tiered_kv's io_threads, LMCache's disk_io_threads, the raw line rate's
PIECE = 16 << 20  # bytes per raw disk call of the line rate
# what the benchmark uses of LMCache, imported by check_lmcache (a missing dependency refuses before measuring)
_MODULES = (
    "lmcache.utils",
    "lmcache.v1.config",
    "lmcache.v1.metadata",
    "lmcache.v1.gpu_connector",
    "lmcache.v1.cache_engine",
)
Row = dict[str, Any]


class PeerUnavailable(ValueError):
    """The peer cannot be measured here; the benchmark refuses before measuring anything."""


@dataclasses.dataclass(frozen=True, slots=True)
class KVShape:
    """The model's KV geometry: vLLM's paged blocks of ``block_tokens``, LMCache's chunks of ``chunk_tokens``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_tokens: int = 16
    chunk_tokens: int = 256

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    def layout(self) -> KVLayout:
        """tiered_kv's block layout of this shape."""
        return KVLayout(self.layers, self.kv_heads, self.head_dim, self.block_tokens, self.dtype)


SHAPE_8B = KVShape(layers=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def check_lmcache() -> str:
    """LMCache's version, once it imports and its compiled ops are known to be the ones it runs.

    Raises:
        PeerUnavailable: LMCache is not installed or a module it needs does not import; a compiled module does not
            import (e.g. an undefined symbol of another torch); ``lmcache.device_ops`` does not run
            ``lmcache.cuda_ops``'s transfer kernel.
    """
    if importlib.util.find_spec("lmcache") is None:
        raise PeerUnavailable(f"LMCache is not installed: {INSTALL} (its compiled ops must be built for this torch)")
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no usage report to LMCache's server
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # not two INFO lines per store and retrieve
    try:
        importlib.import_module("lmcache.lmcache_native")
        native = importlib.import_module("lmcache.cuda_ops")
    except ImportError as exc:
        if exc.name and not exc.name.startswith("lmcache"):
            raise PeerUnavailable(f"LMCache did not import: {_one_line(exc)}") from None
        raise PeerUnavailable(
            f"LMCache's compiled ops did not load ({_one_line(exc)}); it would run plain torch ops instead: build it "
            f"against torch {torch.__version__}"
        ) from None
    lmcache = importlib.import_module("lmcache")
    kernel = getattr(native, "multi_layer_kv_transfer", None)
    if kernel is None or getattr(getattr(lmcache, "device_ops", None), "multi_layer_kv_transfer", None) is not kernel:
        raise PeerUnavailable(
            "LMCache loaded without binding lmcache.cuda_ops: its transfers would run plain torch ops (LMCache's "
            f"device: {getattr(lmcache, 'torch_device_type', '?')}; a missing numba leaves it none: see its warning)"
        )
    try:
        for name in _MODULES:
            importlib.import_module(name)
    except ImportError as exc:
        raise PeerUnavailable(f"LMCache did not import: {_one_line(exc)}") from None
    return str(getattr(lmcache, "__version__", "unknown"))


def preflight(device: str) -> str:
    """LMCache's version; refuses (:class:`PeerUnavailable`) unless its compiled ops load and ``device`` is CUDA."""
    version = check_lmcache()
    if not resolve_device(device).is_cuda:
        raise PeerUnavailable(f"--device {device}: LMCache's paged GPU connector needs a CUDA device")
    return version


class PagedKV:
    """vLLM's FlashAttention KV (one ``(2, blocks, T, H, D)`` tensor per layer) and a prefix's scattered blocks.

    Args:
        shape: the KV geometry.
        max_tokens: the longest prefix; the pool has a quarter more blocks, the prefix's are a seeded permutation.
        device: where the tensors live; they hold seeded random values, regenerated to check a retrieve.
    """

    def __init__(self, shape: KVShape, max_tokens: int, device: torch.device) -> None:
        self.shape, self.device, self.max_tokens = shape, device, max_tokens
        num_blocks = max_tokens // shape.block_tokens * 5 // 4
        dims = (2, num_blocks, shape.block_tokens, shape.kv_heads, shape.head_dim)
        self.kv = [torch.empty(dims, dtype=shape.dtype, device=device) for _ in range(shape.layers)]
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
        self.blocks = order[: max_tokens // shape.block_tokens]
        self.block_list: list[int] = self.blocks.tolist()
        offsets = torch.arange(shape.block_tokens)
        self.slot_mapping = (self.blocks[:, None] * shape.block_tokens + offsets).reshape(-1).to(device)
        for layer, t in enumerate(self.kv):
            t.copy_(self._content(layer))

    def _content(self, layer: int) -> torch.Tensor:
        gen = torch.Generator(self.device).manual_seed(layer + 1)
        t = self.kv[layer]
        return torch.randn(t.shape, generator=gen, device=self.device, dtype=torch.float32).to(t.dtype)

    def nbytes(self, tokens: int) -> int:
        """Bytes of the first ``tokens`` tokens' KV."""
        return tokens * self.shape.token_bytes

    def _idx(self, tokens: int) -> torch.Tensor:
        return self.blocks[: tokens // self.shape.block_tokens].to(self.device)

    def scribble(self, tokens: int) -> None:
        """Zero the first ``tokens`` tokens' blocks (before a retrieve that must bring them back)."""
        idx = self._idx(tokens)
        for t in self.kv:
            t[:, idx] = 0

    def intact(self, tokens: int) -> bool:
        """Whether the first ``tokens`` tokens' blocks hold exactly the values they were filled with."""
        idx = self._idx(tokens)
        return all(torch.equal(t[:, idx], self._content(i)[:, idx]) for i, t in enumerate(self.kv))


class Peer(Protocol):
    """A library measured next to tiered_kv, moving the prefix's first ``tokens`` tokens' KV.

    ``store`` copies them from their GPU blocks to ``where`` (``"cpu"``: host memory, ``"disk"``: files in the
    benchmark's directory), ``retrieve`` back into the same blocks, each returning once the bytes are there;
    ``forget`` drops them from ``where`` (untimed, before each store); ``close`` releases everything, files too.
    """

    name: str

    def store(self, where: str, tokens: int) -> None: ...  # noqa: D102

    def retrieve(self, where: str, tokens: int) -> None: ...  # noqa: D102

    def forget(self, where: str, tokens: int) -> None: ...  # noqa: D102

    def close(self) -> None: ...  # noqa: D102


class LMCachePeer:
    """LMCache through its public API: one ``LMCacheEngine`` per tier, one at a time (building one destroys the other).

    Args:
        paged: the KV both libraries move.
        directory: LMCache's ``local_disk`` is ``<directory>/lmcache``.
        direct: ``use_odirect`` of its disk backend (O_DIRECT works in the directory).
    """

    name = "lmcache"
    BACKEND: ClassVar[dict[str, str]] = {"cpu": "LocalCPUBackend", "disk": "LocalDiskBackend"}

    def __init__(self, paged: PagedKV, directory: str, direct: bool) -> None:
        self.version = check_lmcache()
        self.paged, self.direct = paged, direct
        self.directory = os.path.join(directory, "lmcache")
        self.tokens = torch.randint(0, 32000, (paged.max_tokens,), generator=torch.Generator().manual_seed(1))
        self._where = ""
        self._engine: Any = None

    def _engine_for(self, where: str) -> Any:
        if where != self._where:
            self._destroy()
            self._engine, self._where = self._build(where), where
        return self._engine

    def _destroy(self) -> None:
        if self._where:
            importlib.import_module("lmcache.v1.cache_engine").LMCacheEngineBuilder.destroy(f"tkv-{self._where}")
            self._where, self._engine = "", None

    def _build(self, where: str) -> Any:
        utils = importlib.import_module("lmcache.utils")
        config_mod = importlib.import_module("lmcache.v1.config")
        metadata_mod = importlib.import_module("lmcache.v1.metadata")
        connectors = importlib.import_module("lmcache.v1.gpu_connector")
        builder = importlib.import_module("lmcache.v1.cache_engine").LMCacheEngineBuilder
        shape, disk = self.paged.shape, where == "disk"
        config = config_mod.LMCacheEngineConfig.from_defaults(
            chunk_size=shape.chunk_tokens,
            local_cpu=not disk,
            # its retrieve allocates the whole prefix in pinned memory at once; its disk store holds it until written
            max_local_cpu_size=self.paged.nbytes(self.paged.max_tokens) * 1.5 / 2**30 + 0.5,
            local_disk=self.directory if disk else None,
            max_local_disk_size=1024.0 if disk else 0.0,  # a cap only: its remove() does not give space back
            extra_config={"use_odirect": self.direct, "disk_io_threads": THREADS} if disk else None,
        )
        metadata = metadata_mod.LMCacheMetadata(
            model_name="tiered-kv-peers",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=shape.dtype,
            kv_shape=(shape.layers, 2, shape.chunk_tokens, shape.kv_heads, shape.head_dim),
            chunk_size=shape.chunk_tokens,
        )
        connector = connectors.CreateGPUConnector(config, metadata, utils.EngineType.VLLM)
        engine = builder.get_or_create(
            f"tkv-{where}", config, metadata, connector, utils.mock_up_broadcast_fn, utils.mock_up_broadcast_object_fn
        )
        engine.post_init()
        return engine

    def _kwargs(self, tokens: int) -> dict[str, Any]:
        return {"kvcaches": self.paged.kv, "slot_mapping": self.paged.slot_mapping[:tokens]}

    def store(self, where: str, tokens: int) -> None:
        """``engine.store``; for disk, until ``engine.lookup`` finds every token on disk."""
        engine = self._engine_for(where)
        engine.store(self.tokens[:tokens], **self._kwargs(tokens))
        deadline = time.monotonic() + 120
        while where == "disk" and engine.lookup(self.tokens[:tokens], search_range=[self.BACKEND[where]]) < tokens:
            if time.monotonic() > deadline:
                raise RuntimeError(f"LMCache's disk store of {tokens} tokens did not finish in 120 s")
            time.sleep(0.001)

    def retrieve(self, where: str, tokens: int) -> None:
        """``engine.retrieve`` into the same blocks; every token must be found."""
        got = int(self._engine_for(where).retrieve(self.tokens[:tokens], **self._kwargs(tokens)).sum())
        if got != tokens:
            raise RuntimeError(f"LMCache retrieved {got} of {tokens} tokens from {where}")

    def forget(self, where: str, tokens: int) -> None:
        """``engine.clear(tokens, locations=[the tier's backend])``."""
        self._engine_for(where).clear(self.tokens[:tokens], locations=[self.BACKEND[where]])

    def close(self) -> None:
        """``LMCacheEngineBuilder.destroy`` of the engine; its directory removed."""
        self._destroy()
        shutil.rmtree(self.directory, ignore_errors=True)


class _Ours:
    """tiered_kv's side: one engine over the paged KV with a host pool and a file tier (slot i: the i-th block)."""

    def __init__(self, engine: TransferEngine, paged: PagedKV) -> None:
        self.engine, self.paged = engine, paged

    def _blocks(self, tokens: int) -> tuple[list[int], range]:
        n = tokens // self.paged.shape.block_tokens
        return self.paged.block_list[:n], range(n)

    async def store(self, where: str, tokens: int) -> None:
        blocks, slots = self._blocks(tokens)
        keys = [s.to_bytes(8, "little") for s in slots] if where == "disk" else None
        await self.engine.copy(Tier.GPU, blocks, Tier.HOST if where == "cpu" else Tier.FILE, slots, keys=keys)

    async def retrieve(self, where: str, tokens: int) -> None:
        blocks, slots = self._blocks(tokens)
        await self.engine.copy(Tier.HOST if where == "cpu" else Tier.FILE, slots, Tier.GPU, blocks)


class _Line:
    """The line rates: one ``copy_`` between a contiguous GPU buffer and pinned memory; raw file I/O."""

    def __init__(self, nbytes: int, device: torch.device, directory: str, direct: bool) -> None:
        self.gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.disk_buf = self.host if self.host.data_ptr() % DIRECT_ALIGN == 0 else aligned_empty(nbytes)
        self.path = os.path.join(directory, "raw-line-rate.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
        self.pool = concurrent.futures.ThreadPoolExecutor(THREADS)

    def copy(self, direction: str, nbytes: int) -> None:
        """``gpu->cpu`` or ``cpu->gpu``: one non-blocking ``copy_`` of ``nbytes``."""
        if direction == "gpu->cpu":
            self.host[:nbytes].copy_(self.gpu[:nbytes], non_blocking=True)
        else:
            self.gpu[:nbytes].copy_(self.host[:nbytes], non_blocking=True)

    def disk(self, write: bool, nbytes: int) -> None:
        """``nbytes`` written or read from offset 0, in pieces of :data:`PIECE` on :data:`THREADS` threads."""
        view = self.disk_buf[:nbytes].numpy().data
        pieces = [(view[o : o + PIECE], o) for o in range(0, nbytes, PIECE)]
        if write:
            done = [self.pool.submit(os.pwrite, self.fd, v, o) for v, o in pieces]
        else:
            done = [self.pool.submit(os.preadv, self.fd, [v], o) for v, o in pieces]
        for future in done:
            future.result()

    def close(self) -> None:
        """Close and remove the raw file."""
        self.pool.shutdown()
        os.close(self.fd)
        os.unlink(self.path)


def drop_page_cache(directory: str) -> None:
    """``posix_fadvise(DONTNEED)`` on every regular file under ``directory``."""
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue  # removed meanwhile
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def _call(fn: Callable[[], object]) -> None:
    """``fn()``, awaited when it returns an awaitable."""
    result = fn()
    if inspect.isawaitable(result):
        await result


def _timed(
    fn: Callable[[], object], cuda: bool, before: Callable[[], object] | None = None
) -> Callable[[], Awaitable[float]]:
    """A call of :func:`in_turns`: ``before()`` untimed, then the seconds of ``fn()``, GPU synchronized around."""

    async def call() -> float:
        if before is not None:
            before()
        sync(cuda)
        t0 = time.perf_counter()
        await _call(fn)
        sync(cuda)
        return time.perf_counter() - t0

    return call


async def _exact(paged: PagedKV, tokens: int, ours: Callable[[], object], peer: Callable[[], object]) -> list[bool]:
    """Whether ours and the peer's retrieve, each into zeroed blocks, give back the exact bytes.

    Ours runs again last, so the blocks hold their values whatever the peer's did.
    """
    exact = []
    for retrieve in (ours, peer, ours):
        paged.scribble(tokens)
        await _call(retrieve)
        exact.append(paged.intact(tokens))
    return [exact[0], exact[1]]


def make_row(
    kind: str, direction: str, tokens: int, nbytes: int, seconds: Sequence[Sequence[float]], exact: Sequence[bool]
) -> Row:
    """One row from ``seconds`` (tiered_kv's, the peer's, the line rate's: one per turn each) and ``exact``."""
    ours, peer, line = seconds
    return {
        "bench": kind,
        "direction": direction,
        "tokens": tokens,
        "tiered_kv_GBps": nbytes / statistics.median(ours) / 1e9,
        "peer_GBps": nbytes / statistics.median(peer) / 1e9,
        "ratio": statistics.median(p / o for p, o in zip(peer, ours, strict=True)),
        "line_GBps": nbytes / statistics.median(line) / 1e9,
        "tiered_kv_exact": exact[0],
        "peer_exact": exact[1],
        "verified": exact[0] and exact[1],
    }


async def _tier_rows(
    where: str, ours: _Ours, peer: Peer, line: _Line, lengths: Sequence[int], turns: int, directory: str, cuda: bool
) -> list[Row]:
    """One tier's store and retrieve rows, per prefix length; the peer's store after its ``forget``."""
    rows, paged = [], ours.paged
    drop = functools.partial(drop_page_cache, directory) if where == "disk" else None
    up, down = ("gpu->cpu", "cpu->gpu") if where == "cpu" else ("gpu->disk", "disk->gpu")
    for tokens in lengths:
        nbytes = paged.nbytes(tokens)
        if where == "cpu":
            line_up, line_down = (functools.partial(line.copy, d, nbytes) for d in (up, down))
        else:
            line_up, line_down = (functools.partial(line.disk, w, nbytes) for w in (True, False))
        forget = functools.partial(peer.forget, where, tokens)
        mine, theirs = (functools.partial(side.retrieve, where, tokens) for side in (ours, peer))
        store = await in_turns(
            [
                _timed(functools.partial(ours.store, where, tokens), cuda),
                _timed(functools.partial(peer.store, where, tokens), cuda, forget),
                _timed(line_up, cuda),
            ],
            turns,
        )
        load = await in_turns(
            [_timed(mine, cuda, drop), _timed(theirs, cuda, drop), _timed(line_down, cuda, drop)], turns
        )
        exact = await _exact(paged, tokens, mine, theirs)
        rows += [
            make_row(peer.name, up, tokens, nbytes, store, exact),
            make_row(peer.name, down, tokens, nbytes, load, exact),
        ]
    return rows


def _per_block_loop(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
    """The per-block copy of vLLM's CPU offload: per layer, for K and V, per block ``dst[b].copy_(src[a])``."""
    for s, d in zip(src, dst, strict=True):
        for kv in range(2):
            sk, dk = s[kv], d[kv]
            for a, b in pairs:
                dk[b].copy_(sk[a], non_blocking=True)


async def _per_block_rows(ours: _Ours, line: _Line, lengths: Sequence[int], turns: int, cuda: bool) -> list[Row]:
    """tiered_kv's GPU<->host copies next to the per-block loop between the GPU blocks and pinned per-layer tensors."""
    paged, rows = ours.paged, []
    s = paged.shape
    dims = (2, len(paged.block_list), s.block_tokens, s.kv_heads, s.head_dim)
    host = [torch.empty(dims, dtype=s.dtype, pin_memory=cuda) for _ in range(s.layers)]
    for tokens in lengths:
        nbytes = paged.nbytes(tokens)
        n = tokens // s.block_tokens
        down = list(zip(paged.block_list[:n], range(n), strict=True))
        up = [(b, a) for a, b in down]
        sides: dict[str, list[Callable[[], object]]] = {
            "gpu->cpu": [
                functools.partial(ours.store, "cpu", tokens),
                functools.partial(_per_block_loop, paged.kv, host, down),
            ],
            "cpu->gpu": [
                functools.partial(ours.retrieve, "cpu", tokens),
                functools.partial(_per_block_loop, host, paged.kv, up),
            ],
        }
        measured = {}
        for direction, (mine, loop) in sides.items():
            calls: list[Callable[[], object]] = [mine, loop, functools.partial(line.copy, direction, nbytes)]
            measured[direction] = await in_turns([_timed(c, cuda) for c in calls], turns)
        exact = await _exact(paged, tokens, *sides["cpu->gpu"])
        rows += [make_row("per_block", d, tokens, nbytes, seconds, exact) for d, seconds in measured.items()]
    return rows


async def measure(
    device: str,
    shape: KVShape,
    lengths: Sequence[int],
    turns: tuple[int, int],
    directory: str,
    make_peer: Callable[[PagedKV, str, bool], Peer],
) -> list[Row]:
    """Every row: the peer's host rows, its disk rows, then the per-block loop's.

    ``turns``: (turns of the host and per-block rows, turns of the disk rows), each after a warm-up turn.
    ``make_peer(paged, directory, direct)`` builds the peer over the same KV (``direct``: O_DIRECT works in
    ``directory``). Prefix lengths must be multiples of the chunk size.
    """
    dev = resolve_device(device).torch_device
    if not lengths or any(t % shape.chunk_tokens for t in lengths):
        raise ValueError(f"prefix lengths {list(lengths)} must be multiples of {shape.chunk_tokens} tokens")
    paged = PagedKV(shape, max(lengths), dev)
    n, cuda, direct = len(paged.block_list), dev.type == "cuda", direct_io_supported(directory)
    files = FileTierConfig(directory, n, name="peers-tiered-kv", gds="off", io_threads=THREADS, discard_mismatch=True)
    line = _Line(paged.nbytes(paged.max_tokens), dev, directory, direct)
    rows: list[Row] = []
    try:
        peer = make_peer(paged, directory, direct)
        try:
            layout = shape.layout()
            pool = flash_attn(layout, paged.kv)
            async with TransferEngine(layout, gpu_pool=pool, host_blocks=n, device=dev, file_config=files) as engine:
                ours = _Ours(engine, paged)
                for where, count in zip(("cpu", "disk"), turns, strict=True):
                    rows += await _tier_rows(where, ours, peer, line, lengths, count, directory, cuda)
                rows += await _per_block_rows(ours, line, lengths, turns[0], cuda)
        finally:
            peer.close()
    finally:
        line.close()
        _remove(directory, f"{files.name}.slab", f"{files.name}.lock")
    return rows


def _remove(directory: str, *names: str) -> None:
    """Remove the files ``names`` of ``directory`` that exist."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


def run(quick: bool = False, device: str = "auto", directory: str | None = None) -> dict[str, Any]:
    """The benchmark's result ``{"name", "machine", "rows", "notes"}``; refuses first (:func:`preflight`)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    version = preflight(device)
    lengths, turns = ((1024, 4096), (3, 3)) if quick else ((8192, 32768), (5, 3))
    directory = directory or os.environ.get("TIERED_KV_BENCH_DIR")
    tmp = None
    if directory is None:
        tmp = directory = tempfile.mkdtemp(prefix="tiered_kv-peers-")
    os.makedirs(directory, exist_ok=True)
    try:
        direct = direct_io_supported(directory)
        rows = asyncio.run(measure(device, SHAPE_8B, lengths, turns, directory, LMCachePeer))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    notes = [
        f"LMCache {version}, chunks of 256 tokens; tiered_kv blocks of 16 (file tier: gds off, host staging as "
        f"LMCache's disk); directory {directory}, O_DIRECT {'on' if direct else 'off'} for both and the raw line "
        f"rate, {THREADS} disk threads each",
        f"{turns[0]} turns (disk rows: {turns[1]}) after a warm-up turn, tiered_kv, the peer and the line rate in "
        "rotating order; ratio = median over turns of peer s / tiered_kv s; GB/s = bytes / median s",
        f"line: one pinned copy_ of the same bytes (gpu<->cpu); raw pwrite/preadv of the same bytes in {PIECE >> 20} "
        f"MiB pieces on {THREADS} threads (disk)",
    ]
    return {"name": "peers", "machine": machine_info(device), "rows": rows, "notes": notes}


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; a refusal is one line on stderr and exit status 2."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--dir", default=None)
    args, rest = parser.parse_known_args(argv)
    try:
        return bench_main("peers", lambda quick, device: run(quick, device, args.dir), rest)
    except PeerUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
