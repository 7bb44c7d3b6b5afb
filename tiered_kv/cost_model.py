"""Cost-aware reuse: bring a cached prefix back from a tier only where that beats recomputing it.

Primitives:

* :class:`CostModel` -- per tier, the bandwidth of bringing blocks to the GPU, measured from the cache's own
  completed transfers (``engine.statistics()``: bytes and seconds per direction) or given; the model's
  prefill time per token, fitted from the generator's own prefill timings (``observe_prefill``) or given.
  :meth:`CostModel.attach` installs it as the block manager's ``reuse_limit``: at every admission, for the
  request's matched blocks (in prefix order, each in its tier) it picks the number ``k`` of leading blocks
  that minimises ``onboard(blocks[:k]) + prefill(tokens not reused)``, counting the tokens left to compute;
  the other matched blocks stay where they are and their tokens are recomputed.
* :class:`ReuseStatistics` -- admissions decided, those that skipped blocks, blocks skipped per tier, and the
  estimated seconds the decisions saved against reusing every matched block and against recomputing all.

So on a slow disk a short prefix in the file tier is recomputed while a long one (or a large model's) is
still read back; while a tier has no measurement yet, or nothing is known of the model's speed, everything
matched is reused (the first transfers measure the tier).

Example::

    cost = CostModel(cache).attach()
    generator = CachedGenerator(model, cache, on_prefill=cost.observe_prefill)
    ...
    print(cost.statistics().saved_vs_reuse_all_s)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

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
        bandwidth: bytes per second bringing blocks to the GPU, per tier (measured or given; absent: unknown).
        prefill_s_per_token: the model's marginal prefill time per token (0: unknown).
    """

    decisions: int
    skipped_admissions: int
    skipped_blocks: dict[str, int]
    saved_vs_reuse_all_s: float
    saved_vs_recompute_s: float
    bandwidth: dict[str, float]
    prefill_s_per_token: float


class CostModel:
    """Prices reuse per tier against recomputing; the block manager's ``reuse_limit``.

    Args:
        cache: the cache whose transfers are measured (and whose block manager :meth:`attach` hooks).
        prefill_tokens_per_s: the model's prefill rate, if known; otherwise fitted from :meth:`observe_prefill`.
        bandwidth: bytes per second per tier (``"host"``, ``"file"``) to use instead of measurements.
        window: prefill observations kept for the fit.

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
    ) -> None:
        if prefill_tokens_per_s is not None and not prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be a positive number, got {prefill_tokens_per_s!r}")
        given: dict[str, float] = {}
        for tier, bw in (bandwidth or {}).items():
            name = Tier.coerce(tier).value
            if name == "gpu" or not isinstance(bw, (int, float)) or not bw > 0:
                raise ValueError(f"bandwidth must map 'host'/'file' to positive bytes per second, got {tier!r}: {bw!r}")
            given[name] = float(bw)
        self.cache = cache
        self._given_rate = prefill_tokens_per_s
        self._given_bw = given
        self._observations: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self._decisions = self._skipped_admissions = 0
        self._skipped: dict[str, int] = {}
        self._saved_all = self._saved_none = 0.0

    def attach(self) -> CostModel:
        """Install as the cache's ``reuse_limit`` (every admission from now on is priced). Returns ``self``."""
        self.cache.blocks.reuse_limit = self.limit
        return self

    def detach(self) -> None:
        """Stop pricing admissions (everything matched is reused again)."""
        if self.cache.blocks.reuse_limit == self.limit:
            self.cache.blocks.reuse_limit = None

    # ------------------------------------------------------------------------------------ inputs

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One prompt forward of ``tokens`` tokens took ``seconds`` (``CachedGenerator(on_prefill=...)``)."""
        if tokens > 0 and seconds > 0:
            self._observations.append((int(tokens), float(seconds)))

    def prefill_seconds_per_token(self) -> float | None:
        """Marginal prefill seconds per token (``None`` while unknown).

        Given, else the slope of ``seconds = a + b * tokens`` over the recent prefills (the fixed cost ``a``
        is paid whatever is reused), else the average rate when one prompt size was seen.
        """
        if self._given_rate is not None:
            return 1.0 / self._given_rate
        obs = self._observations
        if not obs:
            return None
        n = len(obs)
        mean_x = sum(t for t, _ in obs) / n
        mean_y = sum(s for _, s in obs) / n
        var = sum((t - mean_x) ** 2 for t, _ in obs)
        if var > 0:
            slope = sum((t - mean_x) * (s - mean_y) for t, s in obs) / var
            if slope > 0:
                return slope
        return sum(s for _, s in obs) / sum(t for t, _ in obs)  # one size seen: the average rate

    def bandwidth(self, tier: Tier | str) -> float | None:
        """Bytes per second of bringing blocks of ``tier`` to the GPU (given, measured, or ``None``)."""
        name = Tier.coerce(tier).value
        if name in self._given_bw:
            return self._given_bw[name]
        stats = self.cache.engine.statistics()
        direction = f"{name}->gpu"
        nbytes = stats.bytes_by_direction.get(direction, 0)
        seconds = stats.seconds_by_direction.get(direction, 0.0)
        return nbytes / seconds if nbytes and seconds > 0 else None

    # ------------------------------------------------------------------------------------ the decision

    def limit(self, match: Match, num_tokens: int) -> int:
        """How many leading blocks of ``match`` to reuse for a prompt of ``num_tokens`` tokens (see the module)."""
        blocks = match.blocks
        per_token = self.prefill_seconds_per_token()
        if not blocks or per_token is None:
            return len(blocks)
        bytes_per_block = self.cache.layout.bytes_per_block
        tpb = self.cache.layout.tokens_per_block
        rates: dict[str, float | None] = {}
        costs: list[float] = []
        for b in blocks:
            tier = b.tier.value  # type: ignore[union-attr]
            if tier == "gpu":
                costs.append(0.0)
                continue
            if tier not in rates:
                rates[tier] = self.bandwidth(tier)
            bw = rates[tier]
            costs.append(0.0 if bw is None else bytes_per_block / bw)  # unmeasured: optimistic (measure it)
        if not rates:
            return len(blocks)  # all on the GPU: nothing to decide
        recompute_all = num_tokens * per_token
        best_k, best_t = 0, recompute_all
        onboard = 0.0
        for i, c in enumerate(costs):
            onboard += c
            t = onboard + (num_tokens - (i + 1) * tpb) * per_token
            if t <= best_t:  # ties reuse
                best_k, best_t = i + 1, t
        reuse_all = onboard + (num_tokens - len(blocks) * tpb) * per_token
        self._decisions += 1
        self._saved_all += reuse_all - best_t
        self._saved_none += recompute_all - best_t
        if best_k < len(blocks):
            self._skipped_admissions += 1
            for b in blocks[best_k:]:
                tier = b.tier.value  # type: ignore[union-attr]
                self._skipped[tier] = self._skipped.get(tier, 0) + 1
        return best_k

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
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<CostModel decisions={s.decisions} skipped={s.skipped_blocks} saved={s.saved_vs_reuse_all_s:.3f}s>"
