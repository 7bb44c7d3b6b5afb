"""README's set-up commands are the ones CI runs, verbatim."""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def join_continued(block: str) -> str:
    """A line ending in `` \\`` goes on, as in the shell, on the next one (its leading blanks dropped)."""
    return re.sub(r" \\\n[ \t]*", " ", block)


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- setup -->\s*```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert block, "README must hold the set-up commands in a ```bash block right after <!-- setup -->"
    lines = join_continued(block.group(1)).splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#")]


def test_a_continued_line_is_one_command():
    assert join_continued("a && \\\n  b && c\nd\n").splitlines() == ["a && b && c", "d"]
    r = subprocess.run(["bash", "-c", "echo a && \\\n  echo b"], capture_output=True, text=True, timeout=30)
    assert r.stdout.split() == ["a", "b"]  # the shell reads it the same way


def test_readme_has_exactly_two_setup_commands():
    assert len(readme_commands()) == 2


def test_ci_runs_the_readme_commands_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in readme_commands():
        assert command in ci, f"CI does not run README's command: {command}"


def test_ci_fails_when_any_step_of_a_readme_command_fails():
    """A failing step anywhere in a README command (say its `pip install`) fails CI, not only a failing last step.

    `set -e` ignores a failure that is not the last command of an `&&` list: CI once went on past a failed
    install and ended green. Each command sits in a subshell whose status is checked; the check is run here with
    the command's first step failing.
    """
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in readme_commands():
        i = ci.index(command)
        assert ci[i - 1] == "(" and ci[i + 1].startswith(") ||"), f"CI does not check the status of: {command}"
        script = "\n".join(["set -euo pipefail", "(", "false && true", ci[i + 1], "echo reached"])
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and "reached" not in r.stdout, (r.returncode, r.stdout)
