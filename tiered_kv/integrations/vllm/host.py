"""The host tier's slot table of the vLLM manager: which host block holds which key, and who may reuse it.

Primitives:

* :class:`HostEntry` -- one key in host memory: its block, its state (``"storing"``: vLLM's worker writes it,
  ``"staging"``: read from the file tier and verified, ``"ready"``: loadable), who holds or pins it, whether a
  write-through to the file tier reads it, its generation (new for every key stored or staged into a block: the
  worker verifies loads against what it stored of that generation) and whether a load of it failed verification
  (``refused``: never answered ``HIT`` again).
* :class:`HostTable` -- the entries in LRU order, the free blocks, and the rules below. No vLLM import: the
  manager (:mod:`.manager`) calls it from vLLM's single scheduler thread.

Rules (they are what keeps the engine moving with a host tier of any size):

* A block is reused only when nothing may still read or write it: an entry is *evictable* only when it is
  ``ready``, not pinned by a load, held by no request and not being written to the file tier.
* A lookup that answers ``HIT`` or ``HIT_PENDING`` *holds* its entry for that request until the request's
  ``prepare_load`` (the load pins what it reads), its end, or a reset. A lookup never evicts what an earlier
  lookup of a waiting request answered for, so a prefix longer than the free host tier is answered as a shorter
  hit (``MISS`` at the first block with no room), never by evicting its own first blocks in turn.
* After a reset vLLM drops its in-flight jobs without completing them, but its worker still finishes them (it
  flushes them at the start of the next step, before any store of that step). A block such a job may still
  write or read is *fenced*: it is handed out only as a store destination (the worker orders that store after
  the flushed job), never as the target of a file read, which the manager starts at once.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Iterator

__all__ = ["HostEntry", "HostTable"]


@dataclasses.dataclass(slots=True)
class HostEntry:
    """One key in host memory (see the module docstring)."""

    block: int
    state: str  # "storing" | "staging" | "ready"
    from_file: bool = False
    pins: int = 0
    spilling: bool = False
    holders: set[Hashable] = dataclasses.field(default_factory=set)
    fenced: bool = False  # a job dropped by a reset may still use the block: it is reused only for a store
    generation: int = -1  # the manager's generation of this key in this block (see the module docstring)
    refused: bool = False  # a load of it failed verification on the device: never served again

    @property
    def evictable(self) -> bool:
        """Ready, and nothing loads, holds or writes it through."""
        return self.state == "ready" and not self.pins and not self.holders and not self.spilling


class HostTable:
    """Host blocks ``0 .. blocks-1``: entries in LRU order (oldest first), free and fenced blocks, holds.

    Args:
        blocks: the host tier's size in vLLM blocks.
    """

    def __init__(self, blocks: int) -> None:
        self.entries: collections.OrderedDict[bytes, HostEntry] = collections.OrderedDict()
        self._free = list(range(blocks - 1, -1, -1))
        self._fenced: list[int] = []
        self._held: dict[Hashable, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.entries)

    def get(self, key: bytes) -> HostEntry | None:
        """The entry of ``key``, or ``None``."""
        return self.entries.get(key)

    def add(self, key: bytes, block: int, state: str, *, from_file: bool = False, generation: int = -1) -> HostEntry:
        """Record ``key`` in ``block`` (most recently used)."""
        e = HostEntry(block, state, from_file=from_file, generation=generation)
        self.entries[key] = e
        return e

    def remove(self, key: bytes) -> None:
        """Forget ``key``; its block is free (the caller knows nothing uses it any more)."""
        e = self.entries.pop(key)
        self._drop_holds(key, e)
        (self._fenced if e.fenced else self._free).append(e.block)

    def loading(self, blocks: set[int]) -> list[bytes]:
        """The keys of ready entries in ``blocks`` that a load is reading now (pinned)."""
        return [k for k, e in self.entries.items() if e.block in blocks and e.state == "ready" and e.pins > 0]

    def touch(self, key: bytes) -> None:
        """Mark ``key`` most recently used (if present)."""
        if key in self.entries:
            self.entries.move_to_end(key)

    # ---------------------------------------------------------------------------------- blocks

    def block_for_store(self, evicted: list[bytes]) -> int | None:
        """A block for vLLM's worker to store into; ``None`` if none now.

        A fenced block first, then a free one, then the LRU evictable entry's (its key appended to ``evicted``).
        """
        if self._fenced:
            return self._fenced.pop()
        return self._take(evicted, fenced_ok=True)

    def block_for_read(self, evicted: list[bytes]) -> int | None:
        """A block the manager may read a file slot into at once; ``None`` if none now.

        A free block, or the LRU evictable entry's; never a fenced one.
        """
        return self._take(evicted, fenced_ok=False)

    def _take(self, evicted: list[bytes], fenced_ok: bool) -> int | None:
        if self._free:
            return self._free.pop()
        for k, e in self.entries.items():  # least recently used first
            if e.evictable and (fenced_ok or not e.fenced):
                del self.entries[k]
                evicted.append(k)
                return e.block
        return None

    def oldest_spilling(self) -> bytes | None:
        """The least recently used key whose block only waits for its write-through to free (else ``None``)."""
        for k, e in self.entries.items():
            if e.spilling and e.state == "ready" and not e.pins and not e.holders:
                return k
        return None

    # ---------------------------------------------------------------------------------- holds and pins

    def hold(self, key: bytes, holder: Hashable) -> None:
        """``holder`` (a request) was answered for ``key``: keep it until :meth:`release` of that holder."""
        self.entries[key].holders.add(holder)
        self._held.setdefault(holder, set()).add(key)

    def release(self, holder: Hashable) -> None:
        """Drop every hold of ``holder``."""
        for k in self._held.pop(holder, ()):
            e = self.entries.get(k)
            if e is not None:
                e.holders.discard(holder)

    def _drop_holds(self, key: bytes, e: HostEntry) -> None:
        for h in e.holders:
            keys = self._held.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._held[h]
        e.holders.clear()

    # ---------------------------------------------------------------------------------- reset

    def reset(self) -> list[bytes]:
        """Forget every entry but those the manager's own file jobs still use (staging, spilling).

        An entry being stored or pinned by a load belongs to a vLLM job that a reset drops without completing
        (its ``complete_store`` / ``complete_load`` never comes): its block is fenced, and an entry kept for its
        write-through is unpinned and fenced. Every hold ends. Returns the forgotten keys.
        """
        self._held.clear()
        gone = []
        for k, e in list(self.entries.items()):
            e.holders.clear()
            dropped_job = e.state == "storing" or e.pins > 0
            if e.state == "staging" or e.spilling:
                e.fenced = e.fenced or dropped_job
                e.pins = 0
                continue
            del self.entries[k]
            gone.append(k)
            (self._fenced if dropped_job or e.fenced else self._free).append(e.block)
        return gone
