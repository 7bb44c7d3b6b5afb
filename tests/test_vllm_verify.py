"""The vLLM worker's load verification bookkeeping (no vLLM needed): checksums of canonical pages per block, the
checksum each host block must hold, generations that say which loads are compared and which adopt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered_kv.integrations.vllm.host import HostTable
from tiered_kv.integrations.vllm.verify import LoadCheck, PageChecksums

BLOCKS, LAYERS, PAGE, HOST = 12, 3, 256, 6


def _one_buffer(seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """vLLM 0.32's allocation: every layer's pages in one buffer (layer-outermost), viewed (num_blocks, page)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(-128, 128, (LAYERS * BLOCKS * PAGE,), dtype=torch.int8, generator=g).to(device)
    return buf, [buf[i * BLOCKS * PAGE : (i + 1) * BLOCKS * PAGE].view(BLOCKS, PAGE) for i in range(LAYERS)]


def _load(pages: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    """What a load does to the GPU pages: block ``src[i]``'s bytes (via host) land in block ``dst[i]``."""
    for t in pages:
        t[dst] = t[src].clone()


def _settled(c: LoadCheck) -> list[int]:
    assert c.done()
    c.wait()
    return c.mismatched()


def test_one_checksum_call_covers_every_layer_of_one_buffer_and_separate_tensors_agree(device: str) -> None:
    _buf, pages = _one_buffer(device=device)
    shared = PageChecksums(pages, HOST)
    separate = PageChecksums([p.clone() for p in pages], HOST)
    assert shared.calls_per_job == 1 and separate.calls_per_job == LAYERS
    blocks = np.arange(BLOCKS)
    a, b = shared.of(blocks), separate.of(blocks)
    assert a.dtype == torch.int64 and torch.equal(a, b) and bool(((a >= 0) & (a < 2**32)).all())
    assert len(set(a.tolist())) == BLOCKS  # random blocks: distinct checksums


def test_any_word_changed_and_pages_swapped_between_layers_change_a_blocks_checksum(device: str) -> None:
    _buf, pages = _one_buffer(1, device=device)
    c = PageChecksums(pages, HOST)
    base = c.of(np.array([4])).item()
    for layer in range(LAYERS):
        for at in (0, 1, PAGE // 2, PAGE - 1):
            pages[layer][4, at] += 1
            assert c.of(np.array([4])).item() != base, (layer, at)
            pages[layer][4, at] -= 1
    assert c.of(np.array([4])).item() == base
    p0, p1 = pages[0][4].clone(), pages[1][4].clone()
    pages[0][4], pages[1][4] = p1, p0  # a copy that put the layers' pages in each other's place
    assert c.of(np.array([4])).item() != base


def test_a_stored_block_loaded_intact_is_verified_and_a_changed_one_is_caught(device: str) -> None:
    _buf, pages = _one_buffer(2, device=device)
    c = PageChecksums(pages, HOST)
    c.record(np.array([0, 1, 2]), np.array([3, 4, 5]), np.array([10, 11, 12]))  # store GPU 3,4,5 -> host 0,1,2
    assert c.generations[:3].tolist() == [10, 11, 12]
    _load(pages, [3, 4, 5], [7, 8, 9])  # load host 0,1,2 -> GPU 7,8,9
    compare = c.plan(np.array([0, 1, 2]), np.array([10, 11, 12]))
    assert compare.tolist() == [True, True, True]
    check = c.finish(c.check(np.array([7, 8, 9]), np.array([0, 1, 2]), compare), int(compare.sum()))
    assert _settled(check) == [] and check.compared == 3 and check.adopted == 0
    pages[1][8, 17] ^= 0x21  # the second block landed changed
    compare = c.plan(np.array([0, 1, 2]), np.array([10, 11, 12]))
    assert _settled(c.finish(c.check(np.array([7, 8, 9]), np.array([0, 1, 2]), compare), 3)) == [1]
    assert c.sums[1].item() == c.of(np.array([4])).item()  # a mismatch leaves the stored checksum as it was


def test_a_host_block_overwritten_by_a_store_gets_the_new_checksum(device: str) -> None:
    _buf, pages = _one_buffer(3, device=device)
    c = PageChecksums(pages, HOST)
    c.record(np.array([2]), np.array([0]), np.array([1]))
    c.record(np.array([2]), np.array([6]), np.array([2]))  # host block 2 now holds GPU block 6 (a new entry)
    assert c.sums[2].item() == c.of(np.array([6])).item() and c.generations[2] == 2
    _load(pages, [6], [11])
    compare = c.plan(np.array([2]), np.array([2]))
    assert compare.tolist() == [True]
    assert _settled(c.finish(c.check(np.array([11]), np.array([2]), compare), 1)) == []


def test_a_block_the_worker_never_stored_is_adopted_on_its_first_load_and_verified_after(device: str) -> None:
    _buf, pages = _one_buffer(4, device=device)
    c = PageChecksums(pages, HOST)
    c.record(np.array([3]), np.array([0]), np.array([5]))  # what host block 3 held before the manager staged into it
    compare = c.plan(np.array([3]), np.array([9]))  # generation 9: staged from the file tier by the manager
    assert compare.tolist() == [False] and c.generations[3] == 9
    check = c.finish(c.check(np.array([10]), np.array([3]), compare), 0)  # GPU block 10 holds what was staged
    assert _settled(check) == [] and check.adopted == 1 and check.compared == 0
    assert c.sums[3].item() == c.of(np.array([10])).item()  # adopted: what the first load brought
    _load(pages, [10], [11])
    compare = c.plan(np.array([3]), np.array([9]))
    assert compare.tolist() == [True]
    assert _settled(c.finish(c.check(np.array([11]), np.array([3]), compare), 1)) == []
    pages[2][11, 0] ^= 1
    compare = c.plan(np.array([3]), np.array([9]))
    assert _settled(c.finish(c.check(np.array([11]), np.array([3]), compare), 1)) == [0]


def test_a_spec_without_generations_compares_nothing() -> None:
    _buf, pages = _one_buffer(5)
    c = PageChecksums(pages, HOST)
    c.record(np.array([0]), np.array([0]), None)
    assert c.generations[0] == -1
    assert c.plan(np.array([0]), None).tolist() == [False]


def test_pages_that_are_not_byte_views_are_refused() -> None:
    with pytest.raises(ValueError, match="byte views"):
        PageChecksums([torch.zeros(4, 8, dtype=torch.float32)], 2)
    with pytest.raises(ValueError, match="no canonical"):
        PageChecksums([], 2)


def test_the_host_table_names_the_loaded_entries_of_blocks() -> None:
    t = HostTable(4)
    a = t.add(b"a", 0, "ready", generation=1)
    t.add(b"b", 1, "ready", generation=2)
    t.add(b"c", 2, "storing", generation=3)
    a.pins = 1
    assert t.loading({0, 1, 2}) == [b"a"]  # only what a load reads now: not idle, not being stored
    assert a.generation == 1 and not a.refused
