"""The cache's end-to-end integrity checks: a block changed after commit is never served, the request recomputes."""

from __future__ import annotations

import logging

import pytest
import torch

from tiered_kv import KVLayout, TieredKVCache, _ext
from tiered_kv.device import stall_op
from tiered_kv.integrity import IntegrityChecks, token_checksums
from tiered_kv.opdefs import token_checksums_ref
from tiered_kv.tools.workload import verify_expected, write_expected

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype=torch.float16)


@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.float16, 8), (torch.float32, 8), (torch.bfloat16, 6), (torch.uint8, 3)]
)
def test_every_changed_word_changes_its_token_checksum(dtype: torch.dtype, head_dim: int) -> None:
    pool = torch.randint(0, 100, (5, 2, 2, 3, 4, head_dim)).to(dtype)
    before = token_checksums(pool, [0, 3, 4])
    assert before.shape == (3, 4) and before.dtype == torch.int32
    assert torch.equal(token_checksums(pool, [0, 3, 4]), before)  # deterministic
    for token in range(4):
        changed = pool.clone()
        raw = changed[3, 1, 0, 2, token].view(torch.uint8)
        raw[-1] ^= 0x10  # one bit of one word of one token
        after = token_checksums(changed, [0, 3, 4])
        assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])
        assert [bool(x) for x in after[1] != before[1]] == [t == token for t in range(4)]


def test_moved_bytes_change_the_checksum() -> None:
    """Two tokens swapped, or a block's words in another order, are not the same block."""
    pool = torch.randn(2, 2, 2, 2, 4, 8).to(torch.float16)
    swapped = pool.clone()
    swapped[0, :, :, :, [0, 1]] = pool[0, :, :, :, [1, 0]]
    assert not torch.equal(token_checksums(swapped, [0])[0, :2], token_checksums(pool, [0])[0, :2])


def test_slots_out_of_range_are_refused() -> None:
    pool = torch.zeros(3, 1, 1, 1, 2, 4)
    for bad in ([0, 3], [-1]):
        with pytest.raises(ValueError, match="out of range"):
            token_checksums(pool, bad)
    assert token_checksums(pool, []).shape == (0, 2)


def test_the_op_has_a_fake_kernel() -> None:
    pool = torch.empty(4, 2, 2, 3, 16, 8, device="meta")
    out = torch.ops.tiered_kv.token_checksums(pool, torch.empty(5, dtype=torch.int64, device="meta"))
    assert out.shape == (5, 16) and out.dtype == torch.int32 and out.device.type == "meta"


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "head_dim", "pad", "offset"),
    [
        (torch.bfloat16, 128, 0, 0),  # 16-byte loads
        (torch.bfloat16, 64, 32, 0),  # padded blocks
        (torch.float32, 8, 0, 4),  # a base off 16 bytes: one 32-bit word per load
        (torch.float32, 3, 4, 0),  # 12-byte rows
        (torch.bfloat16, 7, 2, 2),  # 14-byte rows: int16 words
        (torch.float16, 5, 0, 0),
        (torch.uint8, 13, 5, 1),  # 13-byte rows: bytes
        (torch.float8_e4m3fn, 3, 0, 0),
    ],
)
def test_the_cuda_kernel_gives_the_references_bits(dtype: torch.dtype, head_dim: int, pad: int, offset: int) -> None:
    """The CUDA op against the CPU reference bit for bit (every word size, repeated slots, both ways of passing the
    slots), and one changed byte anywhere in a token changes that token's checksum and no other."""
    assert _ext.load(), _ext.status()["error"]
    g = torch.Generator().manual_seed(head_dim + pad)
    shape = (9, 3, 2, 4, 16, head_dim)
    isz = torch.empty(0, dtype=dtype).element_size()
    stride = 3 * 2 * 4 * 16 * head_dim * isz + pad
    raw = torch.randint(0, 256, (offset + 9 * stride,), dtype=torch.uint8, generator=g).cuda()
    inner = (2 * 4 * 16 * head_dim, 4 * 16 * head_dim, 16 * head_dim, head_dim, 1)
    pool = raw[offset:].view(dtype).as_strided(shape, (stride // isz, *inner))
    few = [8, 0, 3, 3, 5, 0, 7]
    many = torch.randint(0, 9, (300,), generator=g).tolist()  # more than the kernel's parameters hold
    for slots in (few, many):
        want = token_checksums_ref(pool.cpu(), torch.tensor(slots))
        assert torch.equal(token_checksums(pool, slots).cpu(), want)
        on_device = torch.tensor(slots, device=pool.device)
        assert torch.equal(torch.ops.tiered_kv.token_checksums(pool, on_device).cpu(), want)
    before = token_checksums(pool, few).cpu()
    row_bytes = head_dim * isz
    for token in range(16):
        block = few[token % len(few)]
        layer, kv, head, at = (int(torch.randint(0, n, (1,), generator=g)) for n in (3, 2, 4, row_bytes))
        byte = offset + block * stride + (((layer * 2 + kv) * 4 + head) * 16 + token) * row_bytes + at
        raw[byte] ^= 1 << int(torch.randint(0, 8, (1,), generator=g))
        after = token_checksums(pool, few).cpu()
        assert torch.equal(after, token_checksums_ref(pool.cpu(), torch.tensor(few)))
        changed = after != before
        assert torch.equal(changed[:, token], torch.tensor([s == block for s in few]))
        assert int(changed.sum()) == few.count(block)
        before = after


async def _corrupt_and_reuse(integrity: bool, where: str, caplog: pytest.LogCaptureFixture) -> tuple[int, int, int]:
    """Commit a prompt, change its second block behind the cache's back, admit it again.

    Returns ``(tokens reused, wrong reused tokens, integrity errors)``.
    """
    prompt = list(range(1, 14))  # 3 full blocks and a partial one
    async with TieredKVCache(LAYOUT, gpu_blocks=8, host_blocks=8, device="cpu", integrity=integrity) as cache:
        [adm] = await cache.add_sequences([prompt])
        write_expected(cache, adm.seq_id, 0)
        cache.commit(adm.seq_id)
        cache.free(adm.seq_id)
        block = cache.blocks.lookup(cache.hasher.chain(torch.tensor(prompt).numpy())[1])
        assert block is not None
        if where == "host":
            assert await cache.evict("gpu", 8) > 0
            assert block.tier is not None and block.tier.value == "host"
        pool = cache.engine.pool(where).tensor
        pool[block.slot, 0, 0, 0, 1, 0] += 1  # one value of one token, as a stale or torn copy would leave it
        with caplog.at_level(logging.WARNING, logger="tiered_kv"):
            [again] = await cache.add_sequences([prompt])
        wrong = len(verify_expected(cache, again.seq_id, 0, again.tokens_reused))
        stats = cache.statistics()
        cache.free(again.seq_id)
        return again.tokens_reused, wrong, stats.integrity_errors


@pytest.mark.parametrize("where", ["gpu", "host"])
async def test_a_block_changed_after_commit_is_recomputed_not_served(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    reused, wrong, errors = await _corrupt_and_reuse(True, where, caplog)
    assert wrong == 0
    assert errors == 1
    assert reused == 4  # the first block only: the changed one and everything after it are recomputed
    assert any("changed since it was committed" in r.message for r in caplog.records)


async def test_without_integrity_checks_the_changed_block_is_served(caplog: pytest.LogCaptureFixture) -> None:
    """The same corruption with the checks off reaches the model: what the checks above prevent."""
    reused, wrong, errors = await _corrupt_and_reuse(False, "gpu", caplog)
    assert reused == 12 and wrong == 1 and errors == 0


async def test_a_changed_partial_source_is_not_copied_into_a_new_request() -> None:
    prompt = list(range(1, 11))  # 2 full blocks and 2 tokens of a third, cached as a partial block on free
    async with TieredKVCache(LAYOUT, gpu_blocks=8, host_blocks=8, device="cpu") as cache:
        [adm] = await cache.add_sequences([prompt])
        write_expected(cache, adm.seq_id, 0)
        cache.commit(adm.seq_id)
        tail = cache.page_table(adm.seq_id)[2]
        cache.free(adm.seq_id)
        cache.engine.pool("gpu").tensor[tail, 1, 1, 1, 1, 7] += 1
        [again] = await cache.add_sequences([[*prompt, 99, 98]])
        assert again.partial_tokens == 0 and again.tokens_reused == 8
        assert verify_expected(cache, again.seq_id, 0, again.tokens_reused) == []
        assert cache.statistics().integrity_errors == 1


@pytest.mark.gpu
async def test_integrity_checks_on_cuda() -> None:
    """The same checksums on the GPU: a changed block is refused, an intact one served."""
    prompt = list(range(1, 14))
    async with TieredKVCache(LAYOUT, gpu_blocks=8, host_blocks=8, device="cuda") as cache:
        [adm] = await cache.add_sequences([prompt])
        write_expected(cache, adm.seq_id, 0)
        cache.commit(adm.seq_id)
        cache.free(adm.seq_id)
        [ok] = await cache.add_sequences([prompt])
        assert ok.tokens_reused == 12 and cache.statistics().integrity_errors == 0
        slot = cache.page_table(ok.seq_id)[2]
        cache.free(ok.seq_id)
        cache.engine.pool("gpu").tensor[slot, 2, 1, 0, 3, 4] += 1
        [again] = await cache.add_sequences([prompt])
        assert again.tokens_reused == 8 and cache.statistics().integrity_errors == 1
        assert verify_expected(cache, again.seq_id, 0, again.tokens_reused) == []
        cpu = token_checksums(cache.engine.pool("gpu").tensor.cpu(), range(8))
        assert torch.equal(token_checksums(cache.engine.pool("gpu").tensor, range(8)).cpu(), cpu)


async def test_a_cancelled_admission_leaves_no_unchecked_partial_block() -> None:
    """The partial-copy target of an admission cancelled before its copy was verified is not cached (it would be a
    partial block with no checksum, its bytes unchecked, maybe not landed)."""
    import asyncio

    prompt = list(range(1, 11))  # blocks [1..4] [5..8] and a partial [9, 10]
    async with TieredKVCache(LAYOUT, gpu_blocks=8, host_blocks=8, device="cpu") as cache:
        [adm] = await cache.add_sequences([prompt])
        write_expected(cache, adm.seq_id, 0)
        cache.commit(adm.seq_id)
        cache.free(adm.seq_id)
        other = [*prompt[:9], 77, 78]  # shares 9 tokens: a partial copy of 1 token into a new block
        local = cache.engine.stream("local")  # where GPU -> GPU partial copies run: held, so the copy is in flight
        local.submit(stall_op(local, 0.3))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(cache.add_sequences([other]), 0.05)
        await cache.engine.drain()
        keys = cache.hasher.chain(torch.tensor(prompt).numpy())
        one_token = cache.hasher.block_key(keys[1], torch.tensor(other[8:9]).numpy())
        assert cache.blocks.lookup(one_token) is None
        cache.blocks.check()


async def test_a_block_adopted_back_from_the_file_tier_is_checked_and_refused_for_good(
    tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    """A block that left the lookup but stays in the file tier keeps its checksum when it is adopted again: bytes
    that changed before the spill (a self-consistent slot) are refused, and the key is not adopted a second time."""
    prompt = list(range(1, 14))
    async with TieredKVCache(
        LAYOUT, gpu_blocks=8, host_blocks=4, file_blocks=8, file_dir=str(tmp_path), device="cpu"
    ) as cache:
        [adm] = await cache.add_sequences([prompt])
        write_expected(cache, adm.seq_id, 0)
        cache.commit(adm.seq_id)
        cache.free(adm.seq_id)
        key = cache.hasher.chain(torch.tensor(prompt).numpy())[2]
        block = cache.blocks.lookup(key)
        assert block is not None
        await cache.evict("gpu", 8)
        assert block.tier is not None and block.tier.value == "host"
        cache.engine.pool("host").tensor[block.slot, 1, 0, 1, 2, 3] += 1  # changed before it reaches the file
        await cache.evict("host", 4)
        assert block.tier is not None and block.tier.value == "file"
        cache.blocks.invalidate(block)  # leaves the lookup; the file tier still holds its slot
        with caplog.at_level(logging.WARNING, logger="tiered_kv"):
            [again] = await cache.add_sequences([prompt])
        assert again.tokens_reused == 8 and cache.statistics().integrity_errors == 1
        assert verify_expected(cache, again.seq_id, 0, again.tokens_reused) == []
        cache.free(again.seq_id)
        assert cache.match(prompt)[0] == 8  # the refused key is not adopted again


async def test_commit_and_free_order_later_copies_after_the_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, ``commit`` (and ``free`` when it checksums a partial tail) makes the copies issued afterwards wait for
    the current stream: the compute that wrote the tokens and their checksums come first. The wiring, on the CPU."""
    import types

    async with TieredKVCache(LAYOUT, gpu_blocks=8, host_blocks=8, device="cpu") as cache:
        [adm] = await cache.add_sequences([list(range(1, 11))])
        write_expected(cache, adm.seq_id, 0)
        current = object()
        calls: list[object] = []
        monkeypatch.setattr(cache.engine, "device", types.SimpleNamespace(is_cuda=True, torch_device="cuda:0"))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
        monkeypatch.setattr(cache.engine, "sync_with_compute", calls.append)
        monkeypatch.setattr(cache._integrity, "record", lambda slots, valid: [None] * len(slots))
        cache.commit(adm.seq_id)
        assert calls == [current]
        cache.free(adm.seq_id)  # its 2-token tail is checksummed: ordered too
        assert calls == [current, current]


@pytest.mark.gpu
async def test_a_slow_compute_is_never_offloaded_before_it_lands() -> None:
    """The compute stream is busy for 0.2 s when the model writes and commits a prompt, and the blocks are evicted at
    once: the offload waits for the write (and its checksum), so the prompt comes back intact from the host tier."""
    from tiered_kv.testing import stall

    prompt = list(range(1, 9))
    async with TieredKVCache(LAYOUT, gpu_blocks=4, host_blocks=8, device="cuda") as cache:
        [adm] = await cache.add_sequences([prompt])
        stall(torch.cuda.current_stream(), 0.2)
        write_expected(cache, adm.seq_id, 0)  # queued behind the stall on the current stream
        cache.commit(adm.seq_id)
        cache.free(adm.seq_id)
        assert await cache.evict("gpu", 2) == 2
        [again] = await cache.add_sequences([[*prompt, 99]])
        assert again.blocks_from["host"] == 2 and again.tokens_reused == 8
        assert cache.statistics().integrity_errors == 0
        assert verify_expected(cache, again.seq_id, 0, 8) == []


async def test_checks_of_blocks_committed_apart_and_in_any_order_find_exactly_the_changed_ones(device: str) -> None:
    """Blocks committed in three commits, checked interleaved, rows out of order and repeated: one changed block."""
    g = torch.Generator().manual_seed(5)
    pool = torch.randint(-1000, 1000, (16, 3, 2, 2, 4, 8), generator=g).to(torch.float16).to(device)
    checks = IntegrityChecks(pool)
    first = checks.record([0, 1, 2, 3, 4], [4] * 5)  # one commit of five blocks
    second = checks.record([9, 7], [4, 2])  # another; slot 7 with 2 valid tokens
    third = checks.record([12], [4])
    order = [
        (7, second[1], 2),
        (3, first[3], 4),
        (0, first[0], 4),
        (12, third[0], 4),
        (4, first[4], 4),
        (9, second[0], 4),
        (1, first[1], 4),
        (3, first[3], 4),
    ]
    assert await checks.verify(order) == []
    pool[3, 1, 0, 1, 2, 5] += 1  # block 3 changed
    pool[7, 0, 1, 0, 3, 0] += 1  # block 7 changed beyond its valid tokens: not a mismatch
    assert await checks.verify(order) == [1, 7]
