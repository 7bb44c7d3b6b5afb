"""The checks of ``tiered-kv doctor``: what this machine has for tiered_kv, and what to do about what it lacks.

Primitives:

* :func:`doctor_checks` -- every check, as ``(check, ok, what was found, what to do if not ok)``.
* :data:`REQUIRED_CHECKS` -- the checks without which tiered_kv cannot run here; the others are optional features.
* :data:`MEMLOCK_WARN_BYTES` -- the locked-memory limit below which the pinned-memory check fails.

The directory checks are the ones the file tier runs on its directory (:mod:`tiered_kv.file.place`), so the doctor
refuses what the engine refuses. torch and the optional libraries are imported by the checks, not by this module.
"""

from __future__ import annotations

import os
import platform
import resource
import sys

__all__ = ["MEMLOCK_WARN_BYTES", "REQUIRED_CHECKS", "doctor_checks"]

#: doctor checks without which tiered_kv cannot run here (the others are optional features).
REQUIRED_CHECKS = frozenset(
    {"python", "torch", "directory", "directory safe for a file tier", "file tier I/O (TIERED_KV_GDS)"}
)
#: a locked-memory limit below this is flagged.
MEMLOCK_WARN_BYTES = 64 << 20


def doctor_checks(directory: str) -> list[tuple[str, bool, str, str]]:
    """(check, ok, what was found, what to do if not ok)."""
    import torch

    checks: list[tuple[str, bool, str, str]] = []
    checks.append(("python", sys.version_info >= (3, 11), platform.python_version(), "use Python 3.11 or newer"))
    checks.append(("torch", True, f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'})", ""))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        driver = ""
        try:
            driver = f", driver API {torch._C._cuda_getDriverVersion()}"  # type: ignore[attr-defined]
        except Exception:
            pass
        checks.append(("CUDA device", True, f"{props.name}, {props.total_memory / 2**30:.0f} GiB{driver}", ""))
    elif torch.version.cuda:  # a CUDA build is installed: the driver or the device is what is missing
        checks.append(
            (
                "CUDA device",
                False,
                f"none visible to this CUDA {torch.version.cuda} build of torch (the emulated device is used)",
                "check the NVIDIA driver (`nvidia-smi`) and CUDA_VISIBLE_DEVICES; torch itself is fine",
            )
        )
    else:
        checks.append(
            (
                "CUDA device",
                False,
                "none: torch is a CPU-only build (the emulated device is used)",
                "install a CUDA build of torch "
                "(pip install torch --index-url https://download.pytorch.org/whl/cu130) and an NVIDIA driver",
            )
        )
    try:
        import uvloop

        checks.append(("uvloop", True, str(getattr(uvloop, "__version__", "?")), ""))
    except ImportError:
        checks.append(("uvloop", False, "missing", "pip install uvloop (faster event loop)"))
    try:
        import kvikio

        checks.append(("kvikio", True, getattr(kvikio, "__version__", "installed"), ""))
    except Exception as exc:
        checks.append(
            (
                "kvikio",
                False,
                f"not usable ({type(exc).__name__})",
                "pip install 'tiered-kv[gds]' for GPUDirect Storage",
            )
        )
    from .. import _ext

    ext = _ext.status()
    if ext["built"] or ext["loaded"]:
        checks.append(("CUDA extension", True, f"built in {ext['cache_dir']}", ""))
    elif ext["torch_cuda"] and ext["nvcc"]:
        checks.append(
            (
                "CUDA extension",
                False,
                f"not built yet (nvcc {ext['nvcc_version']}, arch {ext['arch']})",
                "it builds on first use; `tiered-kv build-ext` builds it now",
            )
        )
    else:
        missing = "a CUDA build of torch" if not ext["torch_cuda"] else "nvcc (the CUDA toolkit; set CUDA_HOME)"
        checks.append(
            (
                "CUDA extension",
                False,
                f"cannot build: no {missing}; the CPU reference ops are used",
                f"install {missing} for the batched-copy, partial-copy and gather kernels",
            )
        )
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def fmt(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v / 2**20:.0f} MiB"

    small = soft != resource.RLIM_INFINITY and soft < MEMLOCK_WARN_BYTES
    checks.append(
        (
            "pinned memory (ulimit -l)",
            not small,
            f"soft {fmt(soft)}, hard {fmt(hard)}" + (f" (below {MEMLOCK_WARN_BYTES >> 20} MiB)" if small else ""),
            "raise the locked-memory limit (`ulimit -l unlimited`, or memlock in /etc/security/limits.conf / "
            "--ulimit memlock=-1 for containers): GDS buffer registration and large pinned host pools need it",
        )
    )
    # the checks the file tier runs on its directory (tiered_kv.file.place), so that doctor refuses what the
    # engine refuses: shared directories (symlinks, other users' files), then no free space or no file creatable
    from ..file.place import directory_problem, slab_problem

    problem = directory_problem(directory)
    checks.append(
        (
            "directory safe for a file tier",
            problem is None,
            "yes" if problem is None else problem,
            "use a directory of your own (0700), or a sticky one (chmod +t) like /tmp",
        )
    )
    if not os.path.isdir(directory):
        unusable: str | None = f"{directory} is not an existing directory"
    elif problem is not None:
        unusable = "not safe (above)"
    else:
        unusable = slab_problem(directory)
    writable = unusable is None
    checks.append(
        (
            "directory",
            writable,
            directory if writable else f"{directory}: {unusable}",
            "pass --dir with a writable directory on a filesystem with free space",
        )
    )
    if writable:
        from ..backends.gds import select_backend
        from ..backends.posix import direct_io_supported

        direct = direct_io_supported(directory)
        checks.append(
            (
                "O_DIRECT in directory",
                direct,
                "yes" if direct else "no (page cache)",
                "put the file tier on a filesystem that supports O_DIRECT (ext4, xfs) for full disk speed",
            )
        )
        try:
            kind, probe = select_backend(None)
            checks.append(
                ("file tier I/O (TIERED_KV_GDS)", True, f"{kind}: {probe.reason if probe else 'GDS off'}", "")
            )
        except Exception as exc:
            checks.append(("file tier I/O (TIERED_KV_GDS)", False, str(exc), "use TIERED_KV_GDS=auto or off"))
    return checks
