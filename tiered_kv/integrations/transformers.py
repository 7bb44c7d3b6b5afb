"""Hugging Face transformers through a :class:`~tiered_kv.TieredKVCache`: prompts reuse KV from any tier.

Primitives:

* :class:`CachedGenerator` -- ``await generate(prompt_ids, max_new_tokens=...)`` (and ``generate_batch``,
  ``stream``) on a transformers causal LM (transformers 5.x): admits the prompt to the cache, builds the
  model's past key/values from the reused blocks (GPU, host or file tier; the partly matching last block
  too), runs the model only on the tokens not reused, writes the KV it computes into the sequence's blocks
  as the model produces it (a :class:`~transformers.DynamicCache` whose layers write through), commits,
  frees. The same prompt without the cache gives the same tokens and logits (see *Equality* below).
* :class:`Generation` -- one prompt's outcome: tokens, tokens reused, time to first token, hits per tier.
* :class:`GenerationStream` -- the tokens of one prompt as they come (``async for``), then ``.result``.
* :class:`GeneratorStatistics` -- requests, prompt tokens computed and reused, prefill and decode time.
* :func:`layout_for` / :func:`model_geometry` -- the :class:`~tiered_kv.KVLayout` a model's KV needs
  (layers, KV heads, head_dim, dtype from its config).
* :func:`reference_generate` -- the same greedy/sampled generation with plain transformers and no
  tiered_kv (the baseline the tests and the demo compare against).

Equality. The KV of reused tokens is byte for byte what the model computed earlier (a tier round trip is a
byte copy; the tests check it), and the model runs the remaining tokens at the same positions. So the
logits of every position are bitwise equal to plain transformers holding the same earlier KV in a
``DynamicCache`` (fp32 and bf16, CPU and CUDA: same kernels, same inputs), and greedy tokens equal a run
without any cache. Against a *full-prompt recompute* the logits differ by rounding: a BLAS blocks the rows
of a product and the sum over the KV length by shape (MKL even treats a row by its place in a 4-row group),
so the same position computed in another shape rounds differently -- two cache-free runs of prompts that
share a prefix already disagree on that prefix's KV by the same ~1e-7. The tests bound the difference
(fp32 <= 1e-5 on logits of magnitude ~1, where a wrong block is off by O(1); bf16 <= 0.25, argmax-equal).

Concurrency. Model forwards run on one worker thread per generator (``offload_compute=True``) so the event
loop keeps serving; cache calls stay on the loop. A forward only touches its own sequences' blocks (and
reads reused blocks, which are claimed and never move while claimed). Cancelling a ``generate`` waits for
the forward that is running to finish before the sequence is freed, so no block is freed while written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from ..blocks import DEFAULT_PRIORITY, Admission, CacheFullError, Request
from ..keys import as_token_array
from ..layer_major import LayerMajorPool
from ..layout import KVLayout
from ..pools import BlockPool, Tier

if TYPE_CHECKING:
    from ..cache import TieredKVCache
    from ..cost_model import CostModel

__all__ = [
    "CachedGenerator",
    "Generation",
    "GenerationStream",
    "GeneratorStatistics",
    "layout_for",
    "model_geometry",
    "reference_generate",
]

_T = TypeVar("_T")


# ------------------------------------------------------------------------------------------ model geometry


def model_geometry(model: Any) -> tuple[int, int, int, torch.dtype]:
    """``(layers, kv_heads, head_dim, dtype)`` of a transformers causal LM, from its config and weights.

    Raises:
        TypeError: ``model`` has no transformers config.
        ValueError: the config lacks the attention geometry.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"model must be a transformers PreTrainedModel with a config, got {type(model).__name__}")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(layers, int) or not isinstance(heads, int):
        raise ValueError("the model's config has no num_hidden_layers / num_attention_heads")
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    dtype = next(model.parameters()).dtype
    return int(layers), int(kv_heads), int(head_dim), dtype


def layout_for(model: Any, tokens_per_block: int = 16) -> KVLayout:
    """The :class:`~tiered_kv.KVLayout` of ``model``'s KV cache (blocks of ``tokens_per_block`` tokens).

    Example::

        layout = layout_for(model)
        async with TieredKVCache(layout, gpu_blocks=1024, host_blocks=8192, model_id="my-model") as cache:
            generator = CachedGenerator(model, cache)
    """
    layers, kv_heads, head_dim, dtype = model_geometry(model)
    return KVLayout(
        num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, tokens_per_block=tokens_per_block, dtype=dtype
    )


# ------------------------------------------------------------------------------------------ values


@dataclasses.dataclass(frozen=True, slots=True)
class Generation:
    """One prompt's outcome.

    Attributes:
        tokens: generated token ids (a stop token, when one ended it, is the last).
        prompt_tokens: tokens in the prompt.
        tokens_reused: prompt tokens whose KV came from the cache (not computed).
        blocks_from: reused full blocks per tier they were found in (``"gpu"``, ``"host"``, ``"file"``).
        partial_tokens: tokens reused through a partial copy of one block.
        ttft_s: seconds from the call to the first token (admission, onboarding and prefill included).
        seconds: seconds for the whole call.
        finish_reason: ``"length"`` (``max_new_tokens`` reached) or ``"stop"`` (a stop token).
        tokens_stored: tokens whose KV is in the cache for later prompts (prompt and generated; fewer than
            all of them if the GPU tier had no room while decoding).
        logits: with ``output_logits=True``: one row per position the model ran (prompt positions
            ``tokens_reused .. prompt_tokens - 1``, then one per decode step), else ``None``.
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

    @property
    def tokens_computed(self) -> int:
        """Prompt tokens the model ran (``prompt_tokens - tokens_reused``)."""
        return self.prompt_tokens - self.tokens_reused


@dataclasses.dataclass(frozen=True, slots=True)
class GeneratorStatistics:
    """A snapshot of a :class:`CachedGenerator`.

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


@dataclasses.dataclass(frozen=True, slots=True)
class _Sampling:
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: frozenset[int]
    priority: int
    output_logits: bool


# ------------------------------------------------------------------------------------------ the KV bridge


def _pool_views(pool: BlockPool | LayerMajorPool, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, ``(K, V)`` views ``[num_blocks, heads, tokens, head_dim]`` of a GPU pool (no copy)."""
    if isinstance(pool, LayerMajorPool):
        if pool.split_kv:
            return [(pool.layer(2 * i), pool.layer(2 * i + 1)) for i in range(layers)]
        return [(pool.layer(i)[:, 0], pool.layer(i)[:, 1]) for i in range(layers)]
    t = pool.tensor
    return [(t[:, i, 0], t[:, i, 1]) for i in range(layers)]


class _Rows:
    """Where a forward's KV goes: per batch row, the sequence's page table (None: not stored)."""

    __slots__ = ("_rows_kept", "block_index", "offsets", "page_tables", "start", "tokens_per_block")

    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.page_tables: list[tuple[int, ...] | None] = []
        self.start = 0  # position of the forward's first token
        self.block_index: torch.Tensor | None = None  # [rows stored * q] block per written position
        self.offsets: torch.Tensor | None = None  # [rows stored * q] token offset in its block
        self._rows_kept: torch.Tensor | None = None

    def prepare(self, start: int, length: int, device: torch.device) -> None:
        """Index tensors for a forward over positions ``[start, start + length)`` (built once, used by every layer)."""
        T = self.tokens_per_block
        self.start = start
        positions = np.arange(start, start + length)
        blocks, offsets, kept = [], [], []
        for row, pt in enumerate(self.page_tables):
            if pt is None:
                continue
            kept.append(row)
            table = np.asarray(pt, dtype=np.int64)
            blocks.append(table[positions // T])
            offsets.append(positions % T)
        if not kept:
            self.block_index = self.offsets = self._rows_kept = None
            return
        self.block_index = torch.from_numpy(np.concatenate(blocks)).to(device)
        self.offsets = torch.from_numpy(np.concatenate(offsets)).to(device)
        self._rows_kept = torch.tensor(kept, dtype=torch.long, device=device)

    def write(self, views: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one layer's new ``[batch, heads, q, head_dim]`` keys and values into the blocks."""
        if self.block_index is None:
            return
        assert self._rows_kept is not None and self.offsets is not None
        if self._rows_kept.numel() != keys.shape[0]:
            keys, values = keys.index_select(0, self._rows_kept), values.index_select(0, self._rows_kept)
        for view, new in zip(views, (keys, values), strict=True):
            # [rows, heads, q, dim] -> [rows * q, heads, dim], one row per written position
            flat = new.permute(0, 2, 1, 3).reshape(-1, new.shape[1], new.shape[3])
            view[self.block_index, :, self.offsets, :] = flat.to(view.dtype)


def _cache_classes() -> tuple[type[Any], type[Any]]:
    """``(WriteThroughLayer, WriteThroughCache)`` built on the installed transformers (imported lazily)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError as exc:  # pragma: no cover - transformers is a dependency
        raise ImportError(
            "tiered_kv.integrations.transformers needs transformers>=5: pip install transformers"
        ) from exc

    class WriteThroughLayer(DynamicLayer):  # type: ignore[no-untyped-call]
        """A ``DynamicLayer`` whose ``update`` also writes the new KV into the sequences' blocks."""

        def __init__(self, views: tuple[torch.Tensor, torch.Tensor], rows: _Rows) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self._views = views
            self._rows = rows

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._rows.write(self._views, key_states, value_states)
            return super().update(key_states, value_states, *args, **kwargs)

        def preload(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            """Start from reused KV ``[batch, heads, tokens, head_dim]`` without writing it back."""
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values

    class WriteThroughCache(DynamicCache):
        """A ``DynamicCache`` of :class:`WriteThroughLayer` s (one per model layer)."""

        def __init__(self, layers: list[Any]) -> None:  # not DynamicCache's init: it would build its own layers
            from transformers.cache_utils import Cache

            Cache.__init__(self, layers=layers)

    _CLASSES = (WriteThroughLayer, WriteThroughCache)
    return _CLASSES


_CLASSES: tuple[type[Any], type[Any]] | None = None


def _check_full_attention(model: Any) -> None:
    """Only models whose every layer is plain full attention (a ``DynamicLayer``) are supported."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    probe = DynamicCache(config=model.config)
    kinds = {type(layer).__name__ for layer in probe.layers if type(layer) is not DynamicLayer}
    if kinds:
        raise ValueError(
            f"this model has {', '.join(sorted(kinds))} cache layers (sliding window, linear or hybrid attention); "
            "CachedGenerator supports models whose every layer is full attention"
        )


# ------------------------------------------------------------------------------------------ the generator


class CachedGenerator:
    """Generate with a transformers causal LM whose prompts reuse KV blocks from a :class:`~tiered_kv.TieredKVCache`.

    Args:
        model: a transformers causal LM (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...) whose every layer is
            full attention, on the cache's device (``cpu`` for the emulated device), in eval mode.
        cache: the cache; its layout must be :func:`layout_for` the model (layers, KV heads, head_dim, dtype).
        offload_compute: run model forwards on a worker thread (the event loop keeps serving meanwhile).
        on_prefill: ``callback(tokens, seconds)`` after every prompt forward (e.g. a cost model's
            ``observe_prefill``).
        on_reuse: ``callback(seq_ids, kv)`` on the model thread, before a prompt forward that reuses tokens:
            ``kv`` is, per layer, the ``(keys, values)`` ``[rows, kv_heads, tokens_reused, head_dim]`` the model
            is about to attend to (read it, do not keep or change it; e.g. to verify it against a recompute).
        cost_model: a :class:`~tiered_kv.cost_model.CostModel` to feed: every admission's time against the bytes
            it brought per tier, every prefill's time against its tokens (attach it to the cache to use it).

    Raises:
        TypeError: not a transformers model, or the cache is not a ``TieredKVCache``.
        ValueError: layout or device mismatch, an unsupported attention type, a GPU pool of another kind.

    Example::

        layout = layout_for(model)
        async with TieredKVCache(layout, gpu_blocks=512, host_blocks=4096, device="cpu") as cache:
            generator = CachedGenerator(model, cache)
            out = await generator.generate(prompt_ids, max_new_tokens=32)
            print(out.tokens, out.tokens_reused, out.ttft_s)
    """

    def __init__(
        self,
        model: Any,
        cache: TieredKVCache,
        *,
        offload_compute: bool = True,
        on_prefill: Callable[[int, float], None] | None = None,
        on_reuse: Callable[[list[int], list[tuple[torch.Tensor, torch.Tensor]]], None] | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        from ..cache import TieredKVCache

        if not isinstance(cache, TieredKVCache):
            raise TypeError(f"cache must be a TieredKVCache, got {type(cache).__name__}")
        layers, kv_heads, head_dim, dtype = model_geometry(model)
        layout = cache.layout
        want = (layers, kv_heads, head_dim, dtype, 2)
        have = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.kv_factor)
        if want != have:
            raise ValueError(
                f"the cache's layout (layers={have[0]}, kv_heads={have[1]}, head_dim={have[2]}, dtype={have[3]}, "
                f"kv_factor={have[4]}) does not fit the model (layers={layers}, kv_heads={kv_heads}, "
                f"head_dim={head_dim}, dtype={dtype}); build it with "
                "tiered_kv.integrations.transformers.layout_for(model)"
            )
        device = next(model.parameters()).device
        engine_device = cache.engine.device.torch_device
        if device != engine_device:
            raise ValueError(
                f"the model is on {device} but the cache's GPU tier is on {engine_device}; move one of them"
            )
        pool = cache.engine.pool(Tier.GPU)
        if not isinstance(pool, (BlockPool, LayerMajorPool)):
            raise ValueError(f"unsupported GPU pool {type(pool).__name__}")
        _check_full_attention(model)
        self.model = model
        self.cache = cache
        self.device = device
        self.on_prefill = on_prefill
        self.on_reuse = on_reuse
        self.cost_model = cost_model
        self._views = _pool_views(pool, layers)
        self._tpb = layout.tokens_per_block
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiered_kv-model") if offload_compute else None
        )
        self._requests = self._prompt_tokens = self._reused = self._computed = self._generated = 0
        self._prefill_s = self._decode_s = 0.0

    # ------------------------------------------------------------------------------------ public

    async def generate(
        self,
        prompt_ids: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Collection[int] = (),
        priority: int = DEFAULT_PRIORITY,
        output_logits: bool = False,
    ) -> Generation:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``, reusing cached KV of its prefix.

        Args:
            prompt_ids: the prompt's token ids (at least one).
            max_new_tokens: tokens to generate (>= 1).
            temperature: 0 for greedy decoding; otherwise sampling at this temperature.
            top_k: keep the ``top_k`` most likely tokens when sampling (0: all).
            top_p: nucleus sampling threshold in ``(0, 1]``.
            seed: seed of the sampling generator (reproducible samples).
            stop_token_ids: generation ends after any of these (it is the last token returned).
            priority: retention priority of the prompt's blocks (0..100).
            output_logits: return the logits of every position the model ran (see :class:`Generation`).

        Returns:
            The :class:`Generation`.

        Raises:
            ValueError, TypeError: bad arguments (before anything is admitted), prompt plus reply longer than a
                sequence may hold.
            CacheFullError: the prompt does not fit in the GPU tier now (nothing changed; retry later).
            TransferError: bringing a reused block back failed (the blocks were dropped; retry recomputes).

        Notes:
            Cancellation: the forward in progress (if any) finishes, then the sequence is freed and the
            cancellation propagates; KV already committed stays reusable.
        """
        [result] = await self.generate_batch(
            [prompt_ids],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop_token_ids=stop_token_ids,
            priority=priority,
            output_logits=output_logits,
        )
        return result

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
        *,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Collection[int] = (),
        priority: int = DEFAULT_PRIORITY,
        output_logits: bool = False,
    ) -> list[Generation]:
        """Generate for several prompts admitted as one batch (two-phase: each request's reuse is its own).

        Prompts with the same length and the same number of reused tokens run as one batch in every
        forward (no padding: each row's tokens are its run alone, its logits up to the rounding of other
        kernel shapes); the others run group after group. Arguments
        are those of :meth:`generate`, applied to every prompt (``seed`` seeds each prompt's sampler with
        ``seed + index``).

        Returns:
            One :class:`Generation` per prompt, in order.

        Notes:
            Cancellation: as :meth:`generate`; every sequence of the batch is freed.
        """
        sampling = self._check_sampling(
            max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, priority, output_logits
        )
        arrays = self._check_prompts(prompts, max_new_tokens)
        results: list[Generation | None] = [None] * len(arrays)
        t0 = time.perf_counter()
        admissions = await self._admit([Request(a, priority=priority) for a in arrays], t0)
        try:
            groups: dict[tuple[int, int], list[int]] = {}
            for i, (a, adm) in enumerate(zip(arrays, admissions, strict=True)):
                groups.setdefault((len(a), adm.tokens_reused), []).append(i)
            for rows in groups.values():
                async for _ in self._run_group(rows, arrays, admissions, sampling, t0, results):
                    pass
        finally:
            self._free_all(admissions)
        return [r for r in results if r is not None]

    def stream(
        self,
        prompt_ids: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Collection[int] = (),
        priority: int = DEFAULT_PRIORITY,
    ) -> GenerationStream:
        """The tokens of one prompt as they are generated: ``async for token in generator.stream(ids)``.

        Arguments are those of :meth:`generate` (validated here, before anything is admitted). After the
        iteration ends, ``.result`` is the :class:`Generation`. Closing the iterator early (``aclose()``, or
        leaving an ``async for`` with ``break``) frees the sequence.

        Notes:
            Cancellation: as :meth:`generate`.
        """
        sampling = self._check_sampling(
            max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, priority, False
        )
        [array] = self._check_prompts([prompt_ids], max_new_tokens)
        return GenerationStream(self._stream_one(array, sampling))

    def statistics(self) -> GeneratorStatistics:
        """Counters since the generator was made."""
        return GeneratorStatistics(
            requests=self._requests,
            prompt_tokens=self._prompt_tokens,
            tokens_reused=self._reused,
            tokens_computed=self._computed,
            generated_tokens=self._generated,
            prefill_seconds=self._prefill_s,
            decode_seconds=self._decode_s,
            prefill_tokens_per_s=self._computed / self._prefill_s if self._prefill_s > 0 else 0.0,
        )

    def close(self) -> None:
        """Stop the model worker thread (after the forward in progress). Idempotent."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    def __repr__(self) -> str:
        return f"<CachedGenerator {type(self.model).__name__} on {self.device} requests={self._requests}>"

    # ------------------------------------------------------------------------------------ validation

    @staticmethod
    def _check_sampling(
        max_new_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int | None,
        stop_token_ids: Collection[int],
        priority: int,
        output_logits: bool,
    ) -> _Sampling:
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
        return _Sampling(
            max_new_tokens,
            float(temperature),
            top_k,
            float(top_p),
            seed,
            frozenset(stops),
            priority,
            bool(output_logits),
        )

    def _check_prompts(self, prompts: Sequence[Any], max_new_tokens: int) -> list[np.ndarray]:
        if isinstance(prompts, (str, bytes, np.ndarray, torch.Tensor)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of token-id sequences")
        if not prompts:
            raise ValueError("prompts is empty")
        vocab = getattr(self.model.config.get_text_config(decoder=True), "vocab_size", None)
        limit = self.cache.blocks.max_blocks_per_seq * self._tpb
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, torch.Tensor):
                if p.dim() == 2 and p.shape[0] == 1:
                    p = p[0]
                p = p.detach().cpu().numpy()
            arr = as_token_array(p, f"prompt {i}")
            if arr.size == 0:
                raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
            if arr.min() < 0 or (isinstance(vocab, int) and arr.max() >= vocab):
                raise ValueError(f"prompt {i} has a token id outside the model's vocabulary [0, {vocab})")
            if arr.size + max_new_tokens - 1 > limit:
                raise ValueError(
                    f"prompt {i} has {arr.size} tokens; with max_new_tokens={max_new_tokens} that is more than a "
                    f"sequence may hold ({limit} tokens)"
                )
            out.append(arr)
        return out

    # ------------------------------------------------------------------------------------ core

    async def _stream_one(self, array: np.ndarray, sampling: _Sampling) -> AsyncIterator[int | Generation]:
        results: list[Generation | None] = [None]
        t0 = time.perf_counter()
        admissions = await self._admit([Request(array, priority=sampling.priority)], t0)
        try:
            async for token in self._run_group([0], [array], admissions, sampling, t0, results):
                yield token
        finally:
            self._free_all(admissions)
        assert results[0] is not None
        yield results[0]

    async def _admit(self, requests: list[Request], t0: float) -> list[Admission]:
        admissions = await self.cache.add_sequences(requests)
        if self.cost_model is not None:
            per_block = self.cache.layout.bytes_per_block
            moved = {t: sum(a.blocks_from.get(t, 0) for a in admissions) * per_block for t in ("host", "file")}
            self.cost_model.observe_admission(moved, time.perf_counter() - t0)
        return admissions

    def _free_all(self, admissions: list[Admission]) -> None:
        live = self.cache.blocks.live_sequences
        for adm in admissions:
            if adm.seq_id in live:
                self.cache.free(adm.seq_id)

    async def _compute(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the model thread; a cancellation waits for it to finish (it writes our blocks)."""
        if self._executor is None:
            return fn()
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            while not future.done():
                try:
                    await asyncio.shield(future)
                except asyncio.CancelledError:
                    continue
                except BaseException:
                    break
            raise

    def _sync_writes(self) -> None:
        """Copies enqueued from now on wait for the compute stream's writes and reads of our blocks (CUDA)."""
        if self.device.type == "cuda":
            self.cache.engine.sync_with_compute(torch.cuda.current_stream(self.device))

    async def _run_group(
        self,
        rows: list[int],
        arrays: list[np.ndarray],
        admissions: list[Admission],
        sampling: _Sampling,
        t0: float,
        results: list[Generation | None],
    ) -> AsyncIterator[int]:
        """Prefill then decode ``rows`` (same prompt length and reuse) in lockstep; yields row 0's tokens."""
        layer_cls, cache_cls = _cache_classes()
        cache = self.cache
        adms = [admissions[i] for i in rows]
        n = len(arrays[rows[0]])
        reused = adms[0].tokens_reused
        target = _Rows(self._tpb)
        target.page_tables = [a.page_table for a in adms]
        kv = cache_cls([layer_cls(views, target) for views in self._views])
        generators = [self._sampler(sampling, i) for i in rows]
        prompt = torch.from_numpy(np.stack([arrays[i] for i in rows]))
        logits_rows: list[list[torch.Tensor]] = [[] for _ in rows]

        def prefill() -> tuple[torch.Tensor, float]:
            t = time.perf_counter()
            with torch.inference_mode():
                if reused:
                    self._preload(kv, [a.page_table for a in adms], reused)
                    if self.on_reuse is not None:
                        self.on_reuse([a.seq_id for a in adms], [(layer.keys, layer.values) for layer in kv.layers])
                target.prepare(reused, n - reused, self.device)
                out = self.model(
                    input_ids=prompt[:, reused:].to(self.device),
                    past_key_values=kv,
                    use_cache=True,
                    logits_to_keep=0 if sampling.output_logits else 1,
                )
                logits = out.logits
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
            return logits, time.perf_counter() - t

        logits, seconds = await self._compute(prefill)
        self._sync_writes()
        for a in adms:
            cache.commit(a.seq_id)
        self._prefill_s += seconds
        self._computed += (n - reused) * len(rows)
        self._reused += reused * len(rows)
        self._prompt_tokens += n * len(rows)
        self._requests += len(rows)
        if self.on_prefill is not None:
            self.on_prefill((n - reused) * len(rows), seconds)
        if self.cost_model is not None:
            self.cost_model.observe_prefill((n - reused) * len(rows), seconds)

        live = list(range(len(rows)))  # positions (in this group) still generating
        stored = [n] * len(rows)  # tokens whose KV is in each sequence's blocks
        storing = [True] * len(rows)
        tokens: list[list[int]] = [[] for _ in rows]
        finish = ["length"] * len(rows)
        ttft = 0.0
        step_logits = logits[:, -1, :]
        if sampling.output_logits:
            for j in range(len(rows)):
                logits_rows[j].append(logits[j].float().cpu())
        for step in range(sampling.max_new_tokens):
            chosen = self._choose(step_logits, sampling, [generators[j] for j in live])
            if step == 0:
                ttft = time.perf_counter() - t0
            for j, tok in zip(live, chosen, strict=True):
                tokens[j].append(tok)
                if tok in sampling.stop:
                    finish[j] = "stop"
                if j == 0:
                    yield tok
            self._generated += len(live)
            if step == sampling.max_new_tokens - 1:
                break
            keep = [k for k, j in enumerate(live) if finish[j] != "stop"]
            if not keep:
                break
            if len(keep) != len(live):
                kv.batch_select_indices(torch.tensor(keep, device=self.device))
                live = [live[k] for k in keep]
                chosen = [chosen[k] for k in keep]
            # store each fed token's KV: its block must exist before the forward writes it
            page_tables: list[tuple[int, ...] | None] = []
            for j, tok in zip(live, chosen, strict=True):
                seq = adms[j].seq_id
                if storing[j]:
                    try:
                        page_tables.append(await cache.append_tokens(seq, [tok]))
                        stored[j] += 1
                        continue
                    except CacheFullError:
                        storing[j] = False  # no GPU room: the rest of this reply is generated but not stored
                page_tables.append(None)
            target.page_tables = page_tables
            position = n + step
            feed = torch.tensor([[t] for t in chosen], dtype=torch.long)

            def decode(feed: torch.Tensor = feed, position: int = position) -> tuple[torch.Tensor, float]:
                t = time.perf_counter()
                with torch.inference_mode():
                    target.prepare(position, 1, self.device)
                    out = self.model(
                        input_ids=feed.to(self.device), past_key_values=kv, use_cache=True, logits_to_keep=1
                    )
                    logits = out.logits[:, -1, :]
                    if self.device.type == "cuda":
                        torch.cuda.current_stream(self.device).synchronize()
                return logits, time.perf_counter() - t

            step_logits, seconds = await self._compute(decode)
            self._decode_s += seconds
            self._sync_writes()
            for j in live:
                if storing[j]:
                    cache.commit(adms[j].seq_id)
            if sampling.output_logits:
                for k, j in enumerate(live):
                    logits_rows[j].append(step_logits[k : k + 1].float().cpu())
        elapsed = time.perf_counter() - t0
        for j, i in enumerate(rows):
            a = adms[j]
            results[i] = Generation(
                tokens=tuple(tokens[j]),
                prompt_tokens=n,
                tokens_reused=reused,
                blocks_from=dict(a.blocks_from),
                partial_tokens=a.partial_tokens,
                ttft_s=ttft,
                seconds=elapsed,
                finish_reason=finish[j],
                tokens_stored=stored[j],
                logits=torch.cat(logits_rows[j]) if sampling.output_logits else None,
            )

    def _preload(self, kv: Any, page_tables: list[tuple[int, ...]], reused: int) -> None:
        """Fill every layer of ``kv`` with the reused KV of each row (positions ``[0, reused)``)."""
        nb = -(-reused // self._tpb)
        index = torch.tensor([pt[:nb] for pt in page_tables], dtype=torch.long, device=self.device)  # [rows, nb]
        flat = index.reshape(-1)
        rows = len(page_tables)
        for layer, (k_view, v_view) in zip(kv.layers, self._views, strict=True):
            parts = []
            for view in (k_view, v_view):
                blocks = view.index_select(0, flat)  # [rows * nb, heads, T, dim]
                _, heads, T, dim = blocks.shape
                x = blocks.view(rows, nb, heads, T, dim).permute(0, 2, 1, 3, 4).reshape(rows, heads, nb * T, dim)
                parts.append(x[:, :, :reused] if nb * T != reused else x)
            layer.preload(parts[0], parts[1])

    def _sampler(self, sampling: _Sampling, index: int) -> torch.Generator | None:
        if sampling.temperature == 0:
            return None
        g = torch.Generator(device=self.device)
        if sampling.seed is not None:
            g.manual_seed(sampling.seed + index)
        else:
            g.seed()
        return g

    @staticmethod
    def _choose(logits: torch.Tensor, sampling: _Sampling, generators: list[torch.Generator | None]) -> list[int]:
        """One token per row: argmax (greedy), or a sample after temperature, top-k and top-p."""
        if sampling.temperature == 0:
            return [int(t) for t in logits.argmax(dim=-1).tolist()]
        return [_sample(logits[k], sampling, g) for k, g in enumerate(generators)]


def _sample(logits: torch.Tensor, sampling: _Sampling, generator: torch.Generator | None) -> int:
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


class GenerationStream:
    """The tokens of one prompt, as they come: ``async for token in stream``; then ``stream.result``.

    Made by :meth:`CachedGenerator.stream`. ``aclose()`` (or leaving the ``async for`` early) stops the
    generation and frees the sequence.
    """

    def __init__(self, source: AsyncIterator[int | Generation]) -> None:
        self._source = source
        self.result: Generation | None = None

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> int:
        """The next token id.

        Notes:
            Cancellation: as :meth:`CachedGenerator.generate` (the sequence is freed when the stream closes).
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


# ------------------------------------------------------------------------------------------ baseline


def reference_generate(
    model: Any,
    prompt_ids: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    max_new_tokens: int = 16,
    stop_token_ids: Collection[int] = (),
    output_logits: bool = False,
    past: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[list[int], torch.Tensor | None, float]:
    """Greedy generation with plain transformers and a plain ``DynamicCache`` (no tiered_kv).

    Args:
        model: the causal LM.
        prompt_ids: the prompt.
        max_new_tokens: tokens to generate.
        stop_token_ids: generation ends after any of these.
        output_logits: also return the logits of every position run.
        past: per layer ``(keys, values)`` ``[1, heads, r, head_dim]`` of the prompt's first ``r`` tokens,
            held in memory (e.g. from an earlier forward): the forward then runs ``prompt[r:]`` only, as
            :class:`CachedGenerator` does with ``r`` reused tokens; ``None`` runs the whole prompt.

    Returns:
        ``(tokens, logits, ttft_s)``: the generated ids; with ``output_logits`` the logits of every position
        run (prompt positions from ``r``, then one row per decode step, as :attr:`Generation.logits`);
        seconds to the first token.
    """
    from transformers.cache_utils import DynamicCache

    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64)).reshape(1, -1).to(device)
    stops = {int(s) for s in stop_token_ids}
    rows: list[torch.Tensor] = []
    tokens: list[int] = []
    t0 = time.perf_counter()
    ttft = 0.0
    with torch.inference_mode():
        kv = DynamicCache()
        start = 0
        if past is not None:
            for i, (k, v) in enumerate(past):
                kv.update(k, v, i)
            start = past[0][0].shape[-2]
        out = model(
            input_ids=ids[:, start:], past_key_values=kv, use_cache=True, logits_to_keep=0 if output_logits else 1
        )
        logits = out.logits
        if output_logits:
            rows.append(logits[0].float().cpu())
        step = logits[:, -1, :]
        for i in range(max_new_tokens):
            tok = int(step.argmax(dim=-1).item())
            if i == 0:
                ttft = time.perf_counter() - t0
            tokens.append(tok)
            if tok in stops or i == max_new_tokens - 1:
                break
            out = model(
                input_ids=torch.tensor([[tok]], device=device), past_key_values=kv, use_cache=True, logits_to_keep=1
            )
            step = out.logits[:, -1, :]
            if output_logits:
                rows.append(step.float().cpu())
    return tokens, (torch.cat(rows) if output_logits else None), ttft
