"""How a :class:`~tiered_kv.integrations.hf.generator.CachedGenerator` picks tokens: options, checks, sampling.

Primitives:

* :class:`SamplingOptions` / :class:`GenerateOptions` -- the keyword options of ``generate``, ``generate_batch``
  and ``stream`` (``stream`` has no ``output_logits``), declared once.
* :func:`check_sampling` -- validate the options (``ValueError`` / ``TypeError`` before anything is admitted)
  into a :class:`Sampling`; :func:`check_prompts` -- the prompts, into token arrays.
* :func:`make_sampler` -- the random generator of one prompt (``None`` for greedy decoding).
* :func:`choose` -- one token per row: argmax, or :func:`sample` after temperature, top-k and top-p.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any, TypedDict

import numpy as np
import torch

from ...blocks import DEFAULT_PRIORITY
from ...keys import as_token_array

__all__ = [
    "GenerateOptions",
    "Sampling",
    "SamplingOptions",
    "check_prompts",
    "check_sampling",
    "choose",
    "make_sampler",
    "sample",
]


class SamplingOptions(TypedDict, total=False):
    """Keyword options of ``CachedGenerator.stream`` (and, with ``output_logits``, of ``generate``).

    Attributes:
        max_new_tokens: tokens to generate (>= 1; default 16).
        temperature: 0 for greedy decoding (default); otherwise sampling at this temperature.
        top_k: keep the ``top_k`` most likely tokens when sampling (0: all; default).
        top_p: nucleus sampling threshold in ``(0, 1]`` (default 1).
        seed: seed of the sampling generator (reproducible samples; default ``None``).
        stop_token_ids: generation ends after any of these (it is the last token returned).
        priority: retention priority of the prompt's blocks (0..100).
    """

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_token_ids: Collection[int]
    priority: int


class GenerateOptions(SamplingOptions, total=False):
    """Keyword options of ``CachedGenerator.generate`` and ``generate_batch``.

    Attributes:
        output_logits: return the logits of every position the model ran (default ``False``).
    """

    output_logits: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Sampling:
    """Validated sampling settings of one call (see :func:`check_sampling`)."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: frozenset[int]
    priority: int
    output_logits: bool


def check_sampling(
    *,
    max_new_tokens: int = 16,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_token_ids: Collection[int] = (),
    priority: int = DEFAULT_PRIORITY,
    output_logits: bool = False,
) -> Sampling:
    """Validate the options of one call (:class:`GenerateOptions`; the defaults are these).

    Raises:
        ValueError, TypeError: an option out of range or of the wrong type, or an unknown option.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not 0 <= temperature < float("inf")
    ):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    stops = []
    for s in stop_token_ids:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"stop_token_ids must be ints, got {type(s).__name__}")
        stops.append(int(s))
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 100:
        raise ValueError(f"priority must be an int in 0..100, got {priority!r}")
    return Sampling(
        max_new_tokens,
        float(temperature),
        top_k,
        float(top_p),
        seed,
        frozenset(stops),
        priority,
        bool(output_logits),
    )


def make_sampler(sampling: Sampling, index: int, device: torch.device) -> torch.Generator | None:
    """The generator of the ``index``-th prompt of a call (seeded ``seed + index``); ``None`` when greedy."""
    if sampling.temperature == 0:
        return None
    g = torch.Generator(device=device)
    if sampling.seed is not None:
        g.manual_seed(sampling.seed + index)
    else:
        g.seed()
    return g


def choose(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator | None]) -> list[int]:
    """One token per row: argmax (greedy), or a sample after temperature, top-k and top-p."""
    if sampling.temperature == 0:
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    return [sample(logits[k], sampling, g) for k, g in enumerate(generators)]


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One token id drawn from ``logits`` (one row) after temperature, top-k and top-p."""
    scores = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(0)
        drop = cumulative - sorted_probs > sampling.top_p  # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def check_prompts(prompts: Sequence[Any], max_new_tokens: int, vocab: int | None, limit: int) -> list[np.ndarray]:
    """The prompts as token arrays (a ``[1, n]`` tensor is a prompt too), checked before anything is admitted.

    Raises:
        TypeError: ``prompts`` is not a list of token-id sequences.
        ValueError: no prompt, an empty prompt, a token outside ``[0, vocab)``, or a prompt that with
            ``max_new_tokens`` needs more than ``limit`` tokens (what one sequence may hold).
    """
    if isinstance(prompts, (str, bytes, np.ndarray, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of token-id sequences")
    if not prompts:
        raise ValueError("prompts is empty")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            if p.dim() == 2 and p.shape[0] == 1:
                p = p[0]
            p = p.detach().cpu().numpy()
        arr = as_token_array(p, f"prompt {i}")
        if arr.size == 0:
            raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
        if arr.min() < 0 or (vocab is not None and arr.max() >= vocab):
            raise ValueError(f"prompt {i} has a token id outside the model's vocabulary [0, {vocab})")
        if arr.size + max_new_tokens - 1 > limit:
            raise ValueError(
                f"prompt {i} has {arr.size} tokens; with max_new_tokens={max_new_tokens} that is more than a "
                f"sequence may hold ({limit} tokens)"
            )
        out.append(arr)
    return out
