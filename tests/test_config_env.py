"""One way to configure: the engine's and the file tier's environment variables reach them through their config
dataclasses, and docs/configuration.md has one table of every ``TIERED_KV_*`` variable.

Checked: every variable the package reads (a quoted ``TIERED_KV_*`` name in its sources: the key of an
``os.environ`` / ``getenv`` read) has its row in the table, and that row names what reads it -- the dataclass field
for ``tiered_kv/config.py`` (``EngineConfig``) and ``tiered_kv/file/config.py`` (``FileTierConfig``), "build" for
the extension's build, "tests" or "bench" for the tools; no other module names one; no native code reads the
environment. And the settings of the CUDA streams' completion and of the native submission path: read by
``EngineConfig.from_env``, validated, passed to the streams and the copier.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any

import pytest

from tiered_kv import EngineConfig, KVLayout, TransferEngine
from tiered_kv.copy.copier import Copier
from tiered_kv.device import Device, resolve_device
from tiered_kv.file.config import FileTierConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "configuration.md"

#: A variable name as a string literal: the key a module reads the environment by.
QUOTED = re.compile(r"[\"'](TIERED_KV_[A-Z0-9_]+)[\"']")

#: The modules allowed to read ``TIERED_KV_*`` variables, and what the table's knob column says of theirs (a
#: dataclass prefix the field must follow, or a word the cell starts with).
READERS: dict[str, tuple[str, ...]] = {
    "tiered_kv/config.py": ("EngineConfig.",),
    "tiered_kv/file/config.py": ("FileTierConfig.",),
    "backends/gds.py": ("FileTierConfig.",),  # GdsMode.from_env: the parser FileTierConfig.from_env reads it with
    "tiered_kv/_ext.py": ("build",),
    "tiered_kv/remote/": ("remote tier", "tests"),
    "tiered_kv/tools/": ("bench", "tests"),
}
FIELDS = {"EngineConfig.": EngineConfig, "FileTierConfig.": FileTierConfig}


def _reads() -> dict[str, set[str]]:
    """Source file (relative to the checkout) -> the ``TIERED_KV_*`` names it quotes."""
    found: dict[str, set[str]] = {}
    for directory in ("tiered_kv", "backends"):
        for path in sorted((ROOT / directory).rglob("*.py")):
            names = set(QUOTED.findall(path.read_text()))
            if names:
                found[path.relative_to(ROOT).as_posix()] = names
    return found


def _table() -> dict[str, str]:
    """Variable -> its knob cell, from every table row of docs/configuration.md."""
    rows = re.findall(r"^\| `(TIERED_KV_[A-Z0-9_]+)` \| ([^|]+) \|", TABLE.read_text(), re.M)
    names = [name for name, _ in rows]
    assert len(names) == len(set(names)), f"a variable has two rows: {sorted(n for n in names if names.count(n) > 1)}"
    return {name: knob.strip() for name, knob in rows}


def _reader(path: str) -> str | None:
    return next((prefix for prefix in READERS if path == prefix or path.startswith(prefix)), None)


def test_every_variable_the_package_reads_is_in_the_one_table_with_its_knob() -> None:
    reads = _reads()
    table = _table()
    assert sum(len(names) for names in reads.values()) > 20, reads
    assert {"TIERED_KV_COMPLETION", "TIERED_KV_COMPLETION_POLL", "TIERED_KV_NATIVE"} <= reads["tiered_kv/config.py"]
    strays = {path: sorted(names) for path, names in reads.items() if _reader(path) is None}
    assert not strays, f"read outside a config dataclass, the build, the remote tier or the tools: {strays}"
    missing = sorted({name for names in reads.values() for name in names} - set(table))
    assert not missing, f"missing from the table in docs/configuration.md: {missing}"
    for path, names in reads.items():
        reader = _reader(path)
        assert reader is not None
        for name in sorted(names):
            knob = table[name]
            kinds = READERS[reader]
            assert any(knob.startswith(kind) or knob.startswith(f"`{kind}") for kind in kinds), (name, knob, kinds)
            for prefix, cls in FIELDS.items():
                if prefix in kinds:
                    field = knob.strip("`").removeprefix(prefix)
                    assert field in {f.name for f in dataclasses.fields(cls)}, f"{name}: {knob} is not a field"


def test_no_native_code_reads_the_environment() -> None:
    sources = [p for p in (ROOT / "kernels").rglob("*") if p.suffix in {".cpp", ".cu", ".cuh", ".h"}]
    assert sources
    readers = [p.relative_to(ROOT).as_posix() for p in sources if re.search(r"getenv\s*\(|\benviron\b", p.read_text())]
    assert not readers, f"native code reads the environment (add an EngineConfig field instead): {readers}"


def test_completion_and_native_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TIERED_KV_COMPLETION", "TIERED_KV_COMPLETION_POLL", "TIERED_KV_NATIVE"):
        monkeypatch.delenv(name, raising=False)
    config = EngineConfig.from_env()
    assert (config.completion, config.completion_poll, config.native_submit) == ("hostfunc", True, True)
    assert config == EngineConfig()
    monkeypatch.setenv("TIERED_KV_COMPLETION", "event")
    monkeypatch.setenv("TIERED_KV_COMPLETION_POLL", "0")
    monkeypatch.setenv("TIERED_KV_NATIVE", "0")
    config = EngineConfig.from_env()
    assert (config.completion, config.completion_poll, config.native_submit) == ("event", False, False)
    assert EngineConfig.from_env(native_submit=True).native_submit  # an argument wins
    monkeypatch.setenv("TIERED_KV_NATIVE", " 1 ")
    assert EngineConfig.from_env().native_submit
    for name in ("TIERED_KV_COMPLETION_POLL", "TIERED_KV_NATIVE"):
        monkeypatch.setenv(name, "maybe")
        with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
            EngineConfig.from_env()
        monkeypatch.setenv(name, "1")


@pytest.mark.parametrize(
    ("field", "value"),
    [("completion", "spin"), ("completion", "Event"), ("completion_poll", 0), ("native_submit", "0")],
)
def test_completion_and_native_settings_are_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


async def test_the_engine_makes_its_streams_with_its_config(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[str, dict[str, Any]]] = []
    real = Device.new_stream

    def new_stream(self: Device, name: str, **kwargs: Any) -> Any:
        made.append((name, kwargs))
        return real(self, name, **kwargs)

    monkeypatch.setattr(Device, "new_stream", new_stream)
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4)
    config = EngineConfig(device="cpu", completion="event", completion_poll=False)
    async with TransferEngine(layout, gpu_blocks=2, host_blocks=2, config=config):
        pass
    assert made == [(name, {"completion": "event", "poll": False}) for name in ("offload", "onboard", "local")]


def test_the_copier_follows_its_config_into_or_out_of_the_native_path() -> None:
    """``native_submit`` of the copier's current config decides; without the extension's module it never is."""
    copier = Copier(resolve_device("cpu"), EngineConfig(native_submit=True))
    try:
        assert not copier.native  # the emulated device has no native path
        copier._native_module = module = object()  # as on CUDA with the extension
        copier.config = EngineConfig(native_submit=True)
        assert copier.native and copier._native is module
        copier.config = EngineConfig(native_submit=False)
        assert not copier.native
    finally:
        copier.close()
