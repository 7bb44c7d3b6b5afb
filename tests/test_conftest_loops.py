"""Regression: the loop-error check of conftest watches the loop the test actually runs on."""

from __future__ import annotations

import asyncio

from conftest import LOOP_ERRORS


async def test_exception_handler_is_on_the_running_loop() -> None:
    loop = asyncio.get_running_loop()
    assert loop.get_exception_handler() is not None
    loop.call_exception_handler({"message": "probe"})
    assert LOOP_ERRORS and LOOP_ERRORS[-1]["message"] == "probe"
    LOOP_ERRORS.clear()  # this call was the probe, not a failure
