"""Build-on-first-use of the CUDA extension (``kernels/*.cu`` + ``kernels/*.cpp``).

Primitives:

* :func:`load` -- make the CUDA implementations of the ``tiered_kv`` ops available; returns ``True`` when
  they are, ``False`` (logged once) when the CPU reference / pure-torch paths will be used instead.
* :func:`build` -- compile now (ahead of time, or in CI to prove the sources compile) and load.
* :func:`native` -- the library's Python functions (the native submission path of small copies, see
  ``kernels/fast_path.cpp``), or ``None`` without the extension.
* :func:`status` -- what was found (toolkit, nvcc version, CUDA torch, GPU, cache, error), for ``doctor``.
* :func:`find_cuda_home` -- the real CUDA toolkit root.

The sources are compiled into a cache directory (``TIERED_KV_EXT_DIR``, default
``~/.cache/tiered_kv/ext``), one sub-directory per hash of (sources, torch version, CUDA version, arch list,
flags), so a change of any source rebuilds and an unchanged tree loads in milliseconds. A file lock per hash
makes concurrent processes build once. With ``ninja`` the build goes through
``torch.utils.cpp_extension.load``; without it (a bare GPU machine) nvcc and the C++ compiler are driven
directly with the same flags.

Notes:
    ``nvcc`` on ``PATH`` may be a wrapper script (``/usr/local/bin/nvcc`` that ``exec``s the real one);
    torch derives ``CUDA_HOME`` from its location (``/usr/local``) and then finds no headers. We resolve
    the real toolkit root and set ``CUDA_HOME`` before ``torch.utils.cpp_extension`` is used.

    Environment: ``TIERED_KV_EXT=0`` disables the extension; ``TIERED_KV_CUDA_ARCH`` (or
    ``TORCH_CUDA_ARCH_LIST``) picks the architectures (default: the visible GPU's, or ``9.0`` without one);
    ``TIERED_KV_KERNELS_DIR`` points at the sources; ``TIERED_KV_EXT_BUILDER`` = ``auto`` (ninja when
    present) / ``ninja`` / ``direct``.

Size: a little over 500 lines: discovery, the two builders (ninja and direct), the build cache and the two
loaders (torch ops, Python module) of one extension.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from . import opdefs as _opdefs  # the op schemas must exist before the library registers CUDA kernels

__all__ = [
    "OPS",
    "ExtensionBuildError",
    "build",
    "cuda_kernels_registered",
    "find_cuda_home",
    "load",
    "loaded",
    "native",
    "status",
]

log = logging.getLogger(__name__)

#: The operators the extension implements for CUDA.
OPS = ("gather_block_offsets", "copy_blocks", "copy_chunks", "copy_chunk_blocks", "copy_blocks_list", "token_checksums")

_CXX_FLAGS = ["-O3"]
_NVCC_FLAGS = ["-O3", "-lineinfo"]

_lock = threading.Lock()
_state: dict[str, Any] = {"loaded": None, "error": None, "logged": False, "path": None, "native": None}


class ExtensionBuildError(RuntimeError):
    """The CUDA extension could not be built or loaded; the message carries the compiler output tail."""


# --------------------------------------------------------------------------------------------- discovery


def _valid_root(root: str | os.PathLike[str] | None) -> bool:
    if not root:
        return False
    return (Path(root) / "bin" / "nvcc").exists() and (Path(root) / "include" / "cuda_runtime.h").exists()


def find_cuda_home() -> str | None:
    """The CUDA toolkit root: ``CUDA_HOME``/``CUDA_PATH`` if valid, else where ``nvcc`` really lives.

    A wrapper script on ``PATH`` is read for the absolute ``.../bin/nvcc`` it runs; a symlink is resolved;
    ``/usr/local/cuda`` is the last resort. ``None`` when no toolkit with headers is found.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if _valid_root(os.environ.get(var)):
            return os.environ[var]
    candidates: list[Path] = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        try:
            head = real.read_bytes()[:4096]
        except OSError:
            head = b""
        if head.startswith(b"#!"):  # a wrapper script: the toolkit is the nvcc it execs
            candidates += [
                Path(m).parent.parent for m in re.findall(r"(/[^\s\"']+/bin/nvcc)\b", head.decode(errors="replace"))
            ]
        candidates.append(real.parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    for root in candidates:
        if _valid_root(root):
            return str(root)
    return None


def _prepare_cuda_home() -> str | None:
    root = find_cuda_home()
    if root is not None and not _valid_root(os.environ.get("CUDA_HOME")):
        os.environ["CUDA_HOME"] = root
    cpp_ext = sys.modules.get("torch.utils.cpp_extension")
    if root is not None and cpp_ext is not None and not _valid_root(getattr(cpp_ext, "CUDA_HOME", None)):
        cpp_ext.CUDA_HOME = root  # type: ignore[attr-defined]  # imported before us with the wrong root: fix the module global it uses
    return root


def _nvcc_version(root: str | None) -> str | None:
    if root is None:
        return None
    try:
        out = subprocess.run(
            [str(Path(root) / "bin" / "nvcc"), "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def _kernels_dir() -> Path:
    """The sources: ``TIERED_KV_KERNELS_DIR``, else the checkout's ``kernels/``, else the installed copy."""
    env = os.environ.get("TIERED_KV_KERNELS_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    checkout = here.parent / "kernels"
    if any(checkout.glob("*.cu")):
        return checkout
    return here / "_kernels"  # pyproject maps kernels/ to the tiered_kv._kernels package data


def _sources() -> list[Path]:
    d = _kernels_dir()
    return sorted([*d.glob("*.cu"), *d.glob("*.cpp")])


def _cache_root() -> Path:
    return Path(os.environ.get("TIERED_KV_EXT_DIR") or Path.home() / ".cache" / "tiered_kv" / "ext")


def _arch_list() -> str:
    for var in ("TIERED_KV_CUDA_ARCH", "TORCH_CUDA_ARCH_LIST"):
        if os.environ.get(var):
            return os.environ[var]
    if torch.cuda.is_available():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        return ";".join(f"{a}.{b}" for a, b in caps)
    return "9.0"


def _build_key(arch: str) -> str:
    h = hashlib.sha256()
    d = _kernels_dir()
    for f in sorted([*d.glob("*.cu"), *d.glob("*.cpp"), *d.glob("*.cuh"), *d.glob("*.h")]):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(
        f"{torch.__version__}|{torch.version.cuda}|{arch}|{_CXX_FLAGS}|{_NVCC_FLAGS}|{sys.version_info[:2]}".encode()
    )
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------- build


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run(cmd: list[str], verbose: bool) -> None:
    if verbose:
        print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise ExtensionBuildError(
            f"command failed ({proc.returncode}): {' '.join(cmd[:3])} ...\n{(proc.stdout + proc.stderr)[-6000:]}"
        )


def _arch_flags(arch: str) -> list[str]:
    flags = []
    for item in arch.replace(",", ";").replace(" ", ";").split(";"):
        if not item:
            continue
        ptx = item.endswith("+PTX")
        num = item.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def _build_direct(name: str, sources: list[Path], build_dir: Path, root: str, arch: str, verbose: bool) -> Path:
    """Nvcc + the C++ compiler without ninja: the ``.cu`` files are torch-free, the ``.cpp`` ones see torch."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    torch_inc = cpp_extension.include_paths("cuda")
    py_inc = sysconfig.get_paths()["include"]
    defines = [f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    commands = []
    for src in sources:
        obj = build_dir / (src.name + ".o")
        if src.suffix == ".cu":
            cmd = [
                str(Path(root) / "bin" / "nvcc"),
                "-c",
                str(src),
                "-o",
                str(obj),
                "-std=c++17",
                "-Xcompiler",
                "-fPIC",
                *_NVCC_FLAGS,
                *_arch_flags(arch),
                f"-I{src.parent}",
            ]
        else:
            cmd = [
                cxx,
                "-c",
                str(src),
                "-o",
                str(obj),
                "-std=c++20",
                "-fPIC",
                *_CXX_FLAGS,
                *defines,
                f"-I{src.parent}",
                *(f"-I{p}" for p in [*torch_inc, py_inc]),
                f"-I{Path(root) / 'include'}",
            ]
        commands.append(cmd)
    # one compiler per source at once (what ninja would do); the first failure is raised
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(commands), os.cpu_count() or 1))) as pool:
        for future in [pool.submit(_run, cmd, verbose) for cmd in commands]:
            future.result()
    objects = [cmd[cmd.index("-o") + 1] for cmd in commands]
    out = build_dir / f"{name}.so"
    libs = [f"-L{p}" for p in cpp_extension.library_paths("cuda")] + [f"-L{Path(root) / 'lib64'}"]
    _run(
        [
            cxx,
            "-shared",
            *objects,
            "-o",
            str(out),
            *libs,
            "-lc10",
            "-lc10_cuda",
            "-ltorch",
            "-ltorch_cpu",
            "-ltorch_cuda",
            "-lcudart",
        ],
        verbose,
    )
    return out


def _build_and_load(verbose: bool = False) -> Path:
    root = _prepare_cuda_home()
    if root is None:
        raise ExtensionBuildError("no CUDA toolkit found (nvcc with include/cuda_runtime.h); set CUDA_HOME")
    if torch.version.cuda is None:
        raise ExtensionBuildError(f"torch {torch.__version__} is not a CUDA build")
    sources = _sources()
    if not sources:
        raise ExtensionBuildError(f"no kernel sources in {_kernels_dir()}")
    arch = _arch_list()
    key = _build_key(arch)
    name = f"tiered_kv_ext_{key}"
    build_dir = _cache_root() / key
    build_dir.mkdir(parents=True, exist_ok=True)
    so = build_dir / f"{name}.so"
    with _file_lock(_cache_root() / f".lock-{key}"):
        if not so.exists():
            from torch.utils import cpp_extension

            log.info(
                "tiered_kv: compiling the CUDA extension (%d sources, arch %s) into %s", len(sources), arch, build_dir
            )
            builder = os.environ.get("TIERED_KV_EXT_BUILDER", "auto")
            if builder not in ("auto", "ninja", "direct"):
                raise ExtensionBuildError(f"TIERED_KV_EXT_BUILDER must be auto, ninja or direct, got {builder!r}")
            if builder == "ninja" or (builder == "auto" and cpp_extension.is_ninja_available()):
                with _env(TORCH_CUDA_ARCH_LIST=arch, CUDA_HOME=root):
                    cpp_extension.load(
                        name,
                        [str(s) for s in sources],
                        extra_cflags=_CXX_FLAGS,
                        extra_cuda_cflags=_NVCC_FLAGS,
                        extra_include_paths=[str(_kernels_dir())],
                        build_directory=str(build_dir),
                        verbose=verbose,
                        with_cuda=True,
                        is_python_module=False,
                    )
                    # load() built and loaded it; fall through to record the path
            else:
                _build_direct(name, sources, build_dir, root, arch, verbose)
    if not so.exists():
        raise ExtensionBuildError(f"the build finished without producing {so}")
    torch.ops.load_library(str(so))
    return so


def cuda_kernels_registered() -> dict[str, bool]:
    """Op name -> whether a CUDA kernel is registered for it (by the extension)."""
    return {op: torch._C._dispatch_has_kernel_for_dispatch_key(f"tiered_kv::{op}", "CUDA") for op in OPS}


def build(verbose: bool = False) -> Path:
    """Compile the extension now (if its cache entry is missing) and load it; returns the library path.

    Works without a GPU (for the arch list of ``TIERED_KV_CUDA_ARCH``, default ``9.0``), so CI proves the
    sources compile.

    Raises:
        ExtensionBuildError: no toolkit, not a CUDA torch, or the compiler failed (its output is in the
            message).
    """
    with _lock:
        try:
            path = _build_and_load(verbose)
        except ExtensionBuildError as exc:
            _state["error"] = str(exc)
            raise
        except Exception as exc:  # cpp_extension raises RuntimeError/CalledProcessError with the log
            _state["error"] = f"{type(exc).__name__}: {exc}"
            raise ExtensionBuildError(str(exc)) from exc
        _state.update(loaded=True, error=None, path=str(path))
        return path


def load() -> bool:
    """Make the CUDA kernels available if this machine can use them; ``True`` when they are.

    Builds on first use (cached afterwards). Without a GPU, a CUDA build of torch, a toolkit, or with
    ``TIERED_KV_EXT=0``, returns ``False`` and logs once that the CPU reference / pure-torch paths are used.
    A failed build is logged once with its error and not retried in this process.
    """
    if _state["loaded"] is not None:
        return bool(_state["loaded"])
    reason = None
    if os.environ.get("TIERED_KV_EXT", "1") == "0":
        reason = "disabled by TIERED_KV_EXT=0"
    elif not torch.cuda.is_available():
        reason = "no CUDA device"
    if reason is None and all(cuda_kernels_registered().values()):
        _state["loaded"] = True  # a build() earlier in this process, or a preloaded library
        return True
    if reason is None:
        try:
            build()
            return True
        except ExtensionBuildError as exc:
            reason = f"build failed: {str(exc)[-2000:]}"
    with _lock:
        _state["loaded"] = False
        if not _state["logged"]:
            _state["logged"] = True
            log.warning(
                "tiered_kv: CUDA kernels unavailable (%s); using the CPU reference / pure-torch copy paths", reason
            )
    return False


def loaded() -> bool:
    """Whether :func:`load` already made the kernels available in this process (never builds)."""
    return bool(_state["loaded"]) or (_state["loaded"] is None and all(cuda_kernels_registered().values()))


def native() -> Any:
    """The extension's Python module (``submit``, ``record``, ``DeviceEvent``), or ``None``.

    ``None`` when the kernels are not loaded (:func:`load` is ``False``), when they were loaded from a library
    this process did not build or find in the cache (no path known), or when that library has no Python entry
    (an older build): callers then take the torch-op path. Imported once per process.
    """
    if _state["native"] is not None:
        return _state["native"] or None
    module: Any = False
    loaded = load()
    path = _state["path"]
    if loaded and path is None:  # preloaded (torch.ops.load_library): find this tree's cache entry
        key = _build_key(_arch_list())
        candidate = _cache_root() / key / f"tiered_kv_ext_{key}.so"
        path = str(candidate) if candidate.exists() else None
    if loaded and path is not None:
        import importlib.machinery
        import importlib.util

        name = Path(path).stem
        try:
            loader = importlib.machinery.ExtensionFileLoader(name, path)
            spec = importlib.util.spec_from_file_location(name, path, loader=loader)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            if not hasattr(module, "submit"):
                module = False
        except ImportError as exc:
            log.info("tiered_kv: the extension has no native submission path (%s); using the torch ops", exc)
            module = False
    _state["native"] = module
    return module or None


def status() -> dict[str, Any]:
    """What the extension machinery sees; nothing is built.

    Keys: ``cuda_home``, ``nvcc``,
    ``nvcc_version``, ``torch``, ``torch_cuda``, ``cuda_available``, ``gpu``, ``ninja``, ``arch``,
    ``kernels_dir``, ``sources``, ``cache_dir``, ``built`` (cache entry exists), ``loaded``,
    ``registered`` (op -> CUDA kernel present), ``error``.
    """
    root = _prepare_cuda_home()
    try:
        from torch.utils import cpp_extension

        ninja = cpp_extension.is_ninja_available()
    except Exception:
        ninja = False
    arch = _arch_list()
    key = _build_key(arch) if _sources() else None
    cache = _cache_root() / key if key else None
    return {
        "cuda_home": root,
        "nvcc": str(Path(root) / "bin" / "nvcc") if root else shutil.which("nvcc"),
        "nvcc_version": _nvcc_version(root),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "ninja": ninja,
        "arch": arch,
        "kernels_dir": str(_kernels_dir()),
        "sources": [s.name for s in _sources()],
        "cache_dir": str(cache) if cache else None,
        "built": bool(cache and (cache / f"tiered_kv_ext_{key}.so").exists()),
        "loaded": _state["loaded"],
        "registered": cuda_kernels_registered(),
        "error": _state["error"],
    }


_ = _opdefs  # imported for its side effect (op definitions)


def main(argv: list[str] | None = None) -> int:
    """``python -m tiered_kv._ext status|build``: print what was found, or build ahead of time."""
    parser = argparse.ArgumentParser(prog="python -m tiered_kv._ext", description="tiered_kv CUDA extension")
    parser.add_argument("command", choices=["status", "build"], nargs="?", default="status")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the compiler commands")
    args = parser.parse_args(argv)
    if args.command == "build":
        try:
            print(f"built and loaded: {build(verbose=args.verbose)}")
        except ExtensionBuildError as exc:
            print(f"build failed: {exc}")
            return 1
    print(json.dumps(status(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
