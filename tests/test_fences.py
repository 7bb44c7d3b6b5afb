"""The fence rules of the seed transfer manager, on the table alone."""

from __future__ import annotations

from tiered_kv import FenceTable
from tiered_kv.fences import Marker


def op(table: FenceTable, reads=(), writes=()):
    r = [(p, list(i)) for p, i in reads]
    w = [(p, list(i)) for p, i in writes]
    deps = table.dependencies(r, w)
    m = Marker(None)
    table.register(m, r, w)
    return m, deps


def test_read_waits_for_pending_write_and_keeps_it():
    t = FenceTable()
    w, _ = op(t, writes=[("host", [0])])
    r1, deps = op(t, reads=[("host", [0])])
    assert deps == {w}
    _, deps = op(t, reads=[("host", [0])])
    assert deps == {w}  # kept for later readers
    assert t.pending("host", 0)[0] is w and r1 in t.pending("host", 0)[1]


def test_write_waits_for_reads_and_write_then_drops_them():
    t = FenceTable()
    w1, _ = op(t, writes=[("host", [0])])
    r1, _ = op(t, reads=[("host", [0])])
    r2, _ = op(t, reads=[("host", [0])])
    w2, deps = op(t, writes=[("host", [0])])
    assert deps == {w1, r1, r2}
    assert t.pending("host", 0) == (w2, ())
    _, deps = op(t, writes=[("host", [0])])
    assert deps == {w2}


def test_pool_is_part_of_the_key():
    t = FenceTable()
    op(t, writes=[("gpu", [0])])
    _, deps = op(t, reads=[("host", [0])], writes=[("host", [1])])
    assert deps == set()


def test_release_on_completion_empties_the_table():
    t = FenceTable()
    w, _ = op(t, reads=[("gpu", [1, 2])], writes=[("host", [0, 3])])
    r, _ = op(t, reads=[("host", [0])], writes=[("gpu", [5])])
    assert t.statistics().fenced_blocks == 5
    for m in (w, r):
        m.completed = True
        t.release(m)
    s = t.statistics()
    assert (s.fenced_blocks, s.pending_reads, s.pending_writes) == (0, 0, 0)
    assert repr(t) == "<FenceTable [blocks:0, reads:0, writes:0]>"


def test_completed_markers_are_not_dependencies():
    t = FenceTable()
    w, _ = op(t, writes=[("host", [0])])
    w.completed = True
    _, deps = op(t, reads=[("host", [0])])
    assert deps == set()


def test_release_of_a_dropped_reader_is_harmless():
    t = FenceTable()
    r, _ = op(t, reads=[("host", [0])])
    w, _ = op(t, writes=[("host", [0])])  # drops r from the table; w waits for it
    r.completed = True
    t.release(r)
    assert t.pending("host", 0) == (w, ())
    w.completed = True
    t.release(w)
    assert len(t) == 0
