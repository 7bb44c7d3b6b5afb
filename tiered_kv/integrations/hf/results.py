"""What a :class:`~tiered_kv.integrations.hf.generator.CachedGenerator` hands back.

Primitives:

* :class:`Generation` -- one prompt's outcome: tokens, tokens reused, time to first token, hits per tier.
* :class:`GeneratorStatistics` -- requests, prompt tokens computed and reused, prefill and decode time.
* :class:`GenerationStream` -- the tokens of one prompt as they come (``async for``), then ``.result``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import torch

__all__ = ["Generation", "GenerationStream", "GeneratorStatistics"]


@dataclasses.dataclass(frozen=True, slots=True)
class Generation:
    """One prompt's outcome.

    Attributes:
        tokens: generated token ids (a stop token, when one ended it, is the last).
        prompt_tokens: tokens in the prompt.
        tokens_reused: prompt tokens whose KV came from the cache (not computed): positions from
            ``tokens_computed_first``.
        blocks_from: reused full blocks per tier they were found in (``"gpu"``, ``"host"``, ``"file"``).
        partial_tokens: tokens reused through a partial copy of one block.
        ttft_s: seconds from the call to the first token (admission, onboarding and prefill included).
        seconds: seconds for the whole call.
        finish_reason: ``"length"`` (``max_new_tokens`` reached) or ``"stop"`` (a stop token).
        tokens_stored: tokens whose KV is in the cache for later prompts (prompt and generated; fewer than
            all of them if the GPU tier had no room while decoding).
        logits: with ``output_logits=True``: one row per position of the prompt's last forward (prompt positions
            ``tokens_computed_first + tokens_reused .. prompt_tokens - 1``, then one per decode step), else ``None``.
        phases: where the time to first token went, in seconds: ``admit`` (from the call to the prefill: admission
            and the copies bringing reused blocks), ``preload`` (preparing the forward: the index of the blocks
            that hold the past), ``forward`` (the prompt forward: reading the past from the blocks and writing the
            new KV into them included), ``kv_write`` (of it, writing the new KV into the blocks), ``commit``
            (ordering later copies after the forward, committing), ``sample`` (the rest: choosing the first token).
            Device time on CUDA (events), host time on the emulated device. With hybrid prefill also
            ``hybrid_compute`` (the forward of the prefix's head, on the model thread) and ``hybrid_admit`` (the
            admission that loaded the rest meanwhile); ``admit`` then spans both, ``preload`` includes writing the
            head's KV into its blocks.
        tokens_computed_first: prompt tokens at the start of a cached prefix that the model computed instead of
            loading them: while the rest of the prefix was loaded (hybrid prefill: see
            :mod:`~tiered_kv.integrations.hf.hybrid`), or the whole match when loading lost at every split (then in
            the prompt's one forward); 0 otherwise.
    """

    tokens: tuple[int, ...]
    prompt_tokens: int
    tokens_reused: int
    blocks_from: dict[str, int]
    partial_tokens: int
    ttft_s: float
    seconds: float
    finish_reason: str
    tokens_stored: int
    logits: torch.Tensor | None = None
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    tokens_computed_first: int = 0

    @property
    def tokens_computed(self) -> int:
        """Prompt tokens the model ran (``prompt_tokens - tokens_reused``)."""
        return self.prompt_tokens - self.tokens_reused


@dataclasses.dataclass(frozen=True, slots=True)
class GeneratorStatistics:
    """A snapshot of a :class:`~tiered_kv.integrations.hf.generator.CachedGenerator`.

    Attributes:
        requests: prompts generated for.
        prompt_tokens, tokens_reused, tokens_computed: prompt tokens in total, reused, run by the model.
        generated_tokens: tokens produced.
        prefill_seconds: model time of prompt forwards (``tokens_computed`` tokens).
        decode_seconds: model time of decode steps.
        prefill_tokens_per_s: ``tokens_computed / prefill_seconds`` (0 before the first prefill).
    """

    requests: int
    prompt_tokens: int
    tokens_reused: int
    tokens_computed: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    prefill_tokens_per_s: float


class GenerationStream:
    """The tokens of one prompt, as they come: ``async for token in stream``; then ``stream.result``.

    Made by :meth:`~tiered_kv.integrations.hf.generator.CachedGenerator.stream`. ``aclose()`` (or leaving the
    ``async for`` early) stops the generation and frees the sequence.
    """

    def __init__(self, source: AsyncIterator[int | Generation]) -> None:
        self._source = source
        self.result: Generation | None = None

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> int:
        """The next token id.

        Notes:
            Cancellation: as :meth:`~tiered_kv.integrations.hf.generator.CachedGenerator.generate` (the sequence
            is freed when the stream closes).
        """
        item = await self._source.__anext__()
        if isinstance(item, Generation):
            self.result = item
            await self.aclose()
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        """Stop generating and free the sequence (waits for the forward in progress)."""
        aclose = getattr(self._source, "aclose", None)
        if aclose is not None:
            await aclose()
