"""Staging of block-offset tables (seed 000): snapshots, identity index, event-guarded FIFO retirement.

Every race test holds the stream while the CPU runs ahead (a gate on the emulated device, a GPU sleep on
CUDA), so the op that ships batch A executes only after the host table was refilled for batch B. Each is
also run against the private racy in-place mode, and there it must observe the corruption: proof that
the test can see the race it guards against.
"""

from __future__ import annotations

import contextlib
import gc
import json
import random
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tiered_kv import resolve_device
from tiered_kv.device import Device, Event, Stream
from tiered_kv.staging import (
    NO_BLOCK,
    BlockOffsetTable,
    Mode,
    StagingPool,
    copy_batch_block_offsets,
    gather_block_offsets,
)
from tiered_kv.testing import stall
from tiered_kv.tools.baselines import InplaceShipper
from tiered_kv.tools.bench import pagetables

MODES: list[Mode] = ["copy", "gather"]


@contextlib.contextmanager
def held(stream: Stream, dev: Device) -> Iterator[None]:
    """Keep ``stream`` from executing what is enqueued inside the block until the block exits.

    Emulated: a gate the worker waits on (no timing margin at all). CUDA: a long GPU sleep ahead of the work.
    """
    if dev.is_cuda:
        stall(stream, 0.5)
        yield
        return
    gate = threading.Event()
    stream.submit(gate.wait)
    try:
        yield
    finally:
        gate.set()


def make_table(
    dev: Device, *, pools: int = 2, max_seqs: int = 16, max_blocks: int = 12, depth: int = 4, seed: int = 0
) -> BlockOffsetTable:
    table = BlockOffsetTable(pools, max_seqs, max_blocks, device=dev, depth=depth)
    rng = np.random.default_rng(seed)
    for slot in range(max_seqs):
        fill_slot(table, slot, rng)
    return table


def fill_slot(table: BlockOffsetTable, slot: int, rng: np.random.Generator) -> None:
    """A new request takes ``slot``: fresh block ids (distinct per pool), a random count (possibly 0)."""
    for pool in range(table.num_pools):
        count = int(rng.integers(0, table.max_blocks_per_seq + 1))
        table.set_row(slot, pool, rng.integers(0, 10_000, size=count))


def reference(
    table: BlockOffsetTable, slots: list[int], width: int, mode: Mode, scale=None, v_offset=None
) -> torch.Tensor:
    """What the device table must hold, computed independently (numpy, element by element rules)."""
    host = table.host.numpy()[:, slots, :, :width].astype(np.int64)
    if mode == "copy":
        return torch.from_numpy(host.astype(np.int32))
    pools, kv = table.num_pools, table.kv_factor
    mul = np.ones(pools, np.int64) if scale is None else np.asarray(scale, np.int64)
    add = np.zeros(pools, np.int64) if v_offset is None else np.asarray(v_offset, np.int64)
    out = host * mul[:, None, None, None]
    if kv == 2:
        out[:, :, 1] += add[:, None, None]
    out = np.where(host == table.sentinel, host, out)
    return torch.from_numpy(out.astype(np.int32))


def poisoned(table: BlockOffsetTable, dev: Device, batch: int | None = None, value: int = -7) -> torch.Tensor:
    out = torch.full(table.device_shape(batch), value, dtype=torch.int32, device=dev.torch_device)
    if dev.is_cuda:  # filled on the default stream; the ops under test run on another (non-blocking) stream
        torch.cuda.current_stream().synchronize()
    return out


def gather_kwargs(mode: Mode, pools: int = 2) -> dict[str, Any]:
    return {"scale": [3, 5][:pools], "v_offset": [1, 1000][:pools]} if mode == "gather" else {}


# --------------------------------------------------------------------------------------------- the seed's race


def run_refill_scenario(dev: Device, stream: Stream, mode: Mode, inplace: bool) -> tuple[bool, bool]:
    """Ship A, refill the same slots for new requests (batch B), ship B, all while the stream is held.

    Returns whether A's and B's device tables equal their references.
    """
    table = make_table(dev, seed=1)
    slots = [3, 0, 7, 12]
    width = table.max_blocks_per_seq
    kw = gather_kwargs(mode)
    dst_a, dst_b = poisoned(table, dev), poisoned(table, dev)
    rng = np.random.default_rng(2)
    send = InplaceShipper(table).ship if inplace else table.copy_batch_block_offsets
    with held(stream, dev):
        send(dst_a, slots, stream=stream, mode=mode, max_blocks=width, **kw)
        ref_a = reference(table, slots, width, mode, **kw)
        for slot in slots:  # A's requests finished; new requests reuse their slots
            fill_slot(table, slot, rng)
        send(dst_b, slots, stream=stream, mode=mode, max_blocks=width, **kw)
        ref_b = reference(table, slots, width, mode, **kw)
        assert not torch.equal(ref_a, ref_b)
    table.synchronize()
    got_a = dst_a[:, : len(slots)].cpu()
    got_b = dst_b[:, : len(slots)].cpu()
    return torch.equal(got_a, ref_a), torch.equal(got_b, ref_b)


@pytest.mark.parametrize("mode", MODES)
def test_refill_while_stream_stalled_keeps_each_batch(dev: Device, stream: Stream, mode: Mode) -> None:
    assert run_refill_scenario(dev, stream, mode, inplace=False) == (True, True)


@pytest.mark.parametrize("mode", MODES)
def test_refill_scenario_catches_inplace_race(dev: Device, stream: Stream, mode: Mode) -> None:
    a_ok, b_ok = run_refill_scenario(dev, stream, mode, inplace=True)
    assert not a_ok, "the racy in-place path must ship B's offsets for A: otherwise the test cannot see the race"
    assert b_ok


def run_mutation_scenario(dev: Device, stream: Stream, mode: Mode, inplace: bool, container: str = "torch") -> bool:
    """Enqueue, then at once scribble over the host rows, the caller's index buffer and scale/V offset."""
    table = make_table(dev, seed=3)
    tensor = torch.tensor([5, 1, 9], dtype=torch.int64)
    slots: torch.Tensor | np.ndarray = tensor
    if container == "numpy":
        slots = tensor.numpy()  # shares memory: mutating the tensor below mutates the caller's array
    scale = torch.tensor([3, 5], dtype=torch.int32) if mode == "gather" else None
    v_offset = torch.tensor([1, 1000], dtype=torch.int32) if mode == "gather" else None
    dst = poisoned(table, dev)
    send = InplaceShipper(table).ship if inplace else table.copy_batch_block_offsets
    with held(stream, dev):
        send(dst, slots, stream=stream, mode=mode, max_blocks=None, scale=scale, v_offset=v_offset)
        width = int(max(table.num_blocks(int(s), p) for s in slots for p in range(2)))
        ref = reference(
            table,
            list(slots.tolist()),
            width,
            mode,
            scale=None if scale is None else scale.tolist(),
            v_offset=None if v_offset is None else v_offset.tolist(),
        )
        table.host.fill_(4242)  # the whole host table, sentinels included
        slots[:] = 0
        if scale is not None and v_offset is not None:
            scale.fill_(-1)
            v_offset.fill_(-1)
        # The next call in a racy world reuses the persistent index buffer for other slots.
        send(poisoned(table, dev), [2, 2, 2], stream=stream, mode=mode, max_blocks=1, **gather_kwargs(mode))
    table.synchronize()
    return torch.equal(dst[:, :3, :, :width].cpu(), ref)


@pytest.mark.parametrize("container", ["torch", "numpy"])
@pytest.mark.parametrize("mode", MODES)
def test_mutating_inputs_after_enqueue_does_not_change_output(
    dev: Device, stream: Stream, mode: Mode, container: str
) -> None:
    assert run_mutation_scenario(dev, stream, mode, inplace=False, container=container)


@pytest.mark.parametrize("mode", MODES)
def test_mutation_scenario_catches_inplace_race(dev: Device, stream: Stream, mode: Mode) -> None:
    assert not run_mutation_scenario(dev, stream, mode, inplace=True)


def test_inplace_gather_reads_the_persistent_index_buffer(dev: Device, stream: Stream) -> None:
    """The v2 form of the bug with an unchanged host table: only the index buffer is reused."""
    table = make_table(dev, seed=4)
    dst_a = poisoned(table, dev)
    naive = InplaceShipper(table)
    with held(stream, dev):
        naive.ship(dst_a, [0, 1], stream=stream, mode="gather", max_blocks=4)
        naive.ship(poisoned(table, dev), [2, 3], stream=stream, mode="gather", max_blocks=4)
    table.synchronize()
    assert torch.equal(dst_a[:, :2, :, :4].cpu(), reference(table, [2, 3], 4, "gather"))  # A got B's rows

    fresh = poisoned(table, dev)
    with held(stream, dev):
        table.copy_batch_block_offsets(fresh, [0, 1], stream=stream, mode="gather", max_blocks=4)
        table.copy_batch_block_offsets(poisoned(table, dev), [2, 3], stream=stream, mode="gather", max_blocks=4)
    table.synchronize()
    assert torch.equal(fresh[:, :2, :, :4].cpu(), reference(table, [0, 1], 4, "gather"))


# --------------------------------------------------------------------------------------------- staging buffers


class GuardedPool:
    """Wraps a table's staging pool: records each buffer's guard event, checks it at every reuse."""

    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool
        self.guard: dict[int, Event] = {}  # buffer data_ptr -> event of its last use
        self.acquired: list[tuple[int, int]] = []  # (start, end) byte ranges, in call order
        self.violations = 0
        acquire, retire = pool.acquire, pool.retire

        def checked_acquire(numel: int) -> torch.Tensor:
            buf = acquire(numel)
            event = self.guard.get(buf.data_ptr())
            if event is not None and not event.query():
                self.violations += 1
            self.acquired.append((buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()))
            return buf

        def recording_retire(buffer: torch.Tensor, event: Event, keep: object = None) -> None:
            self.guard[buffer.data_ptr()] = event
            retire(buffer, event, keep)

        pool.acquire = checked_acquire  # type: ignore[method-assign]
        pool.retire = recording_retire  # type: ignore[method-assign]


@pytest.mark.parametrize("mode", MODES)
def test_consecutive_calls_never_share_a_staging_buffer(dev: Device, stream: Stream, mode: Mode) -> None:
    table = make_table(dev)
    spy = GuardedPool(table.staging)
    with held(stream, dev):
        for _ in range(3):
            table.copy_batch_block_offsets(poisoned(table, dev), [1, 2], stream=stream, mode=mode)
    table.synchronize()
    (a0, a1), (b0, b1), (c0, c1) = spy.acquired
    assert a1 <= b0 or b1 <= a0
    assert b1 <= c0 or c1 <= b0
    assert a1 <= c0 or c1 <= a0
    assert spy.violations == 0


@pytest.mark.parametrize("mode", MODES)
def test_thousand_calls_random_stalls_bounded_and_correct(dev: Device, stream: Stream, mode: Mode) -> None:
    depth = 3
    table = make_table(dev, max_seqs=32, max_blocks=8, depth=depth, seed=5)
    spy = GuardedPool(table.staging)
    rng = np.random.default_rng(6)
    pyrng = random.Random(7)
    kw = gather_kwargs(mode)
    dst = poisoned(table, dev)
    landed: list[torch.Tensor] = []  # device copies taken on the stream right after each ship
    expected: list[torch.Tensor] = []
    lock = threading.Lock()
    calls = 200 if dev.is_cuda else 1000
    for _ in range(calls):
        if pyrng.random() < 0.3:
            stall(stream, pyrng.uniform(0, 0.0005))
        n = pyrng.randint(0, 8)
        slots = pyrng.sample(range(table.max_seqs), n)
        width = pyrng.choice([None, pyrng.randint(0, table.max_blocks_per_seq)])
        table.copy_batch_block_offsets(dst, slots, stream=stream, mode=mode, max_blocks=width, **kw)
        w = table.max_blocks_per_seq if width is None else width
        if width is None:
            w = max((table.num_blocks(s, p) for s in slots for p in range(table.num_pools)), default=0)
        expected.append(reference(table, slots, w, mode, **kw))
        view = dst[:, :n, :, :w]

        def consume(view: torch.Tensor = view) -> None:  # the "attention kernel" reading this step's table
            with lock:
                landed.append(view.clone())

        stream.submit(consume)
        for slot in slots:  # these requests end at once; their slots go to new requests
            if pyrng.random() < 0.5:
                fill_slot(table, slot, rng)
        stats = table.staging.statistics()
        assert stats.live <= depth + 1
    table.synchronize()
    stream.synchronize()
    stats = table.staging.statistics()
    assert stats.peak_live <= depth + 1
    assert stats.peak_in_flight <= depth
    assert spy.violations == 0
    assert len(landed) == calls
    bad = [i for i, (got, ref) in enumerate(zip(landed, expected, strict=True)) if not torch.equal(got.cpu(), ref)]
    assert not bad, f"{len(bad)} of {calls} steps shipped a wrong table, first at step {bad[0]}"


@pytest.mark.parametrize("mode", MODES)
def test_destination_stays_alive_until_the_op_completed(dev: Device, stream: Stream, mode: Mode) -> None:
    """A caller dropping ``dst`` at once must not let the allocator reuse memory the op will still write.

    (On CUDA the submitted closure is gone as soon as it has enqueued, so only the staging entry holds it.)
    """
    table = make_table(dev)
    with held(stream, dev):
        dst = poisoned(table, dev)
        ref = weakref.ref(dst)
        table.copy_batch_block_offsets(dst, [1, 2], stream=stream, mode=mode, **gather_kwargs(mode))
        del dst
        gc.collect()
        assert ref() is not None
    table.synchronize()


# --------------------------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("mode", MODES)
def test_max_blocks_writes_only_the_first_columns(dev: Device, stream: Stream, mode: Mode) -> None:
    table = make_table(dev)
    kw = gather_kwargs(mode)
    for k in (0, 1, 5, table.max_blocks_per_seq):
        dst = poisoned(table, dev)
        table.copy_batch_block_offsets(dst, [4, 2, 8], stream=stream, mode=mode, max_blocks=k, **kw)
        table.synchronize()
        got = dst.cpu()
        assert torch.equal(got[:, :3, :, :k], reference(table, [4, 2, 8], k, mode, **kw))
        assert bool((got[:, :3, :, k:] == -7).all()), "columns past max_blocks must be untouched"
        assert bool((got[:, 3:] == -7).all()), "rows past the batch must be untouched"


@pytest.mark.parametrize("mode", MODES)
def test_max_blocks_none_writes_every_allocated_block(dev: Device, stream: Stream, mode: Mode) -> None:
    table = BlockOffsetTable(2, 8, 10, device=dev)
    table.set_row(1, 0, [4, 5, 6])
    table.set_row(1, 1, [7])
    table.set_row(3, 1, [8, 9, 10, 11, 12])  # the widest row of the batch, in pool 1
    table.set_row(6, 0, list(range(9)))  # not in the batch: must not widen it
    dst = poisoned(table, dev)
    table.copy_batch_block_offsets(dst, [3, 1], stream=stream, mode=mode, **gather_kwargs(mode))
    table.synchronize()
    got = dst.cpu()
    assert torch.equal(got[:, :2, :, :5], reference(table, [3, 1], 5, mode, **gather_kwargs(mode)))
    assert bool((got[:, :, :, 5:] == -7).all())
    assert int(got[0, 0, 0, 0]) == NO_BLOCK  # slot 3 has no blocks in pool 0: sentinels, passed through


def test_gather_applies_scale_and_v_offset_and_passes_sentinel(dev: Device, stream: Stream) -> None:
    table = BlockOffsetTable(2, 4, 4, device=dev, sentinel=-5)
    table.set_row(0, 0, [0, 2])
    table.set_row(0, 1, [1])
    dst = poisoned(table, dev)
    table.copy_batch_block_offsets(dst, [0], stream=stream, mode="gather", max_blocks=3, scale=[4, 10], v_offset=[2, 3])
    table.synchronize()
    got = dst[:, 0, :, :3].cpu().tolist()
    assert got == [[[0, 8, -5], [2, 10, -5]], [[10, -5, -5], [13, -5, -5]]]


def test_copy_mode_ships_stored_k_and_v_offsets(dev: Device, stream: Stream) -> None:
    table = BlockOffsetTable(1, 4, 3, device=dev)
    table.set_row(2, 0, [0, 2], v_block_ids=[1, 3])
    dst = poisoned(table, dev)
    table.copy_batch_block_offsets(dst, [2], stream=stream)
    table.synchronize()
    assert dst[0, 0].cpu().tolist() == [[0, 2, -7], [1, 3, -7]]  # None: the 2 allocated columns only


@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_writes_nothing(dev: Device, stream: Stream, mode: Mode) -> None:
    table = make_table(dev)
    dst = poisoned(table, dev)
    event = table.copy_batch_block_offsets(dst, [], stream=stream, mode=mode, **gather_kwargs(mode))
    event.synchronize()
    assert bool((dst.cpu() == -7).all())
    assert table.staging.statistics().acquired == 0


def test_mla_table_gathers_without_v_rows(dev: Device, stream: Stream) -> None:
    table = BlockOffsetTable(1, 4, 4, kv_factor=1, device=dev)
    table.set_row(1, 0, [3, 1])
    dst = poisoned(table, dev)
    copy_batch_block_offsets(table, dst, [1], stream=stream, mode="gather", scale=[2], v_offset=[100])
    table.synchronize()
    assert dst[0, 0, 0, :2].cpu().tolist() == [6, 2]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_cuda_torch_stream_and_pinned_snapshots(mode: Mode) -> None:
    dev = resolve_device("cuda")
    table = make_table(dev)
    assert table.host.is_pinned()
    s = torch.cuda.Stream()
    dst = poisoned(table, dev)
    with held(dev.wrap_stream(s), dev):
        table.copy_batch_block_offsets(dst, [1, 2], stream=s, mode=mode, max_blocks=6, **gather_kwargs(mode))
        ref = reference(table, [1, 2], 6, mode, **gather_kwargs(mode))
        fill_slot(table, 1, np.random.default_rng(9))
        fill_slot(table, 2, np.random.default_rng(10))
    s.synchronize()
    assert all(b.is_pinned() for b in table.staging._free + [e[0] for e in table.staging._in_flight])
    assert torch.equal(dst[:, :2, :, :6].cpu(), ref)


# --------------------------------------------------------------------------------------------- table writers


def test_set_append_clear_and_slot_reuse() -> None:
    table = BlockOffsetTable(2, 4, 5, device="cpu")
    assert bool((table.host == NO_BLOCK).all())
    table.set_row(1, 0, [10, 11])
    table.append(1, 0, [12])
    assert table.num_blocks(1, 0) == 3
    assert table.row(1, 0).tolist() == [[10, 11, 12], [10, 11, 12]]
    table.set_row(1, 0, [7])  # a new request in the same slot: the tail must not leak through
    assert table.host[0, 1, 0].tolist() == [7, NO_BLOCK, NO_BLOCK, NO_BLOCK, NO_BLOCK]
    table.set_row(1, 1, [1, 2])
    table.clear_row(1, pool=1)
    assert table.num_blocks(1, 1) == 0 and table.num_blocks(1, 0) == 1
    table.clear_row(1)
    assert bool((table.host[:, 1] == NO_BLOCK).all())
    assert "slots:0/4" in repr(table)


def test_on_page_table_hook_follows_a_sequence_lifecycle() -> None:
    """What the block manager calls: admit, grow (append a block), free; then the slot's next tenant."""
    table = BlockOffsetTable(1, 4, 6, device="cpu")
    hook = table.on_page_table
    hook(2, (5, 9))
    hook(2, (5, 9, 11))
    assert table.row(2).tolist() == [[5, 9, 11], [5, 9, 11]]
    hook(2, None)
    assert table.num_blocks(2) == 0 and bool((table.host[0, 2] == NO_BLOCK).all())
    hook(2, (1,))
    assert table.host[0, 2, 0].tolist() == [1, NO_BLOCK, NO_BLOCK, NO_BLOCK, NO_BLOCK, NO_BLOCK]


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        (lambda t: t.set_row(4, 0, [1]), ValueError),  # slot out of range
        (lambda t: t.set_row(0, 2, [1]), ValueError),  # pool out of range
        (lambda t: t.set_row(True, 0, [1]), TypeError),
        (lambda t: t.set_row(0, 0, [1, 2, 3, 4, 5, 6]), ValueError),  # too many blocks
        (lambda t: t.set_row(0, 0, [1, NO_BLOCK]), ValueError),  # the sentinel is not a block
        (lambda t: t.set_row(0, 0, [2**31]), ValueError),
        (lambda t: t.set_row(0, 0, [1.5]), TypeError),
        (lambda t: t.set_row(0, 0, [[1]]), ValueError),
        (lambda t: t.set_row(0, 0, [1, 2], v_block_ids=[3]), ValueError),
        (lambda t: t.append(0, 0, [1] * 6), ValueError),
    ],
)
def test_writer_bad_arguments(call, exc) -> None:
    table = BlockOffsetTable(2, 4, 5, device="cpu")
    before = table.host.clone()
    with pytest.raises(exc):
        call(table)
    assert torch.equal(table.host, before)


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"slots": [4]}, ValueError),
        ({"slots": [-1]}, ValueError),
        ({"slots": [[0]]}, ValueError),
        ({"slots": [0.0]}, TypeError),
        ({"slots": np.array([4])}, ValueError),
        ({"slots": np.array([0.5])}, TypeError),
        ({"slots": torch.tensor([0, 9])}, ValueError),
        ({"mode": "gather", "scale": "ab"}, TypeError),
        ({"mode": "gather", "scale": [1.5, 1]}, TypeError),
        ({"mode": "gather", "v_offset": [2**31, 0]}, ValueError),
        ({"mode": "gather", "scale": torch.ones(2, 1, dtype=torch.int32)}, ValueError),
        ({"slots": "ab"}, TypeError),
        ({"slots": list(range(5))}, ValueError),  # more than max_seqs
        ({"mode": "scatter"}, ValueError),
        ({"max_blocks": 6}, ValueError),
        ({"max_blocks": -1}, ValueError),
        ({"max_blocks": 2.0}, TypeError),
        ({"max_blocks": True}, TypeError),
        ({"scale": [1, 1]}, ValueError),  # copy mode takes no scale
        ({"mode": "gather", "scale": [1]}, ValueError),  # one per pool
        ({"mode": "gather", "v_offset": [1, 2, 3]}, ValueError),
        ({"dst": torch.zeros((2, 4, 2, 5), dtype=torch.int64)}, TypeError),
        ({"dst": torch.zeros((2, 4, 1, 5), dtype=torch.int32)}, ValueError),
        ({"dst": torch.zeros((2, 1, 2, 5), dtype=torch.int32)}, ValueError),  # batch of 2 does not fit
        ({"dst": torch.zeros((2, 4, 2, 2), dtype=torch.int32)}, ValueError),  # 5 columns do not fit
        ({"dst": [0]}, TypeError),
        ({"stream": object()}, TypeError),
    ],
)
def test_ship_bad_arguments_raise_before_enqueue(kwargs: dict[str, object], exc: type[Exception]) -> None:
    table = BlockOffsetTable(2, 4, 5, device="cpu")
    table.set_row(0, 0, [1, 2, 3, 4, 5])
    stream = table.device.new_stream("s")
    args: dict[str, object] = {"dst": torch.zeros((2, 4, 2, 5), dtype=torch.int32), "slots": [0, 1], "stream": stream}
    args.update(kwargs)
    try:
        with pytest.raises(exc):
            table.copy_batch_block_offsets(args.pop("dst"), args.pop("slots"), **args)  # type: ignore[arg-type]
        assert sum(table.statistics().calls.values()) == 0
        assert table.staging.statistics().acquired == 0
    finally:
        stream.close()


def test_constructor_and_function_bad_arguments() -> None:
    with pytest.raises(ValueError):
        BlockOffsetTable(0, 4, 4, device="cpu")
    with pytest.raises(ValueError):
        BlockOffsetTable(1, 4, 4, kv_factor=3, device="cpu")
    with pytest.raises(ValueError):
        BlockOffsetTable(1, 4, 4, sentinel=2**31, device="cpu")
    with pytest.raises(ValueError):
        BlockOffsetTable(1, 4, 4, depth=0, device="cpu")
    with pytest.raises(TypeError):
        copy_batch_block_offsets(object(), torch.zeros(1), [0], stream=None)  # type: ignore[arg-type]


def test_cuda_stream_rejected_by_emulated_table() -> None:
    table = BlockOffsetTable(1, 2, 2, device="cpu")
    with pytest.raises(TypeError):
        table.copy_batch_block_offsets(torch.zeros((1, 2, 2, 2), dtype=torch.int32), [0], stream="compute")


# --------------------------------------------------------------------------------------------- staging pool


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def test_staging_pool_fifo_reclaim_and_backpressure() -> None:
    pool = StagingPool("cpu", depth=2)
    a = pool.acquire(10)
    ea = FakeEvent()
    pool.retire(a, ea)
    b = pool.acquire(10)
    assert b.data_ptr() != a.data_ptr()  # a's event is pending: a is not reused
    eb = FakeEvent()
    pool.retire(b, eb)
    eb.done = True  # the later one completed, the head did not: FIFO keeps both (same stream => in order)
    assert pool.reclaim() == 2
    c = pool.acquire(10)  # depth reached: waits for the oldest, then reuses it
    assert ea.waited == 1 and eb.waited == 0
    assert c.data_ptr() in (a.data_ptr(), b.data_ptr())
    stats = pool.statistics()
    assert stats.waited == 1 and stats.allocated == 2 and stats.peak_live == 2 and stats.live == 2
    pool.release(c)
    pool.drain()
    assert pool.statistics().in_flight == 0
    assert "in_flight:0/2" in repr(pool)
    pool.clear()
    assert pool.statistics().live == 0


def test_staging_pool_grows_without_exceeding_depth() -> None:
    pool = StagingPool("cpu", depth=2)
    small = pool.acquire(10)
    pool.retire(small, FakeEvent())
    pool.drain()
    big = pool.acquire(100_000)  # the free buffer is too small: replaced, not added to
    assert big.numel() >= 100_000
    assert pool.statistics().live == 1
    pool.release(big)
    assert pool.acquire(5).data_ptr() == big.data_ptr()


# --------------------------------------------------------------------------------------------- gather op


@pytest.mark.parametrize("kv", [1, 2])
def test_gather_adapter_matches_elementwise_rule(kv: int) -> None:
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(-1, 50, (3, 7, kv, 6), dtype=torch.int32, generator=gen)
    idx = torch.tensor([6, 0, 3, 3], dtype=torch.int32)
    scale = torch.tensor([2, 3, -1], dtype=torch.int32)
    v_offset = torch.tensor([5, 7, 9], dtype=torch.int32)
    for dst in (
        torch.full((3, 4, kv, 8), -7, dtype=torch.int32),
        torch.full((3, 6, kv, 8), -7, dtype=torch.int32)[:, :4],
    ):
        gather_block_offsets(dst, src, idx, scale, v_offset, 4, -1)  # contiguous, then a strided view
        for p in range(3):
            for s in range(4):
                for k in range(kv):
                    for j in range(8):
                        v = int(src[p, idx[s], k, j]) if j < 4 else None
                        want = (
                            -7
                            if v is None
                            else (v if v == -1 else int(scale[p]) * v + (int(v_offset[p]) if k == 1 else 0))
                        )
                        assert int(dst[p, s, k, j]) == want


# --------------------------------------------------------------------------------------------- benchmark


def test_benchmark_quick_run_has_baseline_columns(tmp_path) -> None:

    assert pagetables.main(["--quick", "--device", "cpu", "--json", str(tmp_path / "b.json")]) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    assert {(r["seqs"], r["mode"]) for r in result["rows"]} == {(n, m) for n in (64, 256, 1024) for m in MODES}
    for row in result["rows"]:
        assert row["host_us_racy"] > 0 and row["dev_us_d2d"] > 0 and row["host_x_racy"] > 0
