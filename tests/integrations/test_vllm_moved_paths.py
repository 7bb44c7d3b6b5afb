"""With the real vLLM: the old ``tiered_kv.integrations.vllm_*`` paths warn and give the package's objects, and the
module paths users put in vLLM's config (``spec_module_path``, a tier's ``module_path``) import without a warning.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest
from engine_import import require

require("vllm")

MODULES = ["file", "host", "manager", "plugin", "shared", "versions", "worker"]


@pytest.mark.parametrize("module", MODULES)
def test_an_old_vllm_path_warns_and_gives_the_same_objects(module: str) -> None:
    old, new = f"tiered_kv.integrations.vllm_{module}", f"tiered_kv.integrations.vllm.{module}"
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        moved = importlib.import_module(old)
    target = importlib.import_module(new)
    assert moved.__all__ and set(moved.__all__) == set(target.__all__)
    for name in target.__all__:
        assert getattr(moved, name) is getattr(target, name)


def test_the_config_module_paths_import_without_a_warning_of_ours() -> None:
    """A fresh process, as vLLM loads the spec and the tier by module path: no tiered_kv warning on the way."""
    code = """
        import warnings
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            spec = OffloadingSpecFactory.get_spec_cls(
                {"spec_name": "TieredKVOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"})
            tier = SecondaryTierFactory.get_tier_class(
                {"type": "TieredKVFileTier", "module_path": "tiered_kv.integrations.vllm"})
        import tiered_kv.integrations.vllm as package
        assert spec is package.TieredKVOffloadingSpec and tier is package.TieredKVFileTier
        ours = [f"{w.category.__name__}: {w.message} ({w.filename})" for w in caught
                if "tiered_kv" in str(w.message) or "tiered_kv" in w.filename]
        assert not ours, ours
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
