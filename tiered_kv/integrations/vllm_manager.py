"""Moved to :mod:`tiered_kv.integrations.vllm.manager` (this path works for one more release, with a warning)."""

from ._moved import moved

moved(__name__, "tiered_kv.integrations.vllm.manager", globals())
