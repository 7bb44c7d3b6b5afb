"""Shared fixtures: every async test runs on asyncio's default loop and on uvloop; CUDA tests auto-skip."""

from __future__ import annotations

import asyncio
import gc
import inspect
from collections.abc import AsyncIterator, Iterator, Mapping

import pytest
import torch
import uvloop

from tiered_kv import KVLayout, resolve_device
from tiered_kv.device import Device, Stream

HAS_CUDA = torch.cuda.is_available()


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, object]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
async def _loop_errors() -> AsyncIterator[None]:
    errors: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    yield
    gc.collect()  # surface "Task exception was never retrieved" now, while the handler is ours
    await asyncio.sleep(0)
    assert not errors, f"event loop reported errors: {errors}"


@pytest.fixture(autouse=True)
def _fail_on_loop_errors(request: pytest.FixtureRequest) -> None:
    """Fail an async test on any unobserved task exception or call of the loop's exception handler."""
    if inspect.iscoroutinefunction(getattr(request.node, "function", None)):
        request.getfixturevalue("_loop_errors")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Every engine test runs on the emulated device, and on CUDA where there is one."""
    name: str = request.param
    return name


@pytest.fixture
def dev(device: str) -> Iterator[Device]:
    """The device named by ``device``, resolved."""
    yield resolve_device(device)


@pytest.fixture
def stream(dev: Device) -> Iterator[Stream]:
    """A compute stream of ``dev``, synchronized and closed after the test."""
    s = dev.new_stream("compute")
    yield s
    s.synchronize()
    s.close()


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, tokens_per_block=8, dtype=torch.float16)
