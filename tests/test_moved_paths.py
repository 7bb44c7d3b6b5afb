"""Import paths that moved keep working for one release: each warns once (DeprecationWarning) and names the new path."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import textwrap

import pytest

MOVED = {
    "tiered_kv.integrations.transformers": ("tiered_kv.integrations.hf", "CachedGenerator"),
    "tiered_kv.integrations.hf_kv": ("tiered_kv.integrations.hf.kv", "RowTargets"),
    "tiered_kv.integrations.hf_model": ("tiered_kv.integrations.hf.model", "output_cache"),
    "tiered_kv.integrations.hf_results": ("tiered_kv.integrations.hf.results", "Generation"),
    "tiered_kv.integrations.hf_sampling": ("tiered_kv.integrations.hf.sampling", "SamplingOptions"),
    "tiered_kv.integrations.models": ("tiered_kv.integrations.hf.models", "random_causal_lm"),
    "tiered_kv.integrations.byte_tokenizer": ("tiered_kv.integrations.hf.tokenizer", "ByteTokenizer"),
    "tiered_kv.integrations.vllm_file": ("tiered_kv.integrations.vllm.file", "TieredKVFileTier"),
    "tiered_kv.integrations.vllm_host": ("tiered_kv.integrations.vllm.host", "HostTable"),
    "tiered_kv.integrations.vllm_manager": ("tiered_kv.integrations.vllm.manager", "TieredKVOffloadingManager"),
    "tiered_kv.integrations.vllm_plugin": ("tiered_kv.integrations.vllm.plugin", "register"),
    "tiered_kv.integrations.vllm_shared": ("tiered_kv.integrations.vllm.shared", "Settings"),
    "tiered_kv.integrations.vllm_versions": ("tiered_kv.integrations.vllm.versions", "check_version"),
    "tiered_kv.integrations.vllm_worker": ("tiered_kv.integrations.vllm.worker", "TieredKVOffloadingWorker"),
}
#: The old vLLM paths whose modules import no vLLM (the others need it, as they did before they moved).
VLLM_FREE = {
    "tiered_kv.integrations.vllm_host",
    "tiered_kv.integrations.vllm_plugin",
    "tiered_kv.integrations.vllm_versions",
}


def _needs(old: str) -> str | None:
    """The library the modules behind ``old`` import, or ``None``."""
    if ".integrations.vllm_" in old:
        return None if old in VLLM_FREE else "vllm"
    return "transformers"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_gives_the_same_objects(old: str) -> None:
    new, name = MOVED[old]
    library = _needs(old)
    if library is not None and importlib.util.find_spec(library) is None:
        if library != "vllm":
            pytest.skip(f"{library} is not installed")
        # without vLLM the old path still names the new one, then fails as it always did: vLLM is missing
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"), pytest.raises(ImportError, match="vllm"):
            importlib.import_module(old)
        return
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    target = importlib.import_module(new)
    assert getattr(module, name) is getattr(target, name)
    assert set(module.__all__) == set(target.__all__)
    for public in module.__all__:
        assert getattr(module, public) is getattr(target, public)


def _run(code: str, *flags: str) -> None:
    r = subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_vllm_spec_module_path_imports_without_a_warning_and_without_vllm() -> None:
    """``spec_module_path="tiered_kv.integrations.vllm"`` is the package itself: no warning, its names unchanged.

    The package and its vLLM-free modules import no vLLM; its public names import it on first use.
    """
    _run(
        """
        import sys
        import tiered_kv.integrations.vllm as package
        import tiered_kv.integrations.vllm.host, tiered_kv.integrations.vllm.plugin
        import tiered_kv.integrations.vllm.verify, tiered_kv.integrations.vllm.versions
        assert "vllm" not in sys.modules, "the vLLM package imported vLLM"
        assert sorted(package.__all__) == [
            "LoadVerification", "MANAGERS", "TieredKVConnector", "TieredKVFileTier", "TieredKVLoadStoreSpec",
            "TieredKVOffloadingManager", "TieredKVOffloadingSpec", "TieredKVOffloadingWorker", "VLLMStatistics",
            "WORKERS", "content_key",
        ]
        assert set(package.__all__) <= set(dir(package))
        assert tiered_kv.integrations.vllm.plugin._MODULE == "tiered_kv.integrations.vllm"
        """,
        "-W",
        "error",
    )


def test_the_old_vllm_free_paths_still_import_no_vllm() -> None:
    _run(
        """
        import sys, warnings
        warnings.simplefilter("ignore", DeprecationWarning)
        import tiered_kv.integrations.vllm_host, tiered_kv.integrations.vllm_plugin
        import tiered_kv.integrations.vllm_versions
        assert "vllm" not in sys.modules, "an old vLLM-free path imported vLLM"
        """,
    )


def test_an_unknown_name_of_the_vllm_package_is_an_attribute_error() -> None:
    import tiered_kv.integrations.vllm as package

    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        package.nothing  # noqa: B018
