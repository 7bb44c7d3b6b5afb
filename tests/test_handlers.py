"""The seam between the engine and the media: routing by (source tier, destination tier), one handler per pair.

A tier the engine was not built with plugs in as one handler (its medium and its routes); the engine's
fences, statistics and errors apply to it unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch
from helpers import fill_pool, same

from tiered_kv import KVLayout, Tier, TransferEngine, TransferError
from tiered_kv.device import Event, Stream
from tiered_kv.file import FileTier, FileTierConfig
from tiered_kv.handlers import Batch, Done, Medium, Routes
from tiered_kv.pools import check_indices
from tiered_kv.stream_copier import StreamCopier
from tiered_kv.testing import stall


class DictMedium:
    """An in-memory store of whole blocks, addressed by slot (stands in for a tier the engine does not know)."""

    name = "file"

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.slots: dict[int, torch.Tensor] = {}

    def check(self, indices: np.ndarray, what: str) -> None:
        check_indices(indices, self.num_blocks, what, f"the dict medium of {self.num_blocks} slots")


class _ThreadJob:
    lane: Stream | None = None

    def __init__(self, fn: object) -> None:
        self.fn = fn

    def start(self, done: Done) -> Event | None:
        def run() -> None:
            try:
                self.fn()  # type: ignore[operator]
            except BaseException as exc:
                done(exc)
                return
            done(None)

        threading.Thread(target=run).start()
        return None


class DictHandler:
    """HOST <-> the dict medium, on a thread per batch; ``fail_reads`` makes reads fail."""

    def __init__(self, host: torch.Tensor, medium: DictMedium) -> None:
        self.host = host
        self.medium_ = medium
        self.fail_reads = False
        self.closed = False

    @property
    def routes(self) -> Sequence[tuple[Tier, Tier]]:
        return [(Tier.HOST, Tier.FILE), (Tier.FILE, Tier.HOST)]

    @property
    def media(self) -> Mapping[Tier, Medium]:
        return {Tier.FILE: self.medium_}

    def validate(self, batch: Batch) -> Batch:
        if batch.num_tokens is not None:
            raise ValueError("whole blocks only")
        return batch

    def prepare(self, batch: Batch) -> _ThreadJob:
        src, dst = batch.lists()
        if batch.dst_tier is Tier.FILE:
            def write() -> None:
                for s, d in zip(src, dst, strict=True):
                    self.medium_.slots[d] = self.host[s].clone()
            return _ThreadJob(write)

        def read() -> None:
            if self.fail_reads:
                raise OSError("injected read failure")
            for s, d in zip(src, dst, strict=True):
                self.host[d].copy_(self.medium_.slots[s])
        return _ThreadJob(read)

    def close(self) -> None:
        self.closed = True


async def test_a_new_tier_is_one_handler_and_its_routes(layout: KVLayout, device: str) -> None:
    medium = DictMedium(8)
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        handler = DictHandler(engine.pool(Tier.HOST).tensor, medium)
        engine.add_handler(handler)
        assert engine.route(Tier.HOST, Tier.FILE) is handler and engine.medium(Tier.FILE) is medium
        assert isinstance(engine.route(Tier.GPU, Tier.GPU), StreamCopier)
        with pytest.raises(ValueError, match="copies from gpu to file are not supported"):
            engine.copy(Tier.GPU, [0], Tier.FILE, [0])
        with pytest.raises(ValueError, match="out of range"):
            engine.copy(Tier.HOST, [0], Tier.FILE, [8])
        with pytest.raises(ValueError, match="whole blocks only"):
            engine.copy(Tier.HOST, [0], Tier.FILE, [0], num_tokens=1)
        with pytest.raises(TypeError, match="no in-memory view"):
            engine.block(Tier.FILE, 0)
        assert engine.statistics().submitted == 0
        assert "file:8" in repr(engine)
    assert handler.closed


async def test_plugged_in_tier_is_fenced_and_counted(layout: KVLayout, device: str) -> None:
    """GPU -> host -> medium -> host: the medium's copies wait for the stream copies they depend on."""
    medium = DictMedium(8)
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        handler = DictHandler(engine.pool(Tier.HOST).tensor, medium)
        engine.add_handler(handler)
        gpu = fill_pool(engine, "gpu", 1)
        fill_pool(engine, "host", 2)
        stall(engine.stream("offload"), 0.2)
        engine.copy(Tier.GPU, [0], Tier.HOST, [0])  # lands late
        spill = engine.copy(Tier.HOST, [0], Tier.FILE, [3])  # must read what the offload wrote
        back = engine.copy(Tier.FILE, [3], Tier.HOST, [1])  # must read what the spill wrote
        await back
        assert spill.done()
        assert same(medium.slots[3], gpu[0]) and same(engine.block(Tier.HOST, 1), gpu[0])
        assert engine.statistics().blocks_by_direction == {"gpu->host": 1, "host->file": 1, "file->host": 1}
        handler.fail_reads = True
        with pytest.raises(TransferError, match="injected read failure"):
            await engine.copy(Tier.FILE, [3], Tier.HOST, [2])
        assert len(engine.fences) == 0 and engine.statistics().failed == 1


async def test_a_pair_or_medium_claimed_twice_is_refused(layout: KVLayout, tmp_path: object) -> None:
    async with TransferEngine(layout, gpu_blocks=2, host_blocks=2, device="cpu", file_dir=str(tmp_path), file_blocks=4) as engine:
        host = engine.pool(Tier.HOST).tensor
        with pytest.raises(ValueError, match="host->file is already routed"):
            engine.add_handler(DictHandler(host, DictMedium(4)))
        again = DictHandler(host, DictMedium(4))
        with pytest.raises(ValueError, match="already routed"):
            engine.add_handler(again)
        assert isinstance(engine.medium(Tier.FILE), FileTier)  # nothing changed
    with pytest.raises(ValueError, match="gpu->host is already routed"):
        TransferEngine(layout, gpu_blocks=2, host_blocks=2, device="cpu", file_dir=str(tmp_path), file_blocks=4,
                       handlers=[_GpuHostClaimer()])
    # the refused engine closed what it had opened: the slab's writer lock is free again
    FileTier(layout, FileTierConfig(str(tmp_path), 4)).close()


class _GpuHostClaimer(DictHandler):
    def __init__(self) -> None:
        super().__init__(torch.empty(0), DictMedium(1))

    @property
    def routes(self) -> Sequence[tuple[Tier, Tier]]:
        return [(Tier.GPU, Tier.HOST)]

    @property
    def media(self) -> Mapping[Tier, Medium]:
        return {}


def test_routes_refuse_a_medium_with_two_owners() -> None:
    routes = Routes(owned=[Tier.HOST])
    with pytest.raises(ValueError, match="the host medium already has an owner"):
        routes.add(_HostOwner())
    routes.add(DictHandler(torch.empty(0), DictMedium(1)))
    with pytest.raises(ValueError, match="already routed"):
        routes.add(DictHandler(torch.empty(0), DictMedium(1)))
    assert (Tier.HOST, Tier.FILE) in routes and routes.get(Tier.GPU, Tier.FILE) is None


class _HostOwner(_GpuHostClaimer):
    @property
    def routes(self) -> Sequence[tuple[Tier, Tier]]:
        return [(Tier.FILE, Tier.HOST)]

    @property
    def media(self) -> Mapping[Tier, Medium]:
        return {Tier.HOST: DictMedium(1)}
