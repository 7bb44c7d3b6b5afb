"""Gather mode's row versions: rows refilled while a gather may read them are written copy-on-write.

The oracle test drives random ``set_row`` / ``append`` / ``clear_row`` interleaved with gathers on a stream
stalled at random (``tiered_kv.testing.stall``), keeps its own model of the table, and checks that every
gathered batch equals the model at call time. The same scenario through the racy in-place shipper must
see a wrong batch: proof that the scenario can see the race.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from tiered_kv import resolve_device
from tiered_kv.device import Device, Stream
from tiered_kv.rowversions import RowVersions
from tiered_kv.staging import NO_BLOCK, BlockOffsetTable
from tiered_kv.testing import stall
from tiered_kv.tools.baselines import InplaceShipper

SCALE, V_OFFSET = [3, 5], [1, 1000]


class Model:
    """An independent model of the table: per (pool, slot) the block ids, in order."""

    def __init__(self, pools: int, slots: int, cols: int) -> None:
        self.rows: list[list[list[int]]] = [[[] for _ in range(slots)] for _ in range(pools)]
        self.cols = cols

    def expected(self, slots: list[int], width: int) -> torch.Tensor:
        """The gathered table: ``scale * id`` (``+ v_offset`` on V), sentinel passed through."""
        pools = len(self.rows)
        out = np.full((pools, len(slots), 2, width), NO_BLOCK, dtype=np.int64)
        for p in range(pools):
            for i, s in enumerate(slots):
                ids = np.asarray(self.rows[p][s][:width], dtype=np.int64)
                out[p, i, 0, : ids.size] = ids * SCALE[p]
                out[p, i, 1, : ids.size] = ids * SCALE[p] + V_OFFSET[p]
        return torch.from_numpy(out.astype(np.int32))

    def width(self, slots: list[int]) -> int:
        return max((len(self.rows[p][s]) for p in range(len(self.rows)) for s in slots), default=0)


def random_writes(table: BlockOffsetTable, model: Model, rng: random.Random, count: int) -> None:
    for _ in range(count):
        slot, pool = rng.randrange(table.max_seqs), rng.randrange(table.num_pools)
        kind = rng.random()
        if kind < 0.5:
            ids = [rng.randrange(10_000) for _ in range(rng.randint(0, model.cols))]
            table.set_row(slot, pool, ids)
            model.rows[pool][slot] = ids
        elif kind < 0.8:
            room = model.cols - len(model.rows[pool][slot])
            ids = [rng.randrange(10_000) for _ in range(rng.randint(0, room))]
            table.append(slot, pool, ids)
            model.rows[pool][slot] = model.rows[pool][slot] + ids
        elif kind < 0.9:
            table.clear_row(slot, pool)
            model.rows[pool][slot] = []
        else:
            table.clear_row(slot)
            for p in range(table.num_pools):
                model.rows[p][slot] = []


def run_random_scenario(
    dev: Device, stream: Stream, *, spare_rows: int | None, inplace: bool, steps: int, seed: int
) -> tuple[list[int], BlockOffsetTable]:
    """Random writes and gathers on a randomly stalled stream; the steps whose gathered batch was wrong."""
    pools, slots_n, cols = 2, 12, 6
    table = BlockOffsetTable(pools, slots_n, cols, device=dev, depth=4, spare_rows=spare_rows)
    model = Model(pools, slots_n, cols)
    rng = random.Random(seed)
    random_writes(table, model, rng, 40)
    ship = InplaceShipper(table).ship if inplace else table.copy_batch_block_offsets
    dst = torch.full(table.device_shape(), -7, dtype=torch.int32, device=dev.torch_device)
    if dev.is_cuda:
        torch.cuda.synchronize()
    landed: list[torch.Tensor] = []
    expected: list[torch.Tensor] = []
    lock = threading.Lock()
    for _ in range(steps):
        if rng.random() < 0.4:
            stall(stream, rng.uniform(0, 0.002))
        n = rng.randint(0, 8)
        slots = [rng.randrange(slots_n) for _ in range(n)]  # duplicates included
        width = rng.choice([None, rng.randint(0, cols)])
        ship(dst, slots, stream=stream, mode="gather", max_blocks=width, scale=SCALE, v_offset=V_OFFSET)
        w = model.width(slots) if width is None else width
        expected.append(model.expected(slots, w))
        view = dst[:, :n, :, :w]

        def consume(view: torch.Tensor = view) -> None:  # the attention kernel reading this step's table
            with lock:
                landed.append(view.clone())

        stream.submit(consume)
        random_writes(table, model, rng, rng.randint(0, 6))  # the scheduler runs ahead: refills, growth, frees
    table.synchronize()
    stream.synchronize()
    assert len(landed) == steps
    return [
        i for i, (got, ref) in enumerate(zip(landed, expected, strict=True)) if not torch.equal(got.cpu(), ref)
    ], table


@pytest.mark.parametrize("spare_rows", [1, 3, None])
def test_random_writes_and_gathers_match_the_table_at_call_time(
    dev: Device, stream: Stream, spare_rows: int | None
) -> None:
    steps = 150 if dev.is_cuda else 600
    bad, table = run_random_scenario(dev, stream, spare_rows=spare_rows, inplace=False, steps=steps, seed=21)
    assert not bad, f"{len(bad)} of {steps} gathers shipped a wrong table, first at step {bad[0]}"
    versions = table.statistics().versions
    assert versions is not None
    assert versions.copied_on_write > 0, "the scenario must refill rows that a pending gather reads"
    assert versions.in_flight == 0 and versions.free == versions.rows - table.max_seqs  # all retired rows came back


def test_random_scenario_catches_the_inplace_race(dev: Device, stream: Stream) -> None:
    bad, _ = run_random_scenario(dev, stream, spare_rows=None, inplace=True, steps=150, seed=21)
    assert bad, "the racy in-place gather must ship a wrong table: otherwise the scenario cannot see the race"


def test_gather_copies_only_the_rows_written_since_the_last_call(dev: Device, stream: Stream) -> None:
    table = BlockOffsetTable(1, 8, 4, device=dev)
    for slot in range(8):
        table.set_row(slot, 0, [slot, slot + 10])
    dst = torch.zeros(table.device_shape(), dtype=torch.int32, device=dev.torch_device)
    table.copy_batch_block_offsets(dst, list(range(8)), stream=stream, mode="gather")
    first = table.statistics().versions
    assert first is not None and first.refreshed == 0  # made from the whole table at the first gather
    table.set_row(5, 0, [99])
    table.append(2, 0, [98])
    table.copy_batch_block_offsets(dst, list(range(8)), stream=stream, mode="gather")
    table.synchronize()
    after = table.statistics().versions
    assert after is not None and after.refreshed == 2
    assert dst[0, 5, 0, :2].cpu().tolist() == [99, NO_BLOCK]
    assert dst[0, 2, 0, :3].cpu().tolist() == [2, 12, 98]


def test_no_spare_row_free_waits_for_the_oldest_gather(dev: Device, stream: Stream) -> None:
    """One spare row: the third refill of a slot read by pending gathers must wait for the first gather."""
    table = BlockOffsetTable(1, 2, 3, device=dev, spare_rows=1)
    dsts = [torch.full(table.device_shape(), -7, dtype=torch.int32, device=dev.torch_device) for _ in range(3)]
    if dev.is_cuda:
        torch.cuda.synchronize()
    stall(stream, 0.3)
    for value, dst in zip((1, 2, 3), dsts, strict=True):
        table.set_row(0, 0, [value])
        table.copy_batch_block_offsets(dst, [0], stream=stream, mode="gather", max_blocks=1)
    versions = table.statistics().versions
    assert versions is not None and versions.copied_on_write == 2 and versions.waited == 1
    table.synchronize()
    assert [int(d[0, 0, 0, 0]) for d in dsts] == [1, 2, 3]


class ManualEvent:
    """An event completed by the test."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_row_versions_retire_rows_to_the_last_op_reading_them() -> None:
    source = torch.arange(2 * 4 * 2 * 3, dtype=torch.int32).view(2, 4, 2, 3).clone()
    versions = RowVersions(source, resolve_device("cpu"), spare_rows=2)
    first, second = ManualEvent(), ManualEvent()
    rows_a = versions.prepare(np.array([0, 1], dtype=np.int64))
    versions.commit(rows_a, first)
    rows_b = versions.prepare(np.array([1], dtype=np.int64))
    versions.commit(rows_b, second)  # slot 1's row is now read last by `second`
    old = source[:, 1].clone()
    source[:, 1] = -3
    versions.mark(1)
    rows_c = versions.prepare(np.array([1, 0], dtype=np.int64))
    assert rows_c[0] not in (0, 1, 2, 3) and rows_c[1] == 0  # slot 1 copied on write, slot 0 untouched
    assert bool((versions.table[:, int(rows_c[0])] == -3).all())
    assert torch.equal(versions.table[:, 1], old)  # the row pending gathers read is left as it was
    first.done = True
    versions.reclaim()
    assert versions.statistics().free == 1  # the old row of slot 1 waits for `second`, not `first`
    second.done = True
    versions.reclaim()
    assert versions.statistics().free == 2


def test_bad_spare_rows_raise() -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            BlockOffsetTable(1, 2, 2, device="cpu", spare_rows=bad)  # type: ignore[arg-type]
