"""The one seam between the engine and the media: transfer handlers, routed by (source tier, destination tier).

The :class:`~tiered_kv.TransferEngine` keeps what every copy has in common -- validation of the public
arguments (tiers, indices, duplicates, ``num_tokens``), the fence table, completion markers, statistics and
cancellation semantics -- and hands each batch to the handler its medium pair is routed to. A handler knows
how to move blocks between the media it serves and nothing about fences or the event loop.

Primitives:

* :class:`Medium` -- what the engine needs of a medium (a pool of blocks or a tier of slots): ``name`` (the
  fence-table key), ``num_blocks``, ``check(indices, what)``.
* :class:`Batch` -- one validated copy call: source and destination tier and indices, ``num_tokens``, keys.
* :class:`Job` -- a prepared batch: the ``lane`` (stream) it completes on, or ``None``, and ``start(done)``.
* :class:`TransferHandler` -- the protocol: ``routes``, ``media``, ``validate``, ``prepare``, ``close``.
* :class:`Routes` -- the routing table; refuses a second handler for a pair (and a second owner of a medium).

The protocol, step by step, for ``engine.copy(src_tier, s, dst_tier, d, num_tokens=..., keys=...)``:

1. The engine coerces the tiers, looks up both media (a pool of the engine or a medium a handler owns),
   checks the indices against them, refuses duplicate destinations and a block that is both source and
   destination, and checks ``num_tokens``. It then finds the handler routed to ``(src_tier, dst_tier)``;
   an unrouted pair is a ``ValueError``.
2. ``handler.validate(batch)`` checks what only the handler knows (keys, the state of file slots, ...) and
   returns the batch it will copy (e.g. with keys normalized). It raises ``ValueError`` / ``TypeError``
   and has no side effects: nothing is enqueued when it raises.
3. ``handler.prepare(batch)`` is called once the copy is accepted, on the loop thread, at ``copy()`` time.
   It commits what must be visible at once (the file tier marks destination slots pending, so lookups stop
   returning them) and returns a :class:`Job`. It must not fail for a validated batch.
4. The engine registers the job in the fence table. When the job's dependencies are met it calls
   ``job.start(done)`` -- on the loop thread, at ``copy()`` time or later. For a job with a ``lane``, the
   engine has already made the lane wait (stream-side) for the stream dependencies; ``start`` queues the
   work on that lane and returns the event recorded after it, which later stream copies wait on. A job
   without a lane returns ``None`` (later copies wait for it on the loop). Either way ``done(error)`` is
   called exactly once, from any thread, when the work has finished (``error`` is ``None`` on success);
   ``start`` returns at once and never blocks on the work. An exception raised by ``start`` itself fails
   the transfer. A job with a lane may also have ``ok_at_event() -> bool`` (asked on the loop once its event
   is reached): True when ``done(None)`` is all that its completion will do, so the engine may complete it
   from the event (an awaited copy about to end is polled by the loop, :class:`~tiered_kv.completions.EventPoller`)
   and ``done`` then only confirms it. Without it, only ``done`` completes the job. A job whose ``ok_at_event`` is
   False may have ``error_at_event() -> BaseException | None``: the error its ``done`` will report. A later copy that
   waited for the job's event stream-side completes the job with it when it completes first (else a generic
   :class:`~tiered_kv.errors.TransferError`): a failed copy never reads as a success. A copy that reads a block
   whose pending write failed fails too (so does every copy that reads what it wrote): a job may have
   ``abort(error)``, called instead of ``start`` when that is known before it starts, which undoes what
   ``prepare`` committed (the file tier's pending slots); a job without it is started, and reported failed.
5. ``handler.close()`` is called by ``engine.close()`` after every copy has completed.

A new tier is one more handler and one more route: give the engine a handler (``TransferEngine(...,
handlers=[...])``) whose ``media`` holds the new tier's medium and whose ``routes`` name the pairs it moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from .device import Event, Stream
from .pools import Tier

__all__ = ["Batch", "Done", "Job", "Medium", "Routes", "TransferHandler"]

Done = Callable[[BaseException | None], None]
"""Called once when a job has finished: ``None`` on success, else the error."""


@runtime_checkable
class Medium(Protocol):
    """What the engine needs of a medium: a name for the fence table, a size, a bounds check."""

    @property
    def name(self) -> str:
        """The fence-table key of the medium's blocks (``"gpu"``, ``"host"``, ``"file"``)."""
        ...

    @property
    def num_blocks(self) -> int:
        """Blocks (or slots) the medium holds."""
        ...

    def check(self, indices: np.ndarray, what: str) -> None:
        """Raise ``ValueError`` unless every index is in ``[0, num_blocks)``."""
        ...


@dataclasses.dataclass(slots=True)
class Batch:
    """One copy call, its public arguments validated by the engine.

    Attributes:
        src_tier: where the blocks come from.
        src: source block indices (int64, validated against the source medium).
        dst_tier: where they go.
        dst: destination block indices, one per source, no duplicates.
        num_tokens: copy only tokens ``[0, num_tokens)`` of every (layer, kv, head); ``None``: whole blocks.
        keys: content keys as the caller gave them (``None`` if none); a handler that uses keys returns a
            batch with them normalized (a tuple, one per block) from :meth:`TransferHandler.validate`.
        layers: copy only layers ``[start, stop)`` of each block; ``None``: every layer (the engine passes a
            range only to the memory handler).
        more_follows: more of the same copy is queued right behind this batch on its lane (the layer groups of
            one load): a handler signals its completion without holding up the lane (``Stream.notify(beside=True)``).
        runs: the runs of pairs consecutive on both sides, when the engine counted them (its small calls between
            memory pools); ``None``: not counted.

    Notes:
        ``src``/``dst`` are int64 arrays, or int lists on the engine's per-call fast path (memory pairs only).
    """

    src_tier: Tier
    src: np.ndarray | list[int]
    dst_tier: Tier
    dst: np.ndarray | list[int]
    num_tokens: int | None = None
    keys: Iterable[object] | None = None
    layers: tuple[int, int] | None = None
    more_follows: bool = False
    runs: int | None = None

    @property
    def size(self) -> int:
        """Blocks in the batch."""
        return len(self.src)

    def lists(self) -> tuple[list[int], list[int]]:
        """``(src, dst)`` as int lists (whatever form the engine passed)."""
        src = self.src if isinstance(self.src, list) else self.src.tolist()
        dst = self.dst if isinstance(self.dst, list) else self.dst.tolist()
        return src, dst


class Job(Protocol):
    """A prepared batch (see the module docstring, step 4)."""

    @property
    def lane(self) -> Stream | None:
        """The stream the job's work is queued on (stream-side fences), or ``None`` (completion by callback)."""
        ...

    def start(self, done: Done) -> Event | None:
        """Start the work and return at once: the event recorded after it on ``lane``, else ``None``."""
        ...


class TransferHandler(Protocol):
    """Moves blocks between the media of the pairs routed to it (see the module docstring)."""

    @property
    def routes(self) -> Sequence[tuple[Tier, Tier]]:
        """The (source tier, destination tier) pairs this handler moves."""
        ...

    @property
    def media(self) -> Mapping[Tier, Medium]:
        """The media this handler owns (for example the file tier); pools the engine owns are not listed."""
        ...

    def validate(self, batch: Batch) -> Batch:
        """Handler-specific checks; returns the batch to copy. ``ValueError``/``TypeError``, no side effects."""
        ...

    def prepare(self, batch: Batch) -> Job:
        """Commit the copy (on the loop thread, at ``copy()`` time) and return its job."""
        ...

    def close(self) -> None:
        """Release threads and files; called once every copy has completed. Idempotent."""
        ...


class Routes:
    """The routing table: ``(source tier, destination tier) -> handler``.

    Raises:
        ValueError: a pair routed twice, or a medium owned by two handlers (or by a handler and the engine).
    """

    def __init__(self, owned: Iterable[Tier] = ()) -> None:
        self._routes: dict[tuple[Tier, Tier], TransferHandler] = {}
        self._media: dict[Tier, Medium] = {}
        self._owned = set(owned)  # media the engine itself holds (its memory pools)
        self._handlers: list[TransferHandler] = []

    def add(self, handler: TransferHandler) -> None:
        """Route every pair of ``handler.routes`` to it and register the media it owns."""
        pairs = list(handler.routes)
        for pair in pairs:
            if pair in self._routes:
                raise ValueError(f"{pair[0].value}->{pair[1].value} is already routed to {self._routes[pair]!r}")
        for tier in handler.media:
            if tier in self._media or tier in self._owned:
                raise ValueError(f"the {tier.value} medium already has an owner")
        self._routes.update(dict.fromkeys(pairs, handler))
        self._media.update(handler.media)
        self._handlers.append(handler)

    def get(self, src: Tier, dst: Tier) -> TransferHandler | None:
        """The handler of a pair, or ``None``."""
        return self._routes.get((src, dst))

    @property
    def media(self) -> Mapping[Tier, Medium]:
        """Media owned by the handlers."""
        return self._media

    @property
    def handlers(self) -> list[TransferHandler]:
        """Every handler, in the order added."""
        return list(self._handlers)

    def __contains__(self, pair: object) -> bool:
        return pair in self._routes

    def __repr__(self) -> str:
        pairs = ", ".join(f"{a.value}->{b.value}" for a, b in self._routes)
        return f"<Routes {pairs}>"
