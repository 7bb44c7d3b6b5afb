"""The KV bridge: a forward's KV written into blocks (a short forward's layers at once), the past read from them."""

from __future__ import annotations

from typing import cast

import pytest
import torch

from tiered_kv.integrations.hf.kv import BATCHED_WRITE_POSITIONS, RowTargets

BLOCKS, LAYERS, HEADS, T, DIM = 12, 3, 2, 4, 8


def _views(pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(pool[:, i, 0], pool[:, i, 1]) for i in range(LAYERS)]


def _forward(target: RowTargets, pool: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """What a forward does: one write per layer, then finish."""
    for views, (k, v) in zip(_views(pool), kv, strict=True):
        target.write(views, k, v)
    target.finish()


@pytest.mark.parametrize("start,length", [(5, 1), (0, 3), (9, 2)])
def test_short_forward_written_at_once_equals_layer_by_layer_with_a_row_not_stored(start: int, length: int) -> None:
    g = torch.Generator().manual_seed(start)
    tables = [(3, 7, 1), None, (0, 11, 4)]  # the middle row is not stored
    kv = [
        (torch.randn(3, HEADS, length, DIM, generator=g), torch.randn(3, HEADS, length, DIM, generator=g))
        for _ in range(LAYERS)
    ]
    base = torch.randn(BLOCKS, LAYERS, 2, HEADS, T, DIM, generator=g)
    each, once = base.clone(), base.clone()
    per_layer = RowTargets(T)
    per_layer.page_tables = list(tables)
    per_layer.prepare(start, length, torch.device("cpu"))
    _forward(per_layer, each, kv)
    batched = RowTargets(T, pool=once)
    batched.page_tables = list(tables)
    batched.prepare(start, length, torch.device("cpu"))
    for views, (k, v) in zip(_views(once), kv, strict=True):
        batched.write(views, k, v)
    assert torch.equal(once, base)  # held back until finish
    batched.finish()
    assert torch.equal(once, each) and not torch.equal(each, base)
    for row, table in ((0, tables[0]), (2, tables[2])):  # every position of the stored rows, every layer
        assert table is not None
        for p in range(start, start + length):
            got = once[table[p // T], :, :, :, p % T, :]
            want = torch.stack([torch.stack((k[row, :, p - start], v[row, :, p - start])) for k, v in kv])
            assert torch.equal(got, want)


def test_long_forward_writes_layer_by_layer_and_a_wrong_layer_count_is_refused() -> None:
    pool = torch.zeros(BLOCKS * 40, LAYERS, 2, HEADS, T, DIM)
    target = RowTargets(T, pool=pool)
    n = BATCHED_WRITE_POSITIONS + 1
    target.page_tables = [tuple(range(-(-n // T)))]
    target.prepare(0, n, torch.device("cpu"))
    k = torch.ones(1, HEADS, n, DIM)
    target.write(_views(pool)[0], k, k)
    assert pool[:, 0].abs().sum() > 0  # written at once: a long forward holds nothing back
    short = RowTargets(T, pool=pool)
    short.page_tables = [(0,)]
    short.prepare(0, 1, torch.device("cpu"))
    one = torch.ones(1, HEADS, 1, DIM)
    short.write(_views(pool)[0], one, one)
    with pytest.raises(RuntimeError, match="wrote 1 layers, the pool holds 3"):
        short.finish()


@pytest.mark.parametrize("length", [1, 4, 9, 12])
def test_gather_past_reads_each_rows_positions_from_its_blocks(length: int) -> None:
    from tiered_kv.integrations.hf.kv import block_index, gather_past

    g = torch.Generator().manual_seed(length)
    pool = torch.randn(BLOCKS, LAYERS, 2, HEADS, T, DIM, generator=g)
    tables = [(3, 7, 1), (0, 11, 4)]
    index = block_index(tables, length, T, torch.device("cpu"))
    assert index.tolist() == [b for t in tables for b in t[: -(-length // T)]]
    for layer, (k_view, v_view) in enumerate(_views(pool)):
        for kv, view in ((0, k_view), (1, v_view)):
            got = gather_past(view, index, len(tables), length)
            assert got.shape == (len(tables), HEADS, length, DIM)
            for row, table in enumerate(tables):
                for p in range(length):
                    assert torch.equal(got[row, :, p], pool[table[p // T], layer, kv, :, p % T])


def test_a_pooled_layer_keeps_no_kv_and_attends_to_the_blocks_then_the_new_positions() -> None:
    pytest.importorskip("transformers")
    from tiered_kv.integrations.hf.kv import cache_classes

    layer_cls, _ = cache_classes()
    pool = torch.randn(BLOCKS, LAYERS, 2, HEADS, T, DIM)
    target = RowTargets(T)  # one layer's writes go straight into the blocks
    target.page_tables = [(5, 2, 9)]
    target.prepare(6, 3, torch.device("cpu"))  # positions 6..8 after a past of 6
    layer = layer_cls(_views(pool)[1], target, 1)
    assert layer.get_seq_length() == 6
    past_k, _ = layer.past()
    new = torch.randn(1, HEADS, 3, DIM)
    keys, values = layer.update(new, -new)
    assert keys.shape == (1, HEADS, 9, DIM) and torch.equal(keys[:, :, :6], past_k)
    assert torch.equal(keys[:, :, 6:], new) and torch.equal(values[:, :, 6:], -new)
    assert torch.equal(pool[2, 1, 0, :, 2:], new[0, :, :2]) and torch.equal(pool[9, 1, 0, :, 0], new[0, :, 2])
    assert layer.keys is None and layer.values is None  # nothing held beside the blocks
    layer.materialize([(5, 2, 9)], 9)  # from here on a DynamicLayer holding positions 0..8
    held = cast(torch.Tensor, layer.keys)
    assert torch.equal(held, keys) and layer.get_seq_length() == 9
