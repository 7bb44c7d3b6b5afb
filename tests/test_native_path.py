"""The native submission path of small copies (``kernels/fast_path.cpp``, :class:`tiered_kv.copyops.NativeCopy`).

One call into C++ per small copy issues the DMA or the kernel, records a pooled event and enqueues the completion
signal. These tests check it against the op path (``EngineConfig(native_submit=False)``: ``copy_blocks_list``) and
the reference, byte for byte: kernel and DMA, whole and partial blocks, layer ranges, block- and layer-major pools;
index errors before anything is enqueued; the pooled events (query, synchronize, stream-side waits, recycling under
cross-stream fences); and that the engine really takes the path (no torch event per call).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest
import torch

from tiered_kv import KVLayout, Tier, TransferEngine, _ext
from tiered_kv.config import EngineConfig
from tiered_kv.copyops import NativeCopy
from tiered_kv.pools import BlockPool
from tiered_kv.testing import fill_random

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def native() -> Any:
    assert _ext.load(), f"the CUDA extension must build on a CUDA machine: {_ext.status()['error']}"
    module = _ext.native()
    assert module is not None, "the extension must expose the native submission path"
    return module


LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, tokens_per_block=8, dtype=torch.float16)


def _engine(path: str) -> TransferEngine:
    return TransferEngine(LAYOUT, gpu_blocks=32, host_blocks=32, device="cuda", config=EngineConfig(copy_path=path))


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (random fills hold NaNs, which torch.equal never calls equal)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _tensor(engine: TransferEngine, tier: Tier) -> torch.Tensor:
    pool = engine.pool(tier)
    assert isinstance(pool, BlockPool)
    return pool.tensor


def _event_counter() -> tuple[list[object], Any]:
    """A list and a ``torch.cuda.Event.__new__`` that appends to it (to patch in once warmed up)."""
    made: list[object] = []
    real = torch.cuda.Event.__new__

    def counting_new(cls: type, *a: object, **k: object) -> Any:
        made.append(cls)
        return real(cls)  # type: ignore[no-untyped-call]

    return made, counting_new


@pytest.mark.parametrize("path", ["kernel", "dma"])
@pytest.mark.parametrize("num_tokens", [None, 3])
@pytest.mark.parametrize("layers", [None, (1, 3)])
def test_native_copies_match_the_source_bytes(
    native: Any, path: str, num_tokens: int | None, layers: tuple[int, int] | None
) -> None:
    """Offload, onboard and GPU->GPU copies through the native path land exactly the bytes they name."""

    async def main() -> None:
        async with _engine(path) as engine:
            assert engine.route(Tier.GPU, Tier.HOST).copier.native  # type: ignore[attr-defined]
            gpu, host = _tensor(engine, Tier.GPU), _tensor(engine, Tier.HOST)
            fill_random(gpu)
            fill_random(host)
            torch.cuda.synchronize()  # the fill runs on the default stream; the engine's streams do not wait for it
            rng = random.Random(7)
            for _ in range(40):
                k = rng.choice([1, 2, 5, 9])
                src = rng.sample(range(32), k)
                dst = rng.sample(range(32), k)
                pair = rng.choice([(Tier.GPU, Tier.HOST), (Tier.HOST, Tier.GPU), (Tier.GPU, Tier.GPU)])
                if pair == (Tier.GPU, Tier.GPU):
                    dst = [b for b in dst if b not in src][: len(src)]
                    src = src[: len(dst)]
                    if not src:
                        continue
                a = (gpu if pair[0] is Tier.GPU else host).cpu()
                b_before = (gpu if pair[1] is Tier.GPU else host).cpu()
                await engine.copy(pair[0], src, pair[1], dst, num_tokens=num_tokens, layers=layers)
                b_after = (gpu if pair[1] is Tier.GPU else host).cpu()
                expected = b_before.clone()
                lo, hi = (0, LAYOUT.num_layers) if layers is None else layers

                t = LAYOUT.tokens_per_block if num_tokens is None else num_tokens
                for s, d in zip(src, dst, strict=True):
                    expected[d, lo:hi, :, :, :t] = a[s, lo:hi, :, :, :t]
                assert _bits(b_after, expected), f"{pair} {src}->{dst} tokens={num_tokens} layers={layers}"

    asyncio.run(main())


@pytest.mark.parametrize("num_tokens", [None, 3])
def test_calls_of_up_to_256_blocks_take_the_native_path_whole_or_partial(
    native: Any, num_tokens: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernel copies of 48..256 blocks (bases and indices in the kernel's large parameters where the runtime takes
    them) and partial copies go through one NativeCopy each, with no torch event, and land exactly."""
    made, counting_new = _event_counter()

    async def main() -> None:
        small = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=8, dtype=torch.float16)
        cfg = EngineConfig(copy_path="kernel")
        async with TransferEngine(small, gpu_blocks=600, host_blocks=300, device="cuda", config=cfg) as engine:
            gpu, host = _tensor(engine, Tier.GPU), _tensor(engine, Tier.HOST)
            fill_random(gpu)
            fill_random(host)
            torch.cuda.synchronize()
            await engine.copy(Tier.GPU, [0], Tier.HOST, [1], num_tokens=num_tokens)  # warm-up: plans, waiter
            monkeypatch.setattr(torch.cuda.Event, "__new__", counting_new)
            rng = random.Random(11)
            pairs: list[tuple[Tier, Tier]] = [(Tier.GPU, Tier.HOST), (Tier.HOST, Tier.GPU), (Tier.GPU, Tier.GPU)]
            for k in (47, 48, 100, 255, 256):
                for pair in pairs:
                    src = rng.sample(range(300), k)
                    dst = rng.sample(range(300, 600) if pair == (Tier.GPU, Tier.GPU) else range(300), k)
                    a = (gpu if pair[0] is Tier.GPU else host).cpu()
                    expected = (gpu if pair[1] is Tier.GPU else host).cpu()
                    t = engine.copy(pair[0], src, pair[1], dst, num_tokens=num_tokens)
                    assert isinstance(t._marker.event, native.DeviceEvent), (k, pair)
                    assert t.nbytes == k * (small.bytes_per_block if num_tokens is None else small.partial_bytes(3))
                    await t
                    n = small.tokens_per_block if num_tokens is None else num_tokens
                    for s, d in zip(src, dst, strict=True):
                        expected[d, :, :, :, :n] = a[s, :, :, :, :n]
                    got = (gpu if pair[1] is Tier.GPU else host).cpu()
                    assert _bits(got, expected), f"{pair} k={k} tokens={num_tokens}"
            assert made == []

    asyncio.run(main())


def test_native_path_takes_no_torch_event_per_call(native: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1-block copy is one NativeCopy: no torch.cuda.Event is made, the returned marker event is native."""
    made, counting_new = _event_counter()

    async def main() -> None:
        async with _engine("kernel") as engine:
            await engine.copy(Tier.GPU, [0], Tier.HOST, [1])  # warm-up: waiter thread, plans
            monkeypatch.setattr(torch.cuda.Event, "__new__", counting_new)
            t = engine.copy(Tier.GPU, [2], Tier.HOST, [3])
            assert isinstance(t._marker.event, native.DeviceEvent)
            await t
            assert made == []

    asyncio.run(main())


def test_index_errors_raise_before_anything_is_enqueued(native: Any) -> None:
    """The C++ entry checks its indices: out of range or unpaired -> an error, no event, nothing copied."""

    async def main() -> None:
        async with _engine("kernel") as engine:
            copier = engine.route(Tier.GPU, Tier.HOST).copier  # type: ignore[attr-defined]
            gpu, host = engine.pool(Tier.GPU), engine.pool(Tier.HOST)
            host_t = _tensor(engine, Tier.HOST)
            fill_random(host_t)
            before = host_t.clone()
            op = copier.build(gpu, [0], host, [99], None, stream=engine.stream("offload"))
            assert isinstance(op, NativeCopy)
            with pytest.raises(IndexError, match="out of range for a pool of 32 blocks"):
                op()
            plan = copier._native_plan(copier._pair(gpu, host, 8), 8, 0)
            handle = engine.stream("offload").torch_stream.cuda_stream  # type: ignore[attr-defined]
            with pytest.raises(ValueError, match="must pair up"):
                native.submit(plan, [0, 1], [2], handle, 0)
            with pytest.raises(TypeError, match="list of ints"):
                native.submit(plan, (1,), [2], handle, 0)
            with pytest.raises(IndexError, match="src_blocks holds -1"):
                native.submit(plan, [-1], [2], handle, 0)
            torch.cuda.synchronize()
            assert _bits(host_t, before)

    asyncio.run(main())


def test_device_events_wait_query_and_recycle(native: Any) -> None:
    """A pooled event orders another stream (stream-side), answers query/synchronize, and is reused safely."""
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1 << 22, device="cuda")
    handles = set()
    for i in range(50):
        with torch.cuda.stream(a):
            torch.cuda._sleep(200_000)  # keep stream a busy so the wait matters
            x.fill_(float(i))
        ev = native.record(torch.cuda.current_device(), a.cuda_stream, 0)
        ev.wait(b.cuda_stream)
        with torch.cuda.stream(b):
            y = x.clone()
        b.synchronize()
        assert ev.query()
        ev.synchronize()
        assert float(y[0]) == float(i) and float(y[-1]) == float(i)
        handles.add(ev.handle)
        del ev
    assert len(handles) <= 2, "events go back to the pool when their last reference goes"


def test_cross_stream_fences_with_pooled_events_under_load(native: Any) -> None:
    """Chains offload -> onboard -> local on three streams with stream-side fences, events recycled all along.

    An oracle of the block contents follows every copy; each final byte must match it.
    """

    async def main() -> None:
        async with _engine("kernel") as engine:
            gpu_t, host_t = _tensor(engine, Tier.GPU), _tensor(engine, Tier.HOST)
            fill_random(gpu_t)
            fill_random(host_t)
            torch.cuda.synchronize()
            oracle = {Tier.GPU: gpu_t.cpu().clone(), Tier.HOST: host_t.cpu().clone()}
            rng = random.Random(11)
            pending = []
            for _ in range(600):
                pair = rng.choice([(Tier.GPU, Tier.HOST), (Tier.HOST, Tier.GPU), (Tier.GPU, Tier.GPU)])
                k = rng.choice([1, 1, 2, 4])
                src = rng.sample(range(32), k)
                dst = rng.sample([b for b in range(32) if pair[0] is not pair[1] or b not in src], k)
                pending.append(engine.copy(pair[0], src, pair[1], dst))
                snap = oracle[pair[0]][src].clone()
                oracle[pair[1]][dst] = snap
                if len(pending) > 24 or rng.random() < 0.05:
                    await asyncio.gather(*pending)
                    pending.clear()
            await asyncio.gather(*pending)
            assert _bits(gpu_t.cpu(), oracle[Tier.GPU])
            assert _bits(host_t.cpu(), oracle[Tier.HOST])

    asyncio.run(main())


@pytest.mark.parametrize("num_tokens", [None, 3])
@pytest.mark.parametrize("path", ["kernel", "dma"])
def test_repeated_shapes_copy_byte_for_byte_and_in_fence_order(native: Any, num_tokens: int | None, path: str) -> None:
    """Small copies through the native submission path, byte for byte, repeated shapes included.

    Offload, onboard and GPU->GPU; lists and arrays. Copies issued while an op of their pools is in flight land
    after the op they depend on (a reader of its destination, a writer of a block two copies read).
    """

    async def main() -> None:
        async with _engine(path) as engine:
            gpu, host = _tensor(engine, Tier.GPU), _tensor(engine, Tier.HOST)
            fill_random(gpu)
            fill_random(host)
            torch.cuda.synchronize()
            n = LAYOUT.tokens_per_block if num_tokens is None else num_tokens
            for pair in [(Tier.GPU, Tier.HOST), (Tier.HOST, Tier.GPU), (Tier.GPU, Tier.GPU)]:
                for k in (1, 4, 12):
                    src = list(range(k))
                    dst = list(range(30 - k, 30))  # 3 rounds, one block further each: up to block 31
                    for use_array in (False, True, False):
                        s = np.array(src) if use_array else list(src)
                        d = np.array(dst) if use_array else list(dst)
                        a = (gpu if pair[0] is Tier.GPU else host).cpu()
                        expected = (gpu if pair[1] is Tier.GPU else host).cpu()
                        await engine.copy(pair[0], s, pair[1], d, num_tokens=num_tokens)
                        for x, y in zip(src, dst, strict=True):
                            expected[y, :, :, :, :n] = a[x, :, :, :, :n]
                        assert _bits((gpu if pair[1] is Tier.GPU else host).cpu(), expected), (pair, k)
                        src = [b + 1 for b in src]  # the same shape (one run), other blocks
                        dst = [b + 1 for b in dst]
            # an op in flight on the GPU pool (not completed on the loop until it runs again): a copy reading its
            # destination waits for it; one of other blocks goes beside it
            fill_random(gpu)
            torch.cuda.synchronize()
            g0 = gpu.cpu()
            first = engine.copy(Tier.GPU, [0, 1, 2, 3], Tier.GPU, [16, 17, 18, 19], num_tokens=num_tokens)
            second = engine.copy(Tier.GPU, [16, 17, 18, 19], Tier.GPU, [24, 25, 26, 27], num_tokens=num_tokens)
            third = engine.copy(Tier.GPU, [4, 5, 6, 7], Tier.GPU, [20, 21, 22, 23], num_tokens=num_tokens)
            await asyncio.gather(first, second, third)
            g = gpu.cpu()
            for x, y in zip(range(8), range(16, 24), strict=True):
                assert _bits(g[y, :, :, :, :n], g0[x, :, :, :, :n]), (x, y)
            for x, y in zip(range(4), range(24, 28), strict=True):
                assert _bits(g[y, :, :, :, :n], g0[x, :, :, :, :n]), f"the dependent copy did not see the first: {y}"
            # two readers of one block (a reader set in the fence table), then a copy overwriting it: it waits
            await engine.copy(Tier.GPU, [1], Tier.GPU, [9], num_tokens=num_tokens)  # the 1-pair shape, decided
            g0 = gpu.cpu()
            readers = [engine.copy(Tier.GPU, [0], Tier.GPU, [b], num_tokens=num_tokens) for b in (28, 29)]
            overwrite = engine.copy(Tier.GPU, [30], Tier.GPU, [0], num_tokens=num_tokens)
            await asyncio.gather(*readers, overwrite)
            g = gpu.cpu()
            assert _bits(g[28, :, :, :, :n], g0[0, :, :, :, :n]) and _bits(g[29, :, :, :, :n], g0[0, :, :, :, :n])
            assert _bits(g[0, :, :, :, :n], g0[30, :, :, :, :n])

    asyncio.run(main())
