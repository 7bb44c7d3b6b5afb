"""Cost-aware reuse: bring a cached prefix back from a tier only where that beats recomputing it.

Primitives:

* :class:`CostModel` -- per tier, the cost per byte of bringing blocks to the GPU, fitted from the cache's own
  completed admissions (``observe_admission``: how long each took against the bytes it brought from each
  tier; the fit's intercept takes what every admission pays anyway, such as evictions) or given as a
  bandwidth; the model's forward time (:meth:`CostModel.prefill_seconds`: per forward, per token and per
  query-key pair attended, so a long prompt's attention and a short forward after a long past are priced), fitted
  from the generator's own forwards (``observe_prefill``) or given as a rate. ``CachedGenerator(...,
  cost_model=...)`` feeds both.
  :meth:`CostModel.attach` installs it as the block manager's ``reuse_limit``: at every admission, for the
  request's matched blocks (in prefix order, each in its tier) it picks the number ``k`` of leading blocks
  that minimises ``onboard(blocks[:k]) + prefill(tokens not reused)``, counting the tokens left to compute;
  the other matched blocks stay where they are and their tokens are recomputed.
* :meth:`CostModel.split` -- hybrid prefill, for a match whose first block is in the file tier: the number ``c`` of
  leading blocks the model computes while the rest of the match is loaded
  (:attr:`~tiered_kv.blocks.Request.compute_blocks`), the one that minimises
  ``max(prefill(c blocks), onboard(blocks[c:])) + prefill(the tokens after the match)``; ``c = 0`` is loading
  everything (what an admission does without it), ``c`` = every matched block is recomputing the whole prompt in
  one forward, chosen when loading loses at every split.
  A match whose first block is on the GPU or in host memory is not split (0). ``CachedGenerator`` asks it for
  every single-prompt request.
* :class:`ReuseStatistics` -- admissions decided, those that skipped blocks, blocks skipped per tier, and the
  estimated seconds the decisions saved against reusing every matched block and against recomputing all; the
  hybrid splits decided.

So on a slow disk a short prefix in the file tier is recomputed while a long one (or a large model's) is
still read back; while a tier has no measurement yet, or nothing is known of the model's speed, everything
matched is reused (the first transfers measure the tier), and :meth:`CostModel.split` computes nothing.

``limit`` (attached) prices loading the match's leading blocks *before* recomputing the rest; ``split`` prices
computing the leading blocks *while* loading the rest. An admission applies the attached limit first and the
split to what it leaves: a model meant for hybrid prefill is best left unattached (the generator's own is).

Example::

    cost = CostModel(cache).attach()
    generator = CachedGenerator(model, cache, cost_model=cost)
    ...
    print(cost.statistics().saved_vs_reuse_all_s)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from .pools import Tier

if TYPE_CHECKING:
    from .blocks import Match
    from .cache import TieredKVCache

__all__ = ["CostModel", "ReuseStatistics"]


@dataclasses.dataclass(frozen=True, slots=True)
class ReuseStatistics:
    """What a :class:`CostModel` decided.

    Attributes:
        decisions: admissions with matched blocks outside the GPU tier that the model could price.
        skipped_admissions: those where some matched blocks were not reused (recomputed instead).
        skipped_blocks: matched blocks left unused, per tier.
        saved_vs_reuse_all_s: estimated seconds saved against reusing every matched block.
        saved_vs_recompute_s: estimated seconds saved against recomputing every prompt token.
        bandwidth: bytes per second bringing blocks to the GPU, per tier (fitted or given; absent: unknown).
        prefill_s_per_token: the model's marginal prefill time per token (0: unknown).
        prefill_overhead_s: the fixed seconds of one prompt forward (the prefill fit's intercept; 0: unknown).
        hybrid_decisions: matches led by a file-tier block that :meth:`CostModel.split` priced (rates known).
        hybrid_splits: of them, split (some leading blocks computed, the rest loaded).
        hybrid_recomputed: of them, computed whole (loading lost at every split).
        hybrid_blocks_computed: leading matched blocks the splits computed instead of loading.
        hybrid_saved_s: estimated seconds the splits saved against loading the whole match.
    """

    decisions: int
    skipped_admissions: int
    skipped_blocks: dict[str, int]
    saved_vs_reuse_all_s: float
    saved_vs_recompute_s: float
    bandwidth: dict[str, float]
    prefill_s_per_token: float
    prefill_overhead_s: float = 0.0
    hybrid_decisions: int = 0
    hybrid_splits: int = 0
    hybrid_recomputed: int = 0
    hybrid_blocks_computed: int = 0
    hybrid_saved_s: float = 0.0


class CostModel:
    """Prices reuse per tier against recomputing; the block manager's ``reuse_limit``.

    Args:
        cache: the cache whose transfers are measured (and whose block manager :meth:`attach` hooks).
        prefill_tokens_per_s: the model's prefill rate, if known; otherwise fitted from :meth:`observe_prefill`.
        bandwidth: bytes per second per tier (``"host"``, ``"file"``) to use instead of measurements.
        window: prefill observations kept for the fit.
        margin: leave matched blocks unused only when reusing all of them is estimated to take more than
            ``margin`` times the best choice (measurements are noisy; a wrong skip costs recomputation).

    Raises:
        ValueError: a rate or bandwidth that is not a positive number, an unknown tier.
    """

    def __init__(
        self,
        cache: TieredKVCache,
        *,
        prefill_tokens_per_s: float | None = None,
        bandwidth: Mapping[str, float] | None = None,
        window: int = 64,
        margin: float = 1.5,
    ) -> None:
        if prefill_tokens_per_s is not None and not prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be a positive number, got {prefill_tokens_per_s!r}")
        given: dict[str, float] = {}
        for tier, bw in (bandwidth or {}).items():
            name = Tier.coerce(tier).value
            if name == "gpu" or not isinstance(bw, (int, float)) or not bw > 0:
                raise ValueError(f"bandwidth must map 'host'/'file' to positive bytes per second, got {tier!r}: {bw!r}")
            given[name] = float(bw)
        if not isinstance(margin, (int, float)) or not margin >= 1:
            raise ValueError(f"margin must be a number >= 1, got {margin!r}")
        self.margin = float(margin)
        self.cache = cache
        self._given_rate = prefill_tokens_per_s
        self._given_bw = given
        self._observations: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=window)
        self._prefill: tuple[float, float, float] | None = None  # (a, b, k) of prefill_seconds (refitted lazily)
        self._admissions: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=4 * window)
        self._fit: dict[str, float] | None = None  # tier -> seconds per byte (refitted lazily)
        self._decisions = self._skipped_admissions = 0
        self._skipped: dict[str, int] = {}
        self._saved_all = self._saved_none = 0.0
        self._hybrid = {"decisions": 0, "splits": 0, "recomputed": 0, "blocks": 0}
        self._hybrid_saved = 0.0

    def attach(self) -> CostModel:
        """Install as the cache's ``reuse_limit`` (every admission from now on is priced). Returns ``self``."""
        self.cache.blocks.reuse_limit = self.limit
        return self

    def detach(self) -> None:
        """Stop pricing admissions (everything matched is reused again)."""
        if self.cache.blocks.reuse_limit == self.limit:
            self.cache.blocks.reuse_limit = None

    # ------------------------------------------------------------------------------------ inputs

    def observe_prefill(self, tokens: int, seconds: float, past: int = 0, rows: int = 1) -> None:
        """One prompt forward took ``seconds``: ``tokens`` tokens in all, ``rows`` rows each after ``past`` tokens.

        ``CachedGenerator`` feeds it (``on_prefill`` sees ``(tokens, seconds)`` only, which counts as ``past=0``).
        """
        if tokens > 0 and seconds > 0 and past >= 0 and rows >= 1:
            self._observations.append((float(tokens), _pairs(tokens / rows, past) * rows, float(seconds)))
            self._prefill = None

    def observe_admission(self, bytes_from: Mapping[str, int], seconds: float) -> None:
        """An admission brought ``bytes_from[tier]`` bytes from host/file to the GPU and took ``seconds``."""
        if seconds > 0:
            self._admissions.append(
                (float(bytes_from.get("host", 0)), float(bytes_from.get("file", 0)), float(seconds))
            )
            self._fit = None

    def _per_byte(self) -> dict[str, float]:
        """Seconds per byte per tier: least squares of ``seconds = a + b_host * host + b_file * file``."""
        if self._fit is not None:
            return self._fit
        fit: dict[str, float] = {}
        rows = list(self._admissions)
        if len(rows) >= 8:
            cols = [i for i in (0, 1) if len({r[i] for r in rows}) > 1]
            if cols:
                x = np.array([[1.0, *(r[i] for i in cols)] for r in rows])
                y = np.array([r[2] for r in rows])
                coef = np.linalg.lstsq(x, y, rcond=None)[0]
                for i, b in zip(cols, coef[1:], strict=True):
                    fit[("host", "file")[i]] = max(0.0, float(b))
        self._fit = fit
        return fit

    def prefill_seconds(self, tokens: int, past: int = 0) -> float | None:
        """Seconds of one forward of ``tokens`` tokens after ``past`` tokens of KV (``None`` while unknown).

        ``a + b * tokens + k * pairs``: ``a`` per forward (launches, the host's share), ``b`` per token (the weights),
        ``k`` per query-key pair attended (``pairs`` = ``tokens * past + tokens**2 / 2``, causal). The terms come
        from the recent forwards by least squares, each coefficient at least 0 (the best fit among the terms that
        stay non-negative); with one forward size seen, its average rate; with a given rate, ``tokens / rate``.
        """
        fit = self._prefill_fit()
        if fit is None:
            return None
        a, b, k = fit
        return a + b * tokens + k * _pairs(tokens, past)

    def prefill_seconds_per_token(self) -> float | None:
        """Marginal prefill seconds per token, ``b`` of :meth:`prefill_seconds` (``None`` while unknown)."""
        fit = self._prefill_fit()
        return fit[1] if fit is not None else None

    def prefill_overhead_seconds(self) -> float:
        """The fixed seconds of one prompt forward (``a`` of :meth:`prefill_seconds`; 0 when unknown or given)."""
        fit = self._prefill_fit()
        return fit[0] if fit is not None else 0.0

    def _prefill_fit(self) -> tuple[float, float, float] | None:
        """``(a, b, k)`` of :meth:`prefill_seconds` (refitted when a forward was observed)."""
        if self._given_rate is not None:
            return 0.0, 1.0 / self._given_rate, 0.0
        if self._prefill is not None:
            return self._prefill
        obs = list(self._observations)
        if not obs:
            return None
        x = np.array([[1.0, q, pairs] for q, pairs, _ in obs])
        y = np.array([s for _, _, s in obs])
        keep = np.ones(len(obs), dtype=bool)
        fit = _nonnegative_fit(x, y)
        # Relative errors (a forward's noise scales with it), and a forward far off the rest is not a rate: a
        # process's first forward (kernels loaded and tuned: ~1 s for 64 tokens) or the first at a new length. The
        # worst one is left out while it is off by more than half and by 4 robust deviations of the others, at
        # most a quarter of them in all.
        for _ in range(len(obs) // 4):
            if fit is None:
                break
            off = np.abs(x @ np.array(fit) - y) / y
            worst = int(np.argmax(np.where(keep, off, -1.0)))
            others = off[keep]
            others = np.delete(others, int(np.argmax(others)))
            if off[worst] <= max(0.5, 4 * 1.4826 * float(np.median(others))):
                break
            keep[worst] = False
            fit = _nonnegative_fit(x[keep], y[keep])
        self._prefill = fit if fit is not None else (0.0, float(y.sum() / x[:, 1].sum()), 0.0)
        return self._prefill

    def bandwidth(self, tier: Tier | str) -> float | None:
        """Bytes per second of bringing blocks of ``tier`` to the GPU (given, or fitted; ``None``: unknown)."""
        name = Tier.coerce(tier).value
        if name in self._given_bw:
            return self._given_bw[name]
        slope = self._per_byte().get(name)
        return 1.0 / slope if slope else None

    def _onboard_cost(self, tier: str) -> Callable[[int], float]:
        """``nbytes -> seconds`` to bring that many bytes of ``tier`` to the GPU in one admission.

        Given a bandwidth: ``nbytes / bandwidth``. Otherwise the per-byte slope fitted from the admissions seen
        (a copy's own duration is not used: it includes waiting for the evictions ahead of it, which an
        admission pays whether it reuses or recomputes). Unknown yet: free (the first admissions measure it).
        """
        if tier in self._given_bw:
            bw = self._given_bw[tier]
            return lambda nbytes: nbytes / bw
        slope = self._per_byte().get(tier, 0.0)
        return lambda nbytes: nbytes * slope

    # ------------------------------------------------------------------------------------ the decision

    def limit(self, match: Match, num_tokens: int) -> int:
        """How many leading blocks of ``match`` to reuse for a prompt of ``num_tokens`` tokens (see the module)."""
        blocks = match.blocks
        if not blocks or self._prefill_fit() is None:
            return len(blocks)
        tiers = [b.tier.value for b in blocks]  # type: ignore[union-attr]
        slow = {t for t in tiers if t != "gpu"}
        if not slow:
            return len(blocks)  # all on the GPU: nothing to decide
        bytes_per_block = self.cache.layout.bytes_per_block
        tpb = self.cache.layout.tokens_per_block
        cost = {t: self._onboard_cost(t) for t in slow}
        moved = dict.fromkeys(slow, 0)
        recompute_all = self._forward(num_tokens, 0)
        best_k, best_t, t = 0, recompute_all, recompute_all
        for i, tier in enumerate(tiers):
            if tier != "gpu":
                moved[tier] += bytes_per_block
            t = sum(cost[x](moved[x]) for x in slow) + self._forward(num_tokens - (i + 1) * tpb, (i + 1) * tpb)
            if t <= best_t:  # ties reuse
                best_k, best_t = i + 1, t
        reuse_all = t
        if reuse_all <= self.margin * best_t:
            best_k, best_t = len(blocks), reuse_all  # not clearly better: reuse everything matched
        self._decisions += 1
        self._saved_all += reuse_all - best_t
        self._saved_none += recompute_all - best_t
        if best_k < len(blocks):
            self._skipped_admissions += 1
            for tier in tiers[best_k:]:
                self._skipped[tier] = self._skipped.get(tier, 0) + 1
        return best_k

    def split(self, match: Match, num_tokens: int) -> int:
        """How many leading blocks of ``match`` to compute while the rest is loaded (hybrid prefill; see the module).

        Args:
            match: what the cache holds of the prompt's prefix (``BlockManager.match``; claims nothing).
            num_tokens: the prompt's tokens.

        Returns:
            0 (load the whole match, as an admission does) unless the match's first block is in the file tier and the
            model's prefill rate is known; else the ``c`` in ``0 .. len(match.blocks)`` that minimises the
            estimated time to the prompt's last forward (ties: the smaller ``c``). A tier whose bandwidth is unknown
            loads for free, so ``c`` is 0 until the tier has been measured.
        """
        blocks = match.blocks
        if not blocks or blocks[0].tier is not Tier.FILE:
            return 0
        if self._prefill_fit() is None:
            return 0
        tpb = self.cache.layout.tokens_per_block
        bytes_per_block = self.cache.layout.bytes_per_block
        tiers = [b.tier.value for b in blocks]  # type: ignore[union-attr]
        cost = {t: self._onboard_cost(t) for t in set(tiers) if t != "gpu"}
        m = len(blocks)
        load = [0.0] * (m + 1)  # load[c]: seconds to bring blocks[c:] to the GPU in one admission
        moved = dict.fromkeys(cost, 0)
        for c in range(m - 1, -1, -1):
            if tiers[c] != "gpu":
                moved[tiers[c]] += bytes_per_block
            load[c] = sum(cost[t](moved[t]) for t in cost)
        after = self._forward(num_tokens - m * tpb, m * tpb)  # the forward over the tokens after the match

        def ttft(c: int) -> float:
            if c == m:
                return self._forward(num_tokens, 0)  # one forward over the whole prompt
            computed = self._forward(c * tpb, 0) if c else 0.0
            return max(computed, load[c]) + after

        best = min(range(m + 1), key=lambda c: (ttft(c), c))
        self._hybrid["decisions"] += 1
        if 0 < best < m:
            self._hybrid["splits"] += 1
        elif best == m:
            self._hybrid["recomputed"] += 1
        self._hybrid["blocks"] += best
        self._hybrid_saved += ttft(0) - ttft(best)
        return best

    def _forward(self, tokens: int, past: int) -> float:
        """:meth:`prefill_seconds` of a forward that may be empty (0 tokens: no forward at all)."""
        if tokens <= 0:
            return 0.0
        seconds = self.prefill_seconds(tokens, past)
        assert seconds is not None  # callers check that the prefill is known
        return seconds

    def statistics(self) -> ReuseStatistics:
        """A snapshot of the decisions and the current estimates."""
        bw = {t: v for t in ("host", "file") if (v := self.bandwidth(t)) is not None}
        return ReuseStatistics(
            decisions=self._decisions,
            skipped_admissions=self._skipped_admissions,
            skipped_blocks=dict(self._skipped),
            saved_vs_reuse_all_s=self._saved_all,
            saved_vs_recompute_s=self._saved_none,
            bandwidth=bw,
            prefill_s_per_token=self.prefill_seconds_per_token() or 0.0,
            prefill_overhead_s=self.prefill_overhead_seconds(),
            hybrid_decisions=self._hybrid["decisions"],
            hybrid_splits=self._hybrid["splits"],
            hybrid_recomputed=self._hybrid["recomputed"],
            hybrid_blocks_computed=self._hybrid["blocks"],
            hybrid_saved_s=self._hybrid_saved,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<CostModel decisions={s.decisions} skipped={s.skipped_blocks} saved={s.saved_vs_reuse_all_s:.3f}s>"


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float] | None:
    """``(a, b, k)``: the fit of ``y`` on columns ``x = [1, tokens, pairs]`` least in relative squared error.

    Of the subsets of terms whose coefficients are all non-negative, the one with the smallest error (``None``: none).
    """
    best: tuple[float, tuple[float, float, float]] | None = None
    xw, yw = x / y[:, None], np.ones_like(y)  # rows scaled by 1/y: the residuals are relative
    for terms in ((0, 1, 2), (0, 1), (1, 2), (0, 2), (1,), (2,)):  # b or k: a forward's time grows with it
        cols = list(terms)
        if np.linalg.matrix_rank(xw[:, cols]) < len(cols):
            continue
        coef = np.linalg.lstsq(xw[:, cols], yw, rcond=None)[0]
        if (coef < 0).any():
            continue
        full = [0.0, 0.0, 0.0]
        for i, c in zip(cols, coef, strict=True):
            full[i] = float(c)
        residual = float(((xw @ np.array(full) - yw) ** 2).sum())
        if best is None or residual < best[0] * (1 - 1e-9):
            best = (residual, (full[0], full[1], full[2]))
    return best[1] if best is not None else None


def _pairs(tokens: float, past: float) -> float:
    """Query-key pairs a causal forward of ``tokens`` tokens after ``past`` tokens of KV attends.

    ``tokens**2 / 2`` among themselves, ``tokens * past`` to the past.
    """
    return tokens * past + tokens * tokens / 2
