"""The file tier as a transfer handler: every pair with FILE on one side (HOST<->FILE, GPU<->FILE).

Primitives:

* :class:`FileHandler` -- the :class:`~tiered_kv.handlers.TransferHandler` of the file tier: validates keys
  and slot states (:meth:`~FileHandler.validate`), claims destination slots at ``copy()`` time and returns
  the batch's :class:`~tiered_kv.file.pipeline.FileCopy` (:meth:`~FileHandler.prepare`). GPU legs run on the
  engine's offload (GPU->FILE) and onboard (FILE->GPU) streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence

from ..copyops import Copier, Pool
from ..device import Stream
from ..handlers import Batch, Medium
from ..pools import Tier
from ..slab import Key, normalize_key
from .pipeline import FileCopy
from .tier import FileTier

__all__ = ["FILE_ROUTES", "FileHandler"]

#: The pairs the file tier moves (file to file is not one of them).
FILE_ROUTES: tuple[tuple[Tier, Tier], ...] = (
    (Tier.HOST, Tier.FILE),
    (Tier.FILE, Tier.HOST),
    (Tier.GPU, Tier.FILE),
    (Tier.FILE, Tier.GPU),
)


class FileHandler:
    """Routes file-tier copies to the tier's I/O pipeline.

    Args:
        tier: the file tier (owned: closed with the handler).
        pools: the engine's memory pools (the other side of every copy).
        streams: the engine's copy streams (``offload``, ``onboard``) for the GPU legs.
        copier: the engine's copier (gathers/scatters layer-major GPU blocks through staging).
    """

    def __init__(self, tier: FileTier, pools: Mapping[Tier, Pool], streams: Mapping[str, Stream], copier: Copier) -> None:
        self.tier = tier
        self._pools = pools
        self._streams = streams
        self._copier = copier

    @property
    def routes(self) -> Sequence[tuple[Tier, Tier]]:
        """HOST<->FILE and GPU<->FILE."""
        return FILE_ROUTES

    @property
    def media(self) -> Mapping[Tier, Medium]:
        """The file tier."""
        return {Tier.FILE: self.tier}

    def validate(self, batch: Batch) -> Batch:
        """Keys and slot states; returns the batch with normalized keys (no side effects).

        Raises:
            ValueError / TypeError: with a sentence; see :meth:`TransferEngine.copy`.
        """
        if self.tier.closed:
            raise ValueError("the file tier is closed")
        if batch.num_tokens is not None:
            raise ValueError("num_tokens is not supported for copies to or from the file tier: file slots hold whole blocks")
        keys = batch.keys
        norm: tuple[Key, ...] | None = None
        if keys is not None:
            if isinstance(keys, (bytes, bytearray, memoryview, str, int)) or not isinstance(keys, Iterable):
                raise TypeError(f"keys must be a sequence of content keys, one per block, got {type(keys).__name__}")
            norm = tuple(normalize_key(k) for k in keys)  # type: ignore[arg-type]  # normalize_key says what is wrong
            if len(norm) != batch.size:
                raise ValueError(f"got {len(norm)} keys for {batch.size} blocks; give one content key per block")
        if batch.dst_tier is Tier.FILE:
            if norm is None and batch.size:
                raise ValueError("copies into the file tier need keys=[content key per block]: the key is written into "
                                 "each slot's header and is how the block is found again (also after a restart)")
            if norm is not None and len(set(norm)) != len(norm):
                raise ValueError("keys contain duplicates; one slot per content key")
        else:
            self.tier.index.check_readable(batch.lists()[0], norm)
        return Batch(batch.src_tier, batch.src, batch.dst_tier, batch.dst, batch.num_tokens, norm)

    def prepare(self, batch: Batch) -> FileCopy:
        """Writes claim their slots now (pending: lookups stop returning them); the copy starts later."""
        if batch.dst_tier is Tier.FILE:
            keys: list[Key] = [k for k in batch.keys or () if isinstance(k, (bytes, str, int))]  # normalized by validate()
            assert len(keys) == batch.size
            stream = self._streams["offload"] if batch.src_tier is Tier.GPU else None
            src, dst = batch.lists()
            return self.tier.write_batch(self._pools[batch.src_tier], src, dst, keys, stream, self._copier)
        stream = self._streams["onboard"] if batch.dst_tier is Tier.GPU else None
        src, dst = batch.lists()
        return self.tier.read_batch(self._pools[batch.dst_tier], dst, src, stream, self._copier)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """SLOT STATE HOOK: the tier's index applies I/O-thread transitions on the engine's loop, in order."""
        self.tier.index.events.bind(loop)

    def close(self) -> None:
        """Close the file tier. Idempotent."""
        self.tier.close()

    def __repr__(self) -> str:
        return f"<FileHandler {self.tier.path}>"
