"""Static checks run in CI: ruff (style, docstrings of public names) and mypy --strict (types).

Both read their configuration from pyproject.toml. ``tiered_kv.backends`` lives in ``backends/`` and is mapped
into the package at install time, so mypy checks a tree that mirrors the installed layout: links to the
checkout's ``tiered_kv/*``, ``backends/`` as ``tiered_kv/backends`` and ``tests/``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:  # both are in the `test` extra: CI always has them
        pytest.fail(f"{module} is not installed; install the test extra: pip install -e '.[test]'")


def test_ruff_is_clean() -> None:
    _need("ruff")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.timeout(900)  # a cold run reads torch's annotations: a minute or two
def test_mypy_strict_is_clean(tmp_path: Path) -> None:
    _need("mypy")
    tree = tmp_path / "tree"
    (tree / "tiered_kv").mkdir(parents=True)
    for entry in (ROOT / "tiered_kv").iterdir():
        if entry.name != "__pycache__":
            os.symlink(entry, tree / "tiered_kv" / entry.name)
    os.symlink(ROOT / "backends", tree / "tiered_kv" / "backends")
    os.symlink(ROOT / "tests", tree / "tests")
    # tests/integrations has a conftest of its own: a second run, so the two conftest modules do not collide
    for targets in (["tiered_kv", "tests", "--exclude", "tests/integrations/"], ["tests/integrations"]):
        r = subprocess.run(
            [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
             str(tmp_path / "cache"), *targets],
            cwd=tree, capture_output=True, text=True, timeout=900,
        )
        assert r.returncode == 0, r.stdout + r.stderr


def test_every_subpackage_is_installed() -> None:
    """pyproject lists packages explicitly: a new subpackage left out would be missing from every install."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "tiered_kv").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found <= listed, f"subpackages missing from [tool.setuptools] packages: {sorted(found - listed)}"
