"""Integration tests against the real engines: see engine_import.py (skip only when the engine is missing).

The engines' own imports warn (deprecations inside torch / vLLM / SGLang); those are not ours, so warnings
raised while an engine runs are not errors here (the main suite keeps ``filterwarnings = error``).
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "integrations" in item.nodeid:
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::FutureWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::UserWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::RuntimeWarning"))
