"""What both sides of the vLLM integration share: settings, the host region, content keys, the spec type.

Primitives:

* :class:`Settings` -- the spec's own keys of ``kv_connector_extra_config`` (``host_blocks``, ``file_dir``,
  ``file_blocks``, ``shm_dir``), validated.
* :class:`TieredKVLoadStoreSpec` -- host block indices (the same index in every rank's shared host region) and the
  generation of each block's entry (the worker verifies a load against what it stored of that generation).
* :func:`block_layout` -- one vLLM block (all layers of one worker) as opaque bytes.
* :func:`rank_salt` / :func:`content_key` -- the file tier's content key of a vLLM offload key: salted with
  the model, KV dtype, KV cache layout, bytes per block and the parallel layout including the rank.
* :func:`host_path` / :func:`map_host` -- the shared host region of one rank (the scheduler's manager and the
  rank's worker map the same file).
* :func:`await_all` -- await every transfer of a list, then raise the first failure.
* :func:`tiering_base` -- ``vllm.v1.kv_offload.tiering.base`` (the secondary-tier API), imported on use.
* :data:`LookupResult` -- vLLM's lookup answers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...file import FileTierConfig
from ...layout import KVLayout
from ._compat import ConfigFields, base

__all__ = [
    "LookupResult",
    "Settings",
    "TieredKVLoadStoreSpec",
    "await_all",
    "block_layout",
    "content_key",
    "host_path",
    "map_host",
    "rank_salt",
    "tiering_base",
]

LookupResult = base.LookupResult


def tiering_base() -> Any:
    """``vllm.v1.kv_offload.tiering.base`` (the secondary-tier API)."""
    from vllm.v1.kv_offload.tiering import base as tiering

    return tiering


class TieredKVLoadStoreSpec(base.BlockIDsLoadStoreSpec):
    """Host block indices (the same index in every rank's shared host region) and their entries' generations.

    Args:
        block_ids: host block indices.
        generations: the manager's generation of each block's entry (a new one each time a key is stored into or
            staged into a host block), or ``None``.
    """

    def __init__(self, block_ids: list[int], generations: list[int] | None = None) -> None:
        super().__init__(block_ids)
        self.generations = None if generations is None else np.asarray(generations, dtype=np.int64)
        if self.generations is not None and self.generations.size != self.block_ids.size:
            raise ValueError(f"{self.block_ids.size} host blocks and {self.generations.size} generations")

    @staticmethod
    def medium() -> str:
        return "CPU"


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """The spec's own keys of ``kv_connector_extra_config``."""

    host_blocks: int
    file_dir: str | None
    file_blocks: int
    shm_dir: str
    file_timeout: float | None = None
    """Seconds one file I/O call may take (``FileTierConfig.timeout``); ``None``: the file tier's default."""

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> Settings:
        """Validate the extra config (``ValueError`` with a sentence on a bad value)."""

        def integer(name: str, default: int | None) -> int:
            value = extra.get(name, default)
            if value is None or isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be a non-negative int, got {value!r}")
            return value

        host = integer("host_blocks", None)
        if host < 1:
            raise ValueError("kv_connector_extra_config['host_blocks'] must be >= 1")
        file_dir = extra.get("file_dir")
        file_blocks = integer("file_blocks", 0)
        if (file_dir is None) != (file_blocks == 0):
            raise ValueError("give both 'file_dir' and 'file_blocks' for a file tier (or neither)")
        timeout = extra.get("file_timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or
                                    not 0 < timeout < float("inf")):
            raise ValueError(f"kv_connector_extra_config['file_timeout'] must be a positive number, got {timeout!r}")
        return cls(
            host, None if file_dir is None else str(file_dir), file_blocks, str(extra.get("shm_dir", "/dev/shm")),
            None if timeout is None else float(timeout),
        )

    def file_config(self, directory: Path) -> FileTierConfig:
        """The file tier of one rank: the environment's knobs, and ``file_timeout`` if given."""
        extra = {} if self.file_timeout is None else {"timeout": self.file_timeout}
        return FileTierConfig.from_env(directory, self.file_blocks, **extra)


def block_layout(bytes_per_block: int) -> KVLayout:
    """One vLLM block (all layers of one worker) as opaque bytes."""
    return KVLayout(
        num_layers=1, num_kv_heads=1, head_dim=bytes_per_block, tokens_per_block=1, dtype=torch.uint8, kv_factor=1
    )


def rank_salt(f: ConfigFields, rank: int) -> bytes:
    """What salts one rank's content keys (``rank=-1``: every rank's bytes of a chunk, the secondary tier)."""
    text = (
        f"tiered_kv-vllm|model={f.model}|dtype={f.dtype}|layout={f.kv_cache_layout}|bytes={f.bytes_per_block}"
        f"|tokens={f.tokens_per_block}|tp={f.tp_size}|pp={f.pp_size}|world={f.world_size}|rank={rank}"
    )
    return text.encode()


def content_key(salt: bytes, key: bytes) -> bytes:
    """The file tier's content key of one vLLM offload key for one rank."""
    return hashlib.blake2b(salt + b"|" + bytes(key), digest_size=16).digest()


def host_path(s: Settings, f: ConfigFields, rank: int) -> Path:
    """The file of one rank's shared host region (in ``shm_dir``, named after the engine id)."""
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in f.engine_id)
    return Path(s.shm_dir) / f"tiered_kv-{safe}-rank{rank}.host"


def map_host(path: Path, blocks: int, layout: KVLayout) -> torch.Tensor:
    """The shared host region of one rank (created, or opened if the other side made it first)."""
    size = blocks * layout.bytes_per_block
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)
    flat = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
    return flat.view(blocks, *layout.block_shape)


async def await_all(transfers: list[Any]) -> None:
    """Await every transfer (all of them, even after one fails); raise the first failure."""
    error: BaseException | None = None
    for t in transfers:
        try:
            await t
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error
