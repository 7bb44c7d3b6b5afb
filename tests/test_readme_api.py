"""README's "API in ten lines" runs as written and does what the text under it says.

The program is read from README.md at test time and run unchanged in a fresh interpreter (so a missing import
fails the test): the first admission of the prompt reuses nothing, the second reuses every token but the last.
tests/test_docs_snippets.py runs every other ```python block of README.md and docs/ the same way.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def api_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^## API in ten lines\n(?:(?!```|## )[^\n]*\n)*```python\n(.*?)^```", text, re.S | re.M)
    assert match, "README must have an '## API in ten lines' section whose first code block is ```python"
    return match.group(1)


def test_the_api_in_ten_lines_runs_as_written(tmp_path):
    snippet = api_snippet()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("reused 0 tokens"), r.stdout
    assert lines[1].startswith("reused 39 tokens"), r.stdout  # 40 tokens: all but the last, which is computed
    assert list(tmp_path.iterdir()) == []  # its file tier lived in a temporary directory


def test_the_snippet_is_a_small_cpu_program():
    snippet = api_snippet()
    assert "TieredKVCache" in snippet and "await" in snippet and "asyncio.run(" in snippet
    assert 'device="cpu"' in snippet and "/nvme" not in snippet
    assert len(snippet.splitlines()) <= 20
