"""README's "API in ten lines" runs as written (at small sizes), with the user's pieces supplied.

The snippet is read from README.md at test time, so an edit of it is tested as it stands. The only changes
made before running it: sizes become small (``num_layers``, ``num_kv_heads``, ``head_dim``, ``*_blocks``)
and ``file_dir`` points at a temporary directory; the names a user brings (``prompt_ids``, ``prefill``,
``next_id``) are defined. Nothing else is provided: a missing import fails the test.
"""

from __future__ import annotations

import pathlib
import re
import textwrap
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent

SMALL = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "gpu_blocks": 64, "host_blocks": 64, "file_blocks": 64}


def api_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^## API in ten lines\s*\n+```python\n(.*?)```", text, re.S | re.M)
    assert match, "README must have an '## API in ten lines' section starting with a ```python block"
    return match.group(1)


def small(snippet: str, file_dir: str) -> str:
    for name, value in SMALL.items():
        snippet = re.sub(rf"\b{name}=\d+", f"{name}={value}", snippet)
    snippet = re.sub(r"\bfile_dir=(\"[^\"]*\"|'[^']*')", f"file_dir={file_dir!r}", snippet)
    return snippet


async def test_the_api_in_ten_lines_runs_as_written(tmp_path):
    snippet = small(api_snippet(), str(tmp_path))
    calls: list[tuple[tuple[int, ...], int]] = []

    def prefill(page_table: tuple[int, ...], start: int) -> None:  # the user's model would write KV here
        calls.append((tuple(page_table), start))

    namespace: dict[str, Any] = {"prompt_ids": list(range(1, 41)), "next_id": 7, "prefill": prefill}
    code = "async def _readme_snippet():\n" + textwrap.indent(snippet, "    ") + "\n    return locals()\n"
    exec(compile(code, "README.md: API in ten lines", "exec"), namespace)
    done = await namespace["_readme_snippet"]()
    assert calls and calls[0][1] == 0 and len(calls[0][0]) == 3  # 40 tokens: 3 blocks of 16, nothing reused
    assert done.get("cache") is not None and done.get("adm") is not None  # it ran to its last line
    assert done["adm"].tokens_reused == 0
    assert "/nvme" not in snippet and "num_layers=2" in snippet  # the sizes were made small


def test_the_snippet_is_found_and_made_small():
    snippet = api_snippet()
    assert "TieredKVCache" in snippet and "await" in snippet
    made = small('KVLayout(num_layers=32, head_dim=128), file_dir="/x"', "/tmp/y")
    assert made == "KVLayout(num_layers=2, head_dim=16), file_dir='/tmp/y'"
