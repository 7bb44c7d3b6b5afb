"""README.md and docs/*.md: every ```python block runs as written, and the front door stays small.

Each ```python block is run unchanged in a fresh interpreter (its own process, a temporary working directory, a
timeout), so a block that needs a name it does not define, a GPU or a server fails here: such illustrations are
fenced as ```text instead. Also checked: README's size, its links into docs/, that every ``TIERED_KV_*`` variable
the code reads has its row in docs/configuration.md, and that nothing points into the retired notes directory.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the checkout first, as an installed copy would be found (tiered_kv maps backends/ itself)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks() -> list[tuple[str, str]]:
    """``(id, code)`` of every ```python block, ids like ``docs/api.md:12`` (the block's first line)."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 2
            blocks.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return blocks


BLOCKS = python_blocks()


def test_the_pages_exist_and_hold_python_blocks() -> None:
    names = {p.name for p in PAGES}
    assert {"architecture.md", "configuration.md", "integrations.md", "testing.md", "benchmarks.md"} <= names
    assert sum(1 for name, _ in BLOCKS if name.startswith("README.md")) >= 2
    assert len(BLOCKS) >= 6


@pytest.mark.timeout(360)
@pytest.mark.parametrize(("name", "code"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_every_python_block_runs_as_written(name: str, code: str, tmp_path: pathlib.Path) -> None:
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{name} failed:\n{r.stderr[-3000:]}"


def test_readme_is_the_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines; move detail into docs/"
    long = [(i, len(line)) for i, line in enumerate(lines, 1) if len(line) > 120]
    assert not long, f"README.md lines over 120 characters (line, length): {long}"


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but ``-`` and ``_`` dropped, blanks to ``-``."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # a '#' in a code block is no heading
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#{1,6} (.+)$", text, re.M)
    }


def test_links_into_docs_resolve() -> None:
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*\.md)?(?:#([^)\s]+))?\)", page.read_text()):
            if not target and not anchor:
                continue
            linked = (page.parent / target).resolve() if target else page
            assert linked.is_file(), f"{page.name} links to a missing {target}"
            if anchor:
                assert anchor in anchors(linked), f"{page.name} links to a missing heading {target}#{anchor}"
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"README does not link docs/{page.name}"


def test_every_environment_variable_the_code_reads_is_documented() -> None:
    sources = [
        p
        for d in ("tiered_kv", "backends", "kernels")
        for p in (ROOT / d).rglob("*")
        if p.suffix in {".py", ".cpp", ".cu", ".cuh", ".h"}
    ]
    names = set()
    for path in sources:
        names |= set(re.findall(r"\bTIERED_KV_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert len(names) > 20
    documented = set(
        re.findall(r"^\| `(TIERED_KV_[A-Z0-9_]+)`", (ROOT / "docs" / "configuration.md").read_text(), re.M)
    )
    assert not names - documented, f"missing from docs/configuration.md: {sorted(names - documented)}"


def test_nothing_points_into_the_notes_directory() -> None:
    retired = "notes" + "/"
    skip = {".git", ".venv", "__pycache__", "build", "dist", ".whl", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
    found = []
    for directory, subdirs, files in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if d not in skip and not d.endswith(".egg-info")]
        for name in files:
            path = pathlib.Path(directory, name)
            if path.suffix not in {".py", ".md", ".cu", ".cpp", ".cuh", ".h", ".toml", ".txt", ".cfg", ""}:
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            if retired in text:
                found.append(str(path.relative_to(ROOT)))
    assert not found, f"references to the retired notes directory: {found}"
