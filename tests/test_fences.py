"""The fence rules of the transfer manager (TensorRT-LLM kvCacheTransferManager's hazard rules), on the table alone."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

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


def _fan_out_seconds_per_reader(readers: int) -> float:
    """Seconds per reader to register ``readers`` pending reads of one block, then release them in random order."""
    table = FenceTable()
    markers = [Marker(None) for _ in range(readers)]
    order = list(range(readers))
    random.Random(readers).shuffle(order)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for m in markers:
            table.dependencies([("gpu", [0])], [])
            table.register(m, [("gpu", [0])], [])
        for i in order:
            table.release(markers[i])
        best = min(best, time.perf_counter() - t0)
        assert table.pending("gpu", 0) == (None, ())
    return best / readers


def test_many_pending_readers_of_one_block_cost_constant_time_each():
    # A popular block read by many copies at once (one prefix onboarded into many sequences): adding and dropping
    # one reader must not copy or scan the list of the others. It did (O(readers) each, O(readers^2) in all):
    # at 20,000 readers each register/release took ~20x the time it takes at 500.
    small, large = _fan_out_seconds_per_reader(500), _fan_out_seconds_per_reader(20_000)
    assert large < 5 * small, f"{large * 1e6:.2f} us per reader at 20,000 vs {small * 1e6:.2f} us at 500"


def test_pending_readers_keep_registration_order_and_release_in_any_order():
    table = FenceTable()
    markers = [Marker(None) for _ in range(6)]
    for m in markers:
        table.register(m, [("host", [3, 4])], [])
    assert table.pending("host", 3) == (None, tuple(markers))
    for m in (markers[4], markers[0], markers[5]):
        table.release(m)
    assert table.pending("host", 4) == (None, (markers[1], markers[2], markers[3]))
    assert table.dependencies([], [("host", [3])]) == {markers[1], markers[2], markers[3]}
    for m in (markers[2], markers[1]):
        table.release(m)
    assert table.pending("host", 3) == (None, (markers[3],))
    table.release(markers[3])
    assert table.statistics().fenced_blocks == 0


def test_fence_of_a_copy_equals_dependencies_then_register() -> None:
    """``fence`` (the per-call path: one pair with plain dict operations) keeps the rules of the general calls.
    Copies of up to 12 pairs, some reading one source block twice.

    Two tables see the same random copies (one or several pairs, one pool or two, releases in random order):
    one through ``dependencies`` + ``register``, one through ``fence``; the dependencies and the pending state
    must match after every step.
    """
    rng = random.Random(3)
    blocks = 30
    ref, fast = FenceTable(), FenceTable()
    live: list[tuple[Marker, Marker]] = []
    names = ["gpu", "host"]
    for _ in range(4000):
        if live and rng.random() < 0.4:
            a, b = live.pop(rng.randrange(len(live)))
            for table, m in ((ref, a), (fast, b)):
                table.release(m)
                m.complete()
            continue
        src, dst = rng.choice(names), rng.choice(names)
        k = rng.choice([1, 1, 1, 2, 3, 9, 12])
        s = rng.sample(range(blocks), k)
        if k > 3 and rng.random() < 0.5:
            s[-1] = s[0]  # a source block read twice by one copy
        d = rng.sample([b for b in range(blocks) if src != dst or b not in s], k)
        a, b = Marker(None), Marker(None)
        r, w = [(src, s)], [(dst, d)]
        want = ref.dependencies(r, w)
        ref.register(a, r, w)
        got = fast.fence(b, src, list(s), dst, list(d))
        assert len(got) == len(set(got)), "each dependency once"
        pairs = dict(live)
        assert {pairs[m] for m in want} == set(got)
        live.append((a, b))
        pairs[a] = b
        for pool in names:
            for block in range(blocks):
                w_ref, r_ref = ref.pending(pool, block)
                w_fast, r_fast = fast.pending(pool, block)
                assert w_fast is (None if w_ref is None else pairs[w_ref])
                assert list(r_fast) == [pairs[m] for m in r_ref]


def test_live_is_true_while_a_running_op_holds_entries_in_the_pool() -> None:
    """``live(pool)``: an op registered by either path, not completed, holds entries there."""
    table = FenceTable()
    a, b, c = Marker(None), Marker(None), Marker(None)
    table.register(a, [("gpu", [0, 1])], [("host", [5])])
    table.fence(b, "host", [7], "host", [8])  # one pool on both sides
    table.fence(c, "gpu", [2], "disk", [0])
    assert [table.live(p) for p in ("gpu", "host", "disk", "other")] == [True, True, True, False]
    a.completed = True
    table.release_later(a)  # completed, entries not dropped yet: it no longer counts
    assert [table.live(p) for p in ("gpu", "host")] == [True, True]
    b.completed = True
    assert not table.live("host") and table.live("gpu")
    table.release(a)
    table.release(a)  # a second release changes nothing
    table.release(b)
    c.completed = True
    table.release(c)
    assert not any(table.live(p) for p in ("gpu", "host", "disk"))
    assert not table and not table._holders["gpu"]


def test_release_later_is_done_before_any_query():
    t = FenceTable()
    w, _ = op(t, writes=[("host", [0])])
    r, _ = op(t, reads=[("host", [0])])
    w.completed = True
    t.release_later(w)
    assert t.pending("host", 0) == (None, (r,))
    r.completed = True
    t.release_later(r)
    assert not t and len(t) == 0 and t.statistics().pending_reads == 0


def test_late_release_of_a_completed_marker_keeps_the_newer_entries():
    t = FenceTable()
    w, _ = op(t, writes=[("host", [0])])
    r, _ = op(t, reads=[("gpu", [5])])
    w.completed = r.completed = True
    t.release_later(w)
    t.release_later(r)
    r2, deps = op(t, reads=[("host", [0]), ("gpu", [5])])  # registered while w and r are still in the table
    assert deps == set()
    w2, deps = op(t, writes=[("gpu", [5])])
    assert deps == {r2}
    t.release_done()
    assert t.pending("host", 0) == (None, (r2,)) and t.pending("gpu", 5) == (w2, ())


async def test_complete_skips_a_cancelled_wait_not_yet_forgotten():
    m = Marker(None)
    waiting = [asyncio.ensure_future(m.wait()) for _ in range(2)]
    await asyncio.sleep(0)
    waiting[0].cancel()  # its future is cancelled now; its task forgets the waiter only when it next runs
    m.complete()
    with pytest.raises(asyncio.CancelledError):
        await waiting[0]
    await waiting[1]
    assert m._waiters == []


def test_fence_replaces_a_completed_lone_reader_and_its_late_release_keeps_the_new_one():
    t = FenceTable()
    m1 = Marker(None)
    assert t.fence(m1, "gpu", [0], "host", [1]) == []
    m1.completed = True
    t.release_later(m1)  # not dropped yet: the next copy still finds m1 as gpu 0's reader
    m2 = Marker(None)
    assert t.fence(m2, "gpu", [0], "host", [2]) == []
    assert t._reads["gpu"][0] is m2  # replaced, no reader set of a completed marker and m2
    t.release_done()
    assert t.pending("gpu", 0) == (None, (m2,))
    w = Marker(None)
    assert t.fence(w, "host", [5], "gpu", [0]) == [m2]


def test_register_drops_completed_entries_first_instead_of_building_reader_sets() -> None:
    """Regression (found on an H100: a repeated 8,192-block copy took 10 ms to return): registering the blocks of a
    completed, not yet released copy must not turn each block's lone reader into a reader set."""
    t = FenceTable()
    blocks = list(range(1000))
    m1 = Marker(None)
    t.register(m1, [("gpu", blocks)], [("host", blocks)])
    m1.completed = True
    t.release_later(m1)
    m2 = Marker(None)
    t.register(m2, [("gpu", blocks)], [("host", blocks)])
    assert all(r is m2 for r in t._reads["gpu"].values())
    assert all(w is m2 for w in t._writes["host"].values())
    assert t.pending("gpu", 7) == (None, (m2,)) and t.pending("host", 7) == (m2, ())


def _model_copy(
    reads: dict[tuple[str, int], list[Marker]],
    writes: dict[tuple[str, int], Marker],
    m: Marker,
    src: str,
    s: list[int],
    dst: str,
    d: list[int],
) -> None:
    """The per-block model of the rules: ``m`` reads ``s`` of ``src`` and writes ``d`` of ``dst`` (dropping their
    readers)."""
    for b in s:
        reads.setdefault((src, b), []).append(m)
    for b in d:
        reads.pop((dst, b), None)
        writes[(dst, b)] = m


def test_release_matches_a_per_block_model_when_holders_come_and_go() -> None:
    """``release`` clears a pool whole when its last holder goes (no per-block loop); with other holders it drops
    only the marker's own entries. Random copies (whole pools emptied often: one or two ops live) against a
    per-block model of the rules; pending state must match after every step.
    """
    rng = random.Random(17)
    blocks, names = 24, ["gpu", "host", "file"]
    table = FenceTable()
    writes: dict[tuple[str, int], Marker] = {}
    reads: dict[tuple[str, int], list[Marker]] = {}
    live: list[Marker] = []
    for step in range(6000):
        if live and rng.random() < 0.5:
            m = live.pop(rng.randrange(len(live)))
            m.complete()
            table.release_later(m) if rng.random() < 0.5 else table.release(m)
            for key in [k for k, v in writes.items() if v is m]:
                del writes[key]
            for key in list(reads):
                reads[key] = [r for r in reads[key] if r is not m]
                if not reads[key]:
                    del reads[key]
        else:
            src, dst = rng.choice(names), rng.choice(names)
            k = rng.choice([1, 2, 5, 24 if src != dst else 12])
            s = rng.sample(range(blocks), k)
            d = rng.sample([b for b in range(blocks) if src != dst or b not in s], k)
            m = Marker(None)
            if rng.random() < 0.5:
                table.fence(m, src, list(s), dst, list(d))
            else:
                table.register(m, [(src, list(s))], [(dst, list(d))])
            _model_copy(reads, writes, m, src, s, dst, d)
            live.append(m)
        for pool in names:
            for block in range(blocks):
                w, r = table.pending(pool, block)
                assert w is writes.get((pool, block)), (step, pool, block)
                assert list(r) == reads.get((pool, block), []), (step, pool, block)
    for m in live:
        table.release(m)
    assert table.statistics().fenced_blocks == 0


def test_random_copies_get_the_dependencies_of_a_per_block_model() -> None:
    """Random copies between three pools against a per-block model of the hazard rules.

    As in the engine, an op completes only after every op it waited for, and its entries are dropped at once or
    later (``release_later``). Each lookup (``dependencies``, ``fence``, ``pending``) must give what the model gives,
    less completed ops; the engine's shortcut (no lookup while no op of the pools runs, :meth:`FenceTable.live`) must
    never skip a dependency.
    """
    rng = random.Random(23)
    blocks, names = 16, ["gpu", "host", "file"]
    table = FenceTable()
    writes: dict[tuple[str, int], Marker] = {}
    reads: dict[tuple[str, int], list[Marker]] = {}
    waited: dict[Marker, set[Marker]] = {}
    live: list[Marker] = []

    def expected(src: str, s: list[int], dst: str, d: list[int]) -> set[Marker]:
        deps = {writes[(src, b)] for b in s if (src, b) in writes}
        deps |= {writes[(dst, b)] for b in d if (dst, b) in writes}
        deps |= {r for b in d for r in reads.get((dst, b), [])}
        return {m for m in deps if not m.completed}

    def complete(m: Marker) -> None:
        for dep in waited.pop(m, set()):
            if not dep.completed:
                complete(dep)
        if not m.completed:
            m.complete()
            live.remove(m)
            table.release_later(m) if rng.random() < 0.5 else table.release(m)

    for step in range(8000):
        action = rng.random()
        if live and action < 0.35:
            complete(rng.choice(live))
            continue
        src, dst = rng.choice(names), rng.choice(names)
        k = rng.choice([1, 2, 5, 8])
        s = rng.sample(range(blocks), k)
        d = rng.sample([b for b in range(blocks) if src != dst or b not in s], k)
        want = expected(src, s, dst, d)
        m = Marker(None)
        if action < 0.55:  # the lookup and the entries in one pass (written at once)
            got = set(table.fence(m, src, list(s), dst, list(d)))
        elif action < 0.9:  # looked up, then registered
            got = table.dependencies([(src, s)], [(dst, d)])
            table.register(m, [(src, s)], [(dst, d)])
        else:  # registered with no lookup before (nothing to wait for, as the engine decides from live())
            got = want if any(table.live(p) for p in {src, dst}) else set()
            if got != want:
                continue
            table.register(m, [(src, s)], [(dst, d)])
        assert got == want, step
        waited[m] = got
        _model_copy(reads, writes, m, src, s, dst, d)
        live.append(m)
        if rng.random() < 0.05:
            for pool in names:
                for block in range(blocks):
                    w, r = table.pending(pool, block)
                    model_w = writes.get((pool, block))
                    assert (w if w is not None and not w.completed else None) is (
                        model_w if model_w is not None and not model_w.completed else None
                    ), (step, pool, block)
                    assert {x for x in r if not x.completed} == {
                        x for x in reads.get((pool, block), []) if not x.completed
                    }, (step, pool, block)
    while live:
        complete(live[0])
    assert table.statistics().fenced_blocks == 0


def test_a_lookup_drops_completed_entries_first() -> None:
    """Regression (the 128-block partial copy bench on an H200): a copy repeated on the same blocks looked its
    predecessor's completed, not yet released entries up block by block; the lookup drops them first."""
    t = FenceTable()
    blocks = list(range(128))
    m1 = Marker(None)
    assert t.fence(m1, "gpu", blocks, "gpu", [b + 128 for b in blocks]) == []
    m1.completed = True
    t.release_later(m1)
    assert t.dependencies([("gpu", blocks)], [("gpu", [b + 128 for b in blocks])]) == set()
    assert not t._writes["gpu"] and not t._reads["gpu"]  # dropped before the lookup, not skipped entry by entry
    m2 = Marker(None)
    assert t.fence(m2, "gpu", blocks, "gpu", [b + 128 for b in blocks]) == []
    m2.completed = True
    t.release_later(m2)
    m3 = Marker(None)
    assert t.fence(m3, "gpu", blocks, "gpu", [b + 128 for b in blocks]) == []
    assert all(w is m3 for w in t._writes["gpu"].values()) and len(t._writes["gpu"]) == 128
