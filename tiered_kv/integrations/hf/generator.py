"""Hugging Face transformers through a :class:`~tiered_kv.TieredKVCache`: prompts reuse KV from any tier.

Primitives:

* :class:`CachedGenerator` -- ``await generate(prompt_ids, max_new_tokens=...)`` (and ``generate_batch``,
  ``stream``) on a transformers causal LM (transformers 5.x): admits the prompt to the cache (bringing reused
  blocks from the GPU, host or file tier; the partly matching last block too), runs the model only on the tokens
  not reused, through a :class:`~transformers.DynamicCache` whose layers write the KV the model computes into the
  sequence's blocks and, in the prompt's forward, read the past from those blocks one layer at a time (see
  :mod:`.kv`), commits, frees. The same prompt without the cache gives the same tokens and logits (see *Equality*).

Re-exported from the modules of the integration (import them from here):

* :class:`Generation`, :class:`GenerationStream`, :class:`GeneratorStatistics` (:mod:`.results`) -- one
  prompt's outcome, its tokens as they come, the generator's counters.
* :func:`layout_for` / :func:`model_geometry`, :func:`reference_generate` (:mod:`.model`) -- the
  :class:`~tiered_kv.KVLayout` a model's KV needs; the same generation with plain transformers and no
  tiered_kv (the baseline the tests and the demo compare against).
* :class:`GenerateOptions`, :class:`SamplingOptions` (:mod:`.sampling`) -- the keyword options.

The KV bridge (past KV read from the blocks, new KV written through into them) is :mod:`.kv`.

Slow tiers. A single prompt (``generate``, ``stream``) whose cached prefix starts in the file tier is split by the
generator's cost model (:meth:`~tiered_kv.cost_model.CostModel.split`): the model computes the prefix's first blocks
while the rest is read back, then runs the remaining tokens (hybrid prefill, :mod:`.hybrid`). With no cost model
given, a generator whose cache has a file or remote tier makes its own (``cost_model="auto"``), fed by its own
admissions and prefills; until both rates are measured it loads the whole prefix. Batches of several prompts load
what they match.

Equality. The KV of reused tokens is byte for byte what the model computed earlier (a tier round trip is a
byte copy; the tests check it), and the model runs the remaining tokens at the same positions. So the
logits of every position are bitwise equal to plain transformers holding the same earlier KV in a
``DynamicCache`` (fp32 and bf16, CPU and CUDA: same kernels, same inputs), and so are the tokens. Against a
*full-prompt recompute* (a run without any cache) the logits differ by rounding: a BLAS blocks the rows of a
product and the sum over the KV length by shape (MKL even treats a row by its place in a 4-row group), so the
same position computed in another shape rounds differently -- two cache-free runs of prompts that share a
prefix already disagree on that prefix's KV by the same ~1e-7. The tests bound the difference on logits of
magnitude ~5: ≤ 1e-4 fp32, ≤ 0.25 bf16, ≤ 0.0625 fp16 (a wrong block is off by O(1)). Greedy tokens are
therefore equal to the recompute's in fp32, and in bf16 and fp16 equal except at a near-tie: where the
recompute's two best logits are within twice that bound, either may be picked, and the continuations differ
from that step on.

Concurrency. Model forwards run on one worker thread per generator (``offload_compute=True``) so the event
loop keeps serving; cache calls stay on the loop. A forward only touches its own sequences' blocks (and
reads reused blocks, which are claimed and never move while claimed). Cancelling a ``generate`` waits for
the forward that is running to finish before the sequence is freed, so no block is freed while written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Unpack

import numpy as np
import torch

from ...blocks import Admission, CacheFullError, Request
from ...errors import TransferError
from ...layer_major import LayerMajorPool
from ...pools import BlockPool, Tier
from .hybrid import ComputedPrefix, compute_prefix, finished, write_prefix
from .kv import PhaseTimer, RowTargets, cache_classes, pool_views
from .model import cache_kwargs, check_full_attention, check_layout, layout_for, model_geometry, reference_generate
from .results import Generation, GenerationStream, GeneratorStatistics
from .sampling import (
    GenerateOptions,
    Sampling,
    SamplingOptions,
    check_prompts,
    check_sampling,
    choose,
    make_sampler,
)

if TYPE_CHECKING:
    from ...cache import TieredKVCache
    from ...cost_model import CostModel
    from ...layerwise import LayerLoad

__all__ = [
    "CachedGenerator",
    "GenerateOptions",
    "Generation",
    "GenerationStream",
    "GeneratorStatistics",
    "SamplingOptions",
    "layout_for",
    "model_geometry",
    "reference_generate",
]

_T = TypeVar("_T")


class _LoadFailed(Exception):
    """A layer-by-layer load failed its settle (the batch was freed): admit the prompt again."""


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
            ``kv`` is, per layer, the ``(keys, values)`` ``[rows, kv_heads, past, head_dim]`` the model is about
            to attend to, ``past = tokens_computed_first + tokens_reused`` (the head a hybrid prefill computed,
            then the reused tokens); read it, do not keep or change it (e.g. to verify it against a recompute).
        cost_model: a :class:`~tiered_kv.cost_model.CostModel` to feed (every admission's time against the bytes
            it brought per tier, every prefill's time against its tokens) and to ask, for a single prompt whose match
            starts in the file tier, how many leading blocks to compute while the rest loads (hybrid prefill; attach
            it to the cache to also price plain reuse). ``"auto"`` (the default): a new unattached one when the
            cache has a file or remote tier, else none. ``None``: no cost model (everything matched is loaded).
        load_layers: a single prompt's blocks reused from host memory come back this many layers at a time (the
            last group in halves down to one layer), and the prompt's forward runs each layer as soon as its blocks
            have landed
            (:meth:`~tiered_kv.TieredKVCache.add_sequences_layerwise`); ``0``: the admission waits for every block.

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
        cost_model: CostModel | Literal["auto"] | None = "auto",
        load_layers: int = 4,
    ) -> None:
        from ...cache import TieredKVCache
        from ...cost_model import CostModel

        if not isinstance(cache, TieredKVCache):
            raise TypeError(f"cache must be a TieredKVCache, got {type(cache).__name__}")
        layout = cache.layout
        check_layout(model, layout)
        device = next(model.parameters()).device
        engine_device = cache.engine.device.torch_device
        if device != engine_device:
            raise ValueError(
                f"the model is on {device} but the cache's GPU tier is on {engine_device}; move one of them"
            )
        pool = cache.engine.pool(Tier.GPU)
        if not isinstance(pool, (BlockPool, LayerMajorPool)):
            raise ValueError(f"unsupported GPU pool {type(pool).__name__}")
        check_full_attention(model)
        if isinstance(load_layers, bool) or not isinstance(load_layers, int) or load_layers < 0:
            raise ValueError(f"load_layers must be an int >= 0, got {load_layers!r}")
        if isinstance(cost_model, str):
            if cost_model != "auto":
                raise ValueError(f"cost_model must be a CostModel, None or 'auto', got {cost_model!r}")
            slow = cache.blocks.capacity[Tier.FILE] > 0 or cache.remote is not None
            cost_model = CostModel(cache) if slow else None
        elif cost_model is not None and not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, None or 'auto', got {type(cost_model).__name__}")
        self.model = model
        self.cache = cache
        self.device = device
        self.on_prefill = on_prefill
        self.on_reuse = on_reuse
        self.cost_model = cost_model
        self._load_layers = load_layers
        self._views = pool_views(pool, layout.num_layers)
        self._pool_tensor = pool.tensor if isinstance(pool, BlockPool) else None  # short forwards write at once
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
        **options: Unpack[GenerateOptions],
    ) -> Generation:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``, reusing cached KV of its prefix.

        Args:
            prompt_ids: the prompt's token ids (at least one).
            **options: keyword options (:class:`~tiered_kv.integrations.hf.sampling.GenerateOptions`), all optional:
                ``max_new_tokens`` tokens to generate (>= 1, default 16); ``temperature`` 0 for greedy decoding
                (default), otherwise sampling at this temperature; ``top_k`` keep the ``top_k`` most likely tokens
                when sampling (0: all); ``top_p`` nucleus sampling threshold in ``(0, 1]``; ``seed`` seed of the
                sampling generator (reproducible samples); ``stop_token_ids`` generation ends after any of these
                (it is the last token returned); ``priority`` retention priority of the prompt's blocks (0..100);
                ``output_logits`` return the logits of every position the model ran (see :class:`Generation`).

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
        [result] = await self.generate_batch([prompt_ids], **options)
        return result

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
        **options: Unpack[GenerateOptions],
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
        sampling = check_sampling(**options)
        arrays = check_prompts(prompts, sampling.max_new_tokens, self._vocab(), self._max_tokens())
        results: list[Generation | None] = [None] * len(arrays)
        t0 = time.perf_counter()
        if len(arrays) == 1:
            async for _ in self._stream_one(arrays[0], sampling, results):
                pass
            return [r for r in results if r is not None]
        admissions = await self._admit([Request(a, priority=sampling.priority) for a in arrays], t0)
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
        **options: Unpack[SamplingOptions],
    ) -> GenerationStream:
        """The tokens of one prompt as they are generated: ``async for token in generator.stream(ids)``.

        Arguments are those of :meth:`generate` (validated here, before anything is admitted). After the
        iteration ends, ``.result`` is the :class:`Generation`. Closing the iterator early (``aclose()``, or
        leaving an ``async for`` with ``break``) frees the sequence.

        Notes:
            Cancellation: as :meth:`generate`.
        """
        sampling = check_sampling(output_logits=False, **options)  # output_logits among options: TypeError
        [array] = check_prompts([prompt_ids], sampling.max_new_tokens, self._vocab(), self._max_tokens())
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

    def _vocab(self) -> int | None:
        vocab = getattr(self.model.config.get_text_config(decoder=True), "vocab_size", None)
        return vocab if isinstance(vocab, int) else None

    def _max_tokens(self) -> int:
        return self.cache.blocks.max_blocks_per_seq * self._tpb

    # ------------------------------------------------------------------------------------ core

    async def _stream_one(
        self, array: np.ndarray, sampling: Sampling, results: list[Generation | None] | None = None
    ) -> AsyncIterator[int | Generation]:
        """One prompt's tokens, then its :class:`Generation` (also left in ``results[0]``)."""
        results = [None] if results is None else results
        t0 = time.perf_counter()
        layerwise = self._load_layers > 0
        while True:
            admissions, computed, load = await self._admit_one(array, sampling.priority, t0, layerwise)
            try:
                async for token in self._run_group([0], [array], admissions, sampling, t0, results, computed, load):
                    yield token
                break
            except _LoadFailed:  # raised before the first token: admit again, the dropped blocks are recomputed
                layerwise = False
            finally:
                self._free_all(admissions)
        assert results[0] is not None
        yield results[0]

    async def _admit_one(
        self, array: np.ndarray, priority: int, t0: float, layerwise: bool
    ) -> tuple[list[Admission], ComputedPrefix | None, LayerLoad | None]:
        """Admit one prompt; when the cost model splits its match, compute the head meanwhile (see :mod:`.hybrid`).

        With ``layerwise``, blocks from host memory land one layer group at a time (the returned load).
        """
        c = 0
        if self.cost_model is not None:
            match = self.cache.blocks.match(array)
            c = self.cost_model.split(match, len(array))
            if c and c >= len(match.blocks):
                # Loading loses at every split: recompute the whole prompt in one forward (a head forward and then
                # a second one over its KV would cost more than recomputing). Every block it matches at admission
                # is left where it is, however the cache changed since this look.
                whole = -(-len(array) // self._tpb)
                return await self._admit([Request(array, priority=priority, compute_blocks=whole)], t0), None, None
        if c == 0 and layerwise:
            admissions, load = await self.cache.add_sequences_layerwise(
                [Request(array, priority=priority)], group_layers=self._load_layers
            )
            self._observe_admission(admissions, t0, landing="host" if load is not None else None)
            return admissions, None, load
        if c == 0:
            return await self._admit([Request(array, priority=priority)], t0), None, None
        ids = torch.from_numpy(np.ascontiguousarray(array[None, : c * self._tpb]))
        future = asyncio.ensure_future(self._compute(lambda: compute_prefix(self.model, ids, self.device)))
        try:
            admissions = await self._admit([Request(array, priority=priority, compute_blocks=c)], t0)
        except BaseException:
            await finished(future)  # the pre-forward writes no block, but the model thread is left idle
            raise
        admitted = time.perf_counter()
        try:
            computed = await future
        except BaseException:
            self._free_all(admissions)
            raise
        computed.admit_seconds = admitted - t0
        return admissions, computed, None

    async def _admit(self, requests: list[Request], t0: float) -> list[Admission]:
        admissions = await self.cache.add_sequences(requests)
        self._observe_admission(admissions, t0)
        return admissions

    def _observe_admission(self, admissions: list[Admission], t0: float, landing: str | None = None) -> None:
        """Feed the cost model an admission's time against the bytes it brought per tier.

        ``landing``: a tier whose blocks were still landing when the admission returned (not counted).
        """
        if self.cost_model is not None:
            per_block = self.cache.layout.bytes_per_block
            moved = {
                t: sum(a.blocks_from.get(t, 0) for a in admissions) * per_block if t != landing else 0
                for t in ("host", "file")
            }
            self.cost_model.observe_admission(moved, time.perf_counter() - t0)

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
            await finished(future)
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
        sampling: Sampling,
        t0: float,
        results: list[Generation | None],
        computed: ComputedPrefix | None = None,
        load: LayerLoad | None = None,
    ) -> AsyncIterator[int]:
        """Prefill then decode ``rows`` (same prompt length and reuse) in lockstep; yields row 0's tokens.

        ``computed``: the head of row 0's prompt (one row), computed during its admission (hybrid prefill).
        ``load``: row 0's reused blocks still landing layer by layer: the prompt's forward waits for each layer's,
        and they are settled before anything is committed or sampled (:class:`_LoadFailed` when they fail).
        """
        layer_cls, cache_cls = cache_classes()
        cache = self.cache
        adms = [admissions[i] for i in rows]
        n = len(arrays[rows[0]])
        reused = adms[0].tokens_reused
        start = reused if computed is None else computed.past_end(adms[0])  # the prompt forward's first position
        target = RowTargets(self._tpb, pool=self._pool_tensor)
        target.page_tables = [a.page_table for a in adms]
        target.load = load
        kv = cache_cls([layer_cls(views, target, i) for i, views in enumerate(self._views)])
        generators = [make_sampler(sampling, i, self.device) for i in rows]
        prompt = torch.from_numpy(np.stack([arrays[i] for i in rows]))
        logits_rows: list[list[torch.Tensor]] = [[] for _ in rows]

        timer = PhaseTimer(self.device)
        admitted = time.perf_counter()

        def prefill() -> tuple[torch.Tensor, float]:
            t = time.perf_counter()
            with torch.inference_mode():
                mark = timer.start()
                if computed is not None:  # the head into its fresh blocks: the past is then all in blocks
                    write_prefix(computed, self._views, adms[0].page_table, self._tpb, self.device)
                target.prepare(start, n - start, self.device)
                if start and self.on_reuse is not None:
                    if load is not None:
                        load.wait_all(target.compute_stream(self.device))
                    self.on_reuse([a.seq_id for a in adms], [layer.past() for layer in kv.layers])
                timer.stop("preload", mark)
                mark = timer.start()
                target.timer = timer
                out = self.model(
                    input_ids=prompt[:, start:].to(self.device),
                    **cache_kwargs(self.model, kv),
                    use_cache=True,
                    logits_to_keep=0 if sampling.output_logits else 1,
                )
                target.finish()
                target.timer = None
                timer.stop("forward", mark)
                logits = out.logits
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
            return logits, time.perf_counter() - t

        logits, seconds = await self._compute(prefill)
        if load is not None:
            settling = time.perf_counter()
            try:
                await load.settle()
            except TransferError as exc:
                raise _LoadFailed from exc
            timer_settle = time.perf_counter() - settling
        committing = time.perf_counter()
        self._sync_writes()
        for a in adms:
            cache.commit(a.seq_id)
        phases = {"admit": admitted - t0, **timer.totals(), "commit": time.perf_counter() - committing}
        if load is not None:
            phases["settle"] = timer_settle
        forwards = [((n - start) * len(rows), seconds, start, len(rows))]  # tokens, seconds, past, rows
        if computed is not None:  # the head's forward ran during the admission
            phases["hybrid_compute"], phases["hybrid_admit"] = computed.seconds, computed.admit_seconds
            forwards.insert(0, (computed.tokens, computed.seconds, 0, 1))
        for tokens_run, secs, past, batch in forwards:
            self._prefill_s += secs
            self._computed += tokens_run
            if self.on_prefill is not None:
                self.on_prefill(tokens_run, secs)
            if self.cost_model is not None:
                self.cost_model.observe_prefill(tokens_run, secs, past=past, rows=batch)
        self._reused += reused * len(rows)
        self._prompt_tokens += n * len(rows)
        self._requests += len(rows)

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
            chosen = choose(step_logits, sampling, [generators[j] for j in live])
            if step == 0:
                ttft = time.perf_counter() - t0
                inner = ("kv_write", "hybrid_compute", "hybrid_admit")  # spans within others
                phases["sample"] = max(0.0, ttft - sum(v for k, v in phases.items() if k not in inner))
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
            position = n + step
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
            feed = torch.tensor([[t] for t in chosen], dtype=torch.long)
            prompt_tables = [adms[j].page_table for j in live] if step == 0 else None

            def decode(
                feed: torch.Tensor = feed, position: int = position, prompt_tables: list[Any] | None = prompt_tables
            ) -> tuple[torch.Tensor, float]:
                t = time.perf_counter()
                with torch.inference_mode():
                    if prompt_tables is not None:  # decode appends to a past the layers hold (see .kv's rules)
                        for layer in kv.layers:
                            layer.materialize(prompt_tables, position)
                    target.prepare(position, 1, self.device, read_past=False)
                    out = self.model(
                        input_ids=feed.to(self.device), **cache_kwargs(self.model, kv), use_cache=True, logits_to_keep=1
                    )
                    target.finish()
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
                phases=dict(phases),
                tokens_computed_first=computed.tokens if computed is not None else a.tokens_computed_first,
            )
