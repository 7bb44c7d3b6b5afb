"""The vLLM manager's host slot table (no vLLM needed): holds, pins, write-throughs and resets decide reuse."""

from __future__ import annotations

from tiered_kv.integrations.vllm.host import HostTable


def _filled(blocks: int) -> HostTable:
    t = HostTable(blocks)
    for i in range(blocks):
        e = t.add(bytes([i]), t.block_for_read([]) or 0, "ready")
        assert e.evictable
    return t


def test_held_pinned_and_spilling_blocks_are_not_reused() -> None:
    t = _filled(3)
    t.hold(b"\x00", "r")
    t.get(b"\x01").pins = 1  # type: ignore[union-attr]
    t.get(b"\x02").spilling = True  # type: ignore[union-attr]
    assert t.block_for_read([]) is None and t.block_for_store([]) is None
    assert t.oldest_spilling() == b"\x02"
    t.release("r")
    evicted: list[bytes] = []
    assert t.block_for_read(evicted) is not None and evicted == [b"\x00"]


def test_a_reset_fences_blocks_of_dropped_jobs_for_stores_only() -> None:
    t = HostTable(3)
    t.add(b"s", t.block_for_store([]) or 0, "storing")  # vLLM's worker writes it when the reset comes
    t.add(b"l", t.block_for_store([]) or 0, "ready").pins = 1  # a load reads it
    w = t.add(b"w", t.block_for_store([]) or 0, "ready")  # written through by the manager, and loaded
    w.spilling, w.pins = True, 1
    t.hold(b"w", "r")
    assert sorted(t.reset()) == [b"l", b"s"] and list(t) == [b"w"]
    assert t.block_for_read([]) is None  # no block is safe to read a file slot into yet
    assert {t.block_for_store([]), t.block_for_store([])} == {0, 1}
    assert w.fenced and not w.holders and not w.pins  # kept for its write-through, its load dropped
    w.spilling = False
    assert t.block_for_read([]) is None  # still fenced: only a store may take it
    assert t.block_for_store([]) == 2
