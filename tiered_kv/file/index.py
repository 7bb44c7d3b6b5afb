"""The slot index of the file tier and its state machine: the one place where a slot becomes valid or is dropped.

Primitives:

* :class:`SlotState` -- ``EMPTY`` -> ``PENDING`` (a write claimed the slot) -> ``VALID`` (every block of the
  write landed) or back to ``EMPTY`` (the write failed, a read failed verification, the slot was discarded).
* :class:`SlotIndex` -- per slot: state, content key, generation; ``key -> valid slot``; tombstones of failed
  writes. Reads: :meth:`~SlotIndex.lookup`, :meth:`~SlotIndex.key_of`, :meth:`~SlotIndex.entries`, ...
  Transitions: :meth:`~SlotIndex.recover` (open), :meth:`~SlotIndex.claim` (``copy()`` into the tier),
  :meth:`~SlotIndex.finish_write` (the write's completion), :meth:`~SlotIndex.drop_if` (a read that failed
  verification), :meth:`~SlotIndex.discard` (the user). Nothing else changes a slot's state.

Thread safety: every method takes the index's lock; transitions come from the loop (``claim``, ``discard``)
and from I/O threads (``finish_write``, ``drop_if``).

Order: a transition decided on an I/O thread is *applied* on the engine's event loop,
through :attr:`SlotIndex.events` (:mod:`tiered_kv.slotstate`), between two loop steps, and every slot it
gives up is announced there to the listeners (the cache's block manager) in the same step -- so a planner on
the loop never sees a slot change in the middle of issuing a plan, and hears of a dropped slot before the
failed copy that dropped it completes. The tombstone of a failed write is set at once on the I/O thread: it
is what reads are verified against, and it only ever makes reads fail.
"""

from __future__ import annotations

import enum
import functools
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from ..slab import Key, normalize_key
from ..slotstate import SlotEvent, SlotEvents

__all__ = ["SlotIndex", "SlotState"]


class SlotState(enum.IntEnum):
    """The state of one slot."""

    EMPTY = 0
    PENDING = 1
    VALID = 2


_EMPTY, _PENDING, _VALID = SlotState.EMPTY.value, SlotState.PENDING.value, SlotState.VALID.value


class SlotIndex:
    """What each slot of the slab holds (see the module docstring).

    Args:
        num_slots: slots in the slab.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._state = np.zeros(num_slots, dtype=np.int8)  # slot -> SlotState
        self._keys: list[Key | None] = [None] * num_slots  # slot -> key (valid or pending)
        self._gens = [0] * num_slots  # slot -> generation of the valid or pending content
        self._by_key: dict[Key, int] = {}  # content key -> valid slot
        self._failed_gen: dict[int, int] = {}  # slot -> generation of its last failed write (a tombstone)
        self._next_gen = 1
        self.events = SlotEvents()  # SLOT STATE HOOK: I/O-thread transitions reach the loop here, in order

    # ------------------------------------------------------------------------------------ reads

    def lookup(self, key: Key) -> int | None:
        """The slot holding a verified-at-open or completely written block with ``key``, or ``None``."""
        with self._lock:
            return self._by_key.get(normalize_key(key))

    def key_of(self, slot: int) -> Key | None:
        """The key of a valid slot, else ``None`` (pending and empty slots have none yet)."""
        self.check_slot(slot)
        with self._lock:
            return self._keys[slot] if self._state[slot] == _VALID else None

    def state(self, slot: int) -> SlotState:
        """The state of ``slot``."""
        self.check_slot(slot)
        return SlotState(int(self._state[slot]))

    def entries(self) -> dict[Key, int]:
        """A copy of the index: content key -> valid slot."""
        with self._lock:
            return dict(self._by_key)

    def free_slots(self) -> list[int]:
        """Slots that hold nothing (neither valid nor pending), ascending."""
        return [int(i) for i in np.flatnonzero(self._state == _EMPTY)]

    def counts(self) -> tuple[int, int]:
        """(valid slots, pending slots)."""
        with self._lock:
            return int((self._state == _VALID).sum()), int((self._state == _PENDING).sum())

    def check_slot(self, slot: int) -> None:
        """Raise ``TypeError``/``ValueError`` unless ``slot`` is an int in range."""
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
            raise TypeError(f"a file slot must be an int, got {type(slot).__name__}")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"file slot {slot} is out of range for the file tier of {self.num_slots} slots")

    def check_readable(self, slots: Sequence[int], keys: Sequence[Key] | None) -> None:
        """Raise ``ValueError`` unless every slot holds a block (valid or pending), with ``keys[j]`` if given."""
        with self._lock:
            for j, slot in enumerate(slots):
                if self._state[slot] == _EMPTY:
                    raise ValueError(
                        f"file slot {slot} holds no block (never written, discarded or failed verification)"
                    )
                if keys is not None and self._keys[slot] != keys[j]:
                    raise ValueError(f"file slot {slot} holds key {self._keys[slot]!r}, not {keys[j]!r}")

    def expected(self, slots: Sequence[int]) -> tuple[list[Key], list[int]]:
        """The keys and generations that reads of ``slots`` must find (the slots were checked readable)."""
        with self._lock:
            keys = [self._keys[i] for i in slots]
            gens = [self._gens[i] for i in slots]
        assert all(k is not None for k in keys)
        return keys, gens  # type: ignore[return-value]  # checked just above

    def failed_generation(self, slot: int) -> int | None:
        """The generation of ``slot``'s last failed write (a read expecting it must fail), or ``None``."""
        return self._failed_gen.get(slot)

    # ------------------------------------------------------------------------------------ transitions

    def recover(self, entries: Iterable[tuple[int, Key, int]], next_generation: int) -> None:
        """At open: ``(slot, key, generation)`` verified from the slab become valid; generations continue after."""
        with self._lock:
            for slot, key, gen in entries:
                self._state[slot] = _VALID
                self._keys[slot] = key
                self._gens[slot] = gen
                self._by_key[key] = slot
            self._next_gen = max(self._next_gen, next_generation)

    def claim(self, slots: Sequence[int], keys: Sequence[Key]) -> list[int]:
        """A write into ``slots`` was accepted: they become pending (lookups stop returning them); their generations."""
        gens: list[int] = []
        with self._lock:
            for slot, key in zip(slots, keys, strict=True):
                self._drop_locked(slot)
                gen = self._next_gen
                self._next_gen += 1
                self._state[slot] = _PENDING
                self._keys[slot] = key
                self._gens[slot] = gen
                gens.append(gen)
        return gens

    def finish_write(self, slots: Sequence[int], gens: Sequence[int], ok: bool) -> None:
        """The write that claimed ``slots`` (with ``gens``) finished: valid if ``ok``, else empty (and tombstoned).

        The tombstones change now; the states on the loop (:attr:`events`), where dropped slots are announced.
        """
        with self._lock:
            for slot, gen in zip(slots, gens, strict=True):
                if ok:
                    if self._failed_gen.get(slot, gen) < gen:
                        del self._failed_gen[slot]  # an older failed write of the slot is overwritten
                else:
                    # Reads enqueued behind this write (they expect ``gen``) must fail even if this slot's own
                    # block made it to disk: the transfer failed, so its slots hold nothing. A later write of
                    # the slot starts only after those reads, so one tombstone per slot is enough.
                    self._failed_gen[slot] = gen
        self.events.post(functools.partial(self._apply_write, list(slots), list(gens), ok))

    def _apply_write(self, slots: list[int], gens: list[int], ok: bool) -> list[SlotEvent]:
        dropped: list[SlotEvent] = []
        with self._lock:
            for slot, gen in zip(slots, gens, strict=True):
                if self._state[slot] != _PENDING or self._gens[slot] != gen:
                    continue  # a later copy has claimed the slot since
                key = self._keys[slot]
                assert key is not None
                if ok:
                    other = self._by_key.get(key)
                    if other is not None and other != slot:
                        self._drop_locked(other)  # the newest copy of a key wins
                    self._state[slot] = _VALID
                    self._by_key[key] = slot
                else:
                    self._drop_locked(slot)
                    dropped.append(SlotEvent(slot, key, gen, "write failed"))
        return dropped

    def drop_if(self, slot: int, gen: int) -> None:
        """A read of ``slot`` expecting ``gen`` failed verification.

        Drop the slot unless it was claimed since (on the loop).
        """
        self.events.post(functools.partial(self._apply_drop, slot, gen))

    def _apply_drop(self, slot: int, gen: int) -> list[SlotEvent]:
        with self._lock:
            if self._state[slot] == _EMPTY or self._gens[slot] != gen:
                return []
            key = self._keys[slot]
            self._drop_locked(slot)
        return [SlotEvent(slot, key, gen, "verification failed")] if key is not None else []

    def discard(self, slot: int) -> None:
        """Forget a valid slot (index only: the bytes stay and a restart may index them again).

        Raises:
            ValueError: the slot is pending (a write is in flight) or out of range.
        """
        self.check_slot(slot)
        with self._lock:
            if self._state[slot] == _PENDING:
                raise ValueError(f"file slot {slot} has a write in flight; await it before discarding the slot")
            key, gen = self._keys[slot], self._gens[slot]
            self._drop_locked(slot)
        if key is not None:
            self.events.emit(SlotEvent(slot, key, gen, "discarded"))

    def _drop_locked(self, slot: int) -> None:
        key = self._keys[slot]
        if key is not None and self._by_key.get(key) == slot:
            del self._by_key[key]
        self._state[slot] = _EMPTY
        self._keys[slot] = None

    def __repr__(self) -> str:
        valid, pending = self.counts()
        return f"<SlotIndex slots:{self.num_slots} valid:{valid} pending:{pending}>"
