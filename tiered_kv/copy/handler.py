"""The handler of the memory pairs: GPU and pinned-host pools copied on the engine's streams.

Primitives:

* :class:`StreamCopier` -- the :class:`~tiered_kv.handlers.TransferHandler` of GPU->HOST (the *offload*
  stream), HOST->GPU (the *onboard* stream, so both PCIe directions are busy at once), GPU->GPU (the *local*
  stream) and HOST->HOST (host threads). Each batch is one op built by :class:`~tiered_kv.copy.copier.Copier`
  (DMA or the copy kernel, chosen per call).
* :data:`STREAM_ROUTES` -- pair -> stream name (``None``: host threads).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence

import numpy as np

from ..device import Event, Stream
from ..handlers import Batch, Done, Medium
from ..layer_major import LayerMajorPool, LayerSlice
from ..pools import BlockPool, Tier
from .copier import Copier, Op, Pool, Side
from .native import NativeCopy

__all__ = ["STREAM_ROUTES", "StreamCopier"]

#: (source tier, destination tier) -> the stream that runs the copy; ``None`` means host threads.
STREAM_ROUTES: dict[tuple[Tier, Tier], str | None] = {
    (Tier.GPU, Tier.HOST): "offload",
    (Tier.HOST, Tier.GPU): "onboard",
    (Tier.GPU, Tier.GPU): "local",
    (Tier.HOST, Tier.HOST): None,
}


class _StreamJob:
    """One op queued on a stream; ``done`` is called by the stream's completion callback.

    ``beside``: its completion signal must not hold up the work queued after it (``Stream.notify``): the batch's
    ``more_follows`` (the layer groups of one copy, which follow each other on one stream).
    """

    __slots__ = ("beside", "errors", "lane", "op")

    def __init__(self, lane: Stream, op: Op) -> None:
        self.lane: Stream | None = lane
        self.op = op
        self.beside = False
        self.errors: list[BaseException] = []  # what the op raised (by the time its event is reached)

    def ok_at_event(self) -> bool:
        """True when the op raised nothing: reaching its event is its whole completion (``Job.ok_at_event``).

        On a CUDA stream the op runs at ``start``; on the emulated device before the event is set (FIFO).
        """
        return not self.errors

    def error_at_event(self) -> BaseException | None:
        """The error ``done`` will report, known once the event is reached (``Job.error_at_event``)."""
        return self.errors[0] if self.errors else None

    def start(self, done: Done) -> Event:
        op = self.op
        lane = self.lane
        assert lane is not None
        error = self.errors

        def run() -> None:
            try:
                op()
            except BaseException as exc:  # reported through done()
                error.append(exc)

        lane.submit(run, explicit=getattr(op, "explicit_stream", False))
        nbytes = getattr(op, "nbytes", 0)  # what the op moves: the stream expects its end from it
        return lane.notify(lambda: done(error[0] if error else None), beside=self.beside, nbytes=nbytes)


class _HostJob:
    """One op run on a host thread (HOST->HOST)."""

    __slots__ = ("lane", "op", "threads")

    def __init__(self, threads: concurrent.futures.ThreadPoolExecutor, op: Op) -> None:
        self.lane: Stream | None = None
        self.threads = threads
        self.op = op

    def start(self, done: Done) -> None:
        op = self.op

        def run() -> None:
            try:
                op()
            except BaseException as exc:  # reported through done()
                done(exc)
                return
            done(None)

        self.threads.submit(run)


class StreamCopier:
    """Copies between the engine's GPU and host pools on its streams (see the module docstring).

    Args:
        pools: the engine's memory pools (``Tier.GPU`` / ``Tier.HOST``), owned by the engine.
        streams: the engine's copy streams by name (``offload``, ``onboard``, ``local``).
        copier: builds the op of each batch (path choice per call).
        host_threads: how many threads run HOST->HOST copies.
    """

    def __init__(
        self, pools: Mapping[Tier, Pool], streams: Mapping[str, Stream], copier: Copier, host_threads: int
    ) -> None:
        self._pools = pools
        self._streams = streams
        self.copier = copier
        self._threads = concurrent.futures.ThreadPoolExecutor(host_threads, thread_name_prefix="tiered_kv-host")

    @property
    def routes(self) -> Sequence[tuple[Tier, Tier]]:
        """The four memory pairs."""
        return list(STREAM_ROUTES)

    @property
    def media(self) -> Mapping[Tier, Medium]:
        """None: the pools belong to the engine."""
        return {}

    def validate(self, batch: Batch) -> Batch:
        """Memory copies take no keys; ``layers`` needs block-major or layer-major pools on both sides.

        Raises:
            ValueError: ``keys`` given, or ``layers`` with a pool of another kind (a chunked pool).
        """
        if batch.keys is not None:
            raise ValueError("keys are only used by copies to or from the file tier")
        if batch.layers is not None:
            for tier in (batch.src_tier, batch.dst_tier):
                if not isinstance(self._pools[tier], (BlockPool, LayerMajorPool)):
                    raise ValueError(
                        f"layers= needs block-major or layer-major pools; the {tier.value} pool is neither"
                    )
        return batch

    def prepare(self, batch: Batch) -> _StreamJob | _HostJob | NativeCopy:
        """The batch's op, on its stream (or for a host thread)."""
        src: Side = self._pools[batch.src_tier]
        dst: Side = self._pools[batch.dst_tier]
        n = None if batch.num_tokens == src.layout.tokens_per_block else batch.num_tokens  # whole blocks
        if batch.layers is not None:  # layers [start, stop) of every block: views, fences stay per block
            assert not isinstance(src, LayerSlice) and not isinstance(dst, LayerSlice)  # pools here
            src = self.copier.layer_slice(src, *batch.layers)
            dst = self.copier.layer_slice(dst, *batch.layers)
        op = self.build_op(src, batch.src, dst, batch.dst, n, batch.runs)
        if type(op) is NativeCopy:  # a job of its own: one call into C++ issues the copy, its event and completion
            op.beside = batch.more_follows
            return op
        lane = STREAM_ROUTES[(batch.src_tier, batch.dst_tier)]
        if lane is None:
            return _HostJob(self._threads, op)
        job = _StreamJob(self._streams[lane], op)
        job.beside = batch.more_follows
        return job

    def build_op(
        self,
        src_pool: Side,
        s: np.ndarray | list[int],
        dst_pool: Side,
        d: np.ndarray | list[int],
        n: int | None,
        runs: int | None = None,
    ) -> Op:
        """The op of one copy call: DMA or the copy kernel, chosen per call by :mod:`tiered_kv.copy.copier`.

        The op knows its stream (a small call names it by handle, see :meth:`Copier.build`). ``runs``: the runs of
        consecutive pairs, when the caller counted them.
        """
        lane = STREAM_ROUTES[(src_pool.tier, dst_pool.tier)]
        stream = self._streams[lane] if lane is not None else None
        return self.copier.build(src_pool, s, dst_pool, d, n, stream=stream, runs=runs)

    def close(self) -> None:
        """Stop the host threads and free the native copy plans (after the engine drained). Idempotent."""
        self._threads.shutdown(wait=True)
        self.copier.close()

    def __repr__(self) -> str:
        return f"<StreamCopier {self.copier!r}>"
