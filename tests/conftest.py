"""Shared fixtures: every async test runs on asyncio's default loop and on uvloop; CUDA tests auto-skip."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Mapping

import pytest
import torch
import uvloop

from tiered_kv import KVLayout

HAS_CUDA = torch.cuda.is_available()


# Exception-handler calls of the loops the tests run on (unobserved task exceptions, callback errors).
LOOP_ERRORS: list[dict[str, object]] = []


def _recording(factory: Callable[[], asyncio.AbstractEventLoop]) -> Callable[[], asyncio.AbstractEventLoop]:
    # The handler must be installed on the loop the test runs on; a sync fixture cannot reach that loop
    # (asking the policy for "the" loop there creates a stray one, which also leaks as a ResourceWarning).
    def make() -> asyncio.AbstractEventLoop:
        loop = factory()
        loop.set_exception_handler(lambda _loop, ctx: LOOP_ERRORS.append(ctx))
        return loop

    return make


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, object]:
    return {"asyncio": _recording(asyncio.new_event_loop), "uvloop": _recording(uvloop.new_event_loop)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fail_on_loop_errors(request: pytest.FixtureRequest) -> object:
    """Fail a test on any unobserved task exception or call of the loop's exception handler."""
    LOOP_ERRORS.clear()
    yield
    gc.collect()
    errors = list(LOOP_ERRORS)
    LOOP_ERRORS.clear()
    assert not errors, f"event loop reported errors: {errors}"


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Every engine test runs on the emulated device, and on CUDA where there is one."""
    return request.param


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, tokens_per_block=8, dtype=torch.float16)
