"""Hybrid prefill: compute a cached prefix's head while its tail is loaded from a slow tier.

A prefix in the file tier may take longer to read back than to recompute. For a single prompt whose match starts in
the file tier, :class:`~tiered_kv.integrations.hf.CachedGenerator` asks its cost model
(:meth:`~tiered_kv.cost_model.CostModel.split`) for the number ``c`` of leading matched blocks to compute. When
``c > 0``:

* the model thread runs tokens ``[0, c * tokens_per_block)`` in a plain transformers ``DynamicCache``
  (:func:`compute_prefix`; it writes no block) while the event loop admits the prompt with
  ``Request(tokens, compute_blocks=c)``, which loads only the match's later blocks;
* once both are done, the computed KV is scattered into the sequence's fresh leading blocks (:func:`write_prefix`,
  one write per layer for K and one for V), so the past the model attends to, the computed head followed by the
  loaded blocks, is all in the sequence's blocks and is read from them as a reused prefix is;
* the final forward runs the remaining tokens as without hybrid prefill (writes through, commit, decode).

Rules:

* The computed head is valid whatever the admission found: if the cache changed between the peek and the
  admission and fewer blocks were matched, the computed tokens still cover ``[0, c * tokens_per_block)``; the
  blocks after them that were not loaded are computed by the final forward (:attr:`ComputedPrefix.past_end`).
* The fresh leading blocks are private to the sequence (never matchable); the cached copies stay in their tier.
* The pre-forward finishes before its caller goes on, whether the admission succeeded, failed or was cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import torch

from ...blocks import Admission
from .kv import RowTargets
from .model import cache_kwargs, output_cache

__all__ = ["ComputedPrefix", "compute_prefix", "finished", "write_prefix"]


@dataclasses.dataclass(slots=True)
class ComputedPrefix:
    """The KV of a prompt's first ``tokens`` tokens, computed by a plain forward (no block written).

    Attributes:
        tokens: tokens computed (whole blocks).
        layers: per layer ``(keys, values)`` ``[1, kv_heads, tokens, head_dim]``.
        seconds: the forward's time on the model thread.
        admit_seconds: the concurrent admission's time (set by the caller).
    """

    tokens: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    seconds: float
    admit_seconds: float = 0.0

    def past_end(self, admission: Admission) -> int:
        """Positions ``[0, past_end)`` the final forward attends to: the computed head, then the loaded blocks.

        The admission's reused tokens start at its ``tokens_computed_first``: this head's end, or less when the
        admission matched fewer blocks than were computed (then it reused nothing and the head covers more).
        """
        loaded_end = admission.tokens_computed_first + admission.tokens_reused
        return max(self.tokens, loaded_end)


def compute_prefix(model: Any, ids: torch.Tensor, device: torch.device) -> ComputedPrefix:
    """Run ``ids`` (``[1, tokens]``) through ``model`` in a plain ``DynamicCache``; its KV (model thread)."""
    from transformers.cache_utils import DynamicCache

    t = time.perf_counter()
    kv = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=ids.to(device), **cache_kwargs(model, kv), use_cache=True, logits_to_keep=1)
        layers = [(layer.keys, layer.values) for layer in output_cache(out).layers]
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    return ComputedPrefix(int(ids.shape[1]), layers, time.perf_counter() - t)


def write_prefix(
    prefix: ComputedPrefix,
    views: list[tuple[torch.Tensor, torch.Tensor]],
    page_table: tuple[int, ...],
    tokens_per_block: int,
    device: torch.device,
) -> None:
    """Scatter the computed KV into the sequence's first ``prefix.tokens / tokens_per_block`` blocks (model thread)."""
    target = RowTargets(tokens_per_block)
    target.page_tables = [page_table]
    target.prepare(0, prefix.tokens, device)
    for layer_views, (keys, values) in zip(views, prefix.layers, strict=True):
        target.write(layer_views, keys, values)


async def finished(future: asyncio.Future[Any]) -> None:
    """Wait until ``future`` is done, through cancellations; its own outcome is dropped (retrieved)."""
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            continue
        except BaseException:
            break
    if not future.cancelled():
        future.exception()
