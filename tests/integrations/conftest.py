"""Integration tests against the real engines: see engine_import.py (skip only when the engine is missing).

The engines' own imports warn (deprecations inside torch / vLLM / SGLang); those are not ours, so warnings
raised while an engine runs are not errors here (the main suite keeps ``filterwarnings = error``).
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "integrations" in item.nodeid:
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::FutureWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::UserWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::RuntimeWarning"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """Under ``TIERED_KV_REQUIRE_ENGINES=1`` (``.ci/integrations``) a skipped integration test is a failure."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("TIERED_KV_REQUIRE_ENGINES") == "1" and report.skipped and "integrations" in item.nodeid:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} was skipped, but integration tests must run here: {report.longrepr}"
