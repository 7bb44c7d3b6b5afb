"""What a stress run keeps to explain a wrong token (:mod:`tiered_kv.tools.stress`).

Primitives:

* :class:`Trace` -- the log of every move and model write of a run; on a wrong token, where its bytes came from
  and the history of its block and slots (``StressConfig.trace``).
* :class:`Guards` -- a GPU pool inside a larger allocation whose blocks on each side hold a pattern: a byte written
  outside the pool fails the run (``StressConfig.guard_blocks``).
* :func:`block_truth` -- the bytes a block must hold, the oracle of :class:`~tiered_kv.tools.shadow.Shadow`.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable

import numpy as np
import torch

from ..blocks import Block, Move, Plan
from ..cache import TieredKVCache
from ..layout import KVLayout
from ..plan_batches import batch_moves
from ..transfer import Transfer
from .workload import token_pattern

__all__ = ["Guards", "Trace", "block_truth"]


class Trace:
    """The debug record of one run (``StressConfig.trace``): moves, writes, and the history behind a wrong token.

    On a wrong token it prints the history of its block and of every slot that block passed through. It wraps the
    cache's plan issue to log each move with the transfer that carries it; the model's writes are
    logged with the bytes they wrote, so the bytes found in a wrong token can be traced back to their writer.
    """

    def __init__(self, cache: TieredKVCache, t0: float) -> None:
        self.cache = cache
        self.t0 = t0
        self.log: list[tuple[float, str]] = []
        self.wrote: dict[bytes, str] = {}
        issue = cache._issue

        def traced(plan: Plan) -> list[Transfer]:
            _groups, placed = batch_moves(plan.moves)
            transfers = issue(plan)
            for m, g in zip(plan.moves, placed, strict=True):
                t = transfers[g]
                src = f" from#{m.source.id}" if m.source is not None else ""
                self.note(
                    f"move {m.kind} #{m.block.id}{src} {m.src_tier.value}[{m.src_slot}]->"
                    f"{m.dst_tier.value}[{m.dst_slot}] n={m.num_tokens} t={id(t):x}"
                )
                t.add_done_callback(functools.partial(self._done, t, m))
            return transfers

        cache._issue = traced  # type: ignore[method-assign]

    def note(self, what: str) -> None:
        """Log one event with the seconds since the run started."""
        self.log.append((time.perf_counter() - self.t0, what))

    def _done(self, t: Transfer, m: Move, *_: object) -> None:
        self.note(f"done t={id(t):x} #{m.block.id} {m.kind} {'FAILED' if t.exception() else 'ok'}")

    def wrote_tokens(self, seq_id: int, block_id: int, slot: int, first: int, content: torch.Tensor) -> None:
        """Log a model write of tokens ``first...`` into GPU ``slot``, and the bytes of each token it wrote."""
        self.note(f"write seq {seq_id} #{block_id} gpu[{slot}] tokens {first}..{first + content.shape[3] - 1}")
        for k in range(content.shape[3]):
            self.wrote[_token_bytes(content, k)] = f"seq {seq_id} #{block_id} pos {first + k} gpu[{slot}]"

    def dump(self, what: str, block_id: int, slot: int, actual: torch.Tensor, wrong: list[int], first: int) -> None:
        """Print the origin of each wrong token's bytes and the history of the block and its slots."""
        got = [self.wrote.get(_token_bytes(actual, p - first), "never written") for p in wrong]
        print(f"TRACE wrong {what} pos {wrong} block #{block_id} gpu[{slot}] holds: {got}", flush=True)
        tags = {f"#{block_id} ", f"gpu[{slot}]"}
        for _ts, line in self.log:
            if f"#{block_id} " in line:
                tags.update(re.findall(r"(?:gpu|host|file)\[\d+\]", line))
        for ts, line in [e for e in self.log if any(tag in e[1] for tag in tags)][-150:]:
            print(f"TRACE   {ts:.4f} {line}", flush=True)


class Guards:
    """A GPU pool of ``gpu_blocks`` with ``guard_blocks`` blocks of a fixed pattern on each side."""

    def __init__(self, layout: KVLayout, gpu_blocks: int, guard_blocks: int, device: str) -> None:
        g = guard_blocks
        self.whole = torch.empty((gpu_blocks + 2 * g, *layout.block_shape), dtype=layout.dtype, device=device)
        self.whole.view(torch.uint8).fill_(0x5A)
        self.pool = self.whole[g : g + gpu_blocks]
        self.guards = (self.whole[:g], self.whole[g + gpu_blocks :])
        self.broken = False

    def check(self, when: str, counts: dict[str, int], failures: list[str]) -> None:
        """Every guard byte must still hold the pattern (a write outside the pool's blocks fails the run)."""
        if self.broken:
            return
        for side, guard in zip(("before", "after"), self.guards, strict=True):
            raw = guard.reshape(guard.shape[0], -1).view(torch.uint8)
            changed = torch.nonzero((raw != 0x5A).any(dim=1)).flatten().tolist()
            if changed:
                self.broken = True
                counts["wrong"] += 1
                failures.append(f"after {when}: guard blocks {changed} {side} the GPU pool were written")


def block_truth(cache: TieredKVCache) -> Callable[[Block], np.ndarray]:
    """The oracle of a block for :class:`~tiered_kv.tools.shadow.Shadow`: the bytes the stress writes per token."""

    def truth(block: Block) -> np.ndarray:
        rows = [
            token_pattern(cache.hasher.block_key(block.parent_key, block.tokens[: j + 1]), cache.layout)
            for j in range(len(block.tokens))
        ]
        return np.stack(rows) if rows else np.zeros((0, cache.layout.bytes_per_block), np.uint8)

    return truth


def _token_bytes(block: torch.Tensor, k: int) -> bytes:
    """The bytes of token ``k`` of a ``[layers, kv, heads, tokens, dim]`` block (all its layers, K/V and heads)."""
    return bytes(block[:, :, :, k].contiguous().view(torch.uint8).numpy().tobytes())
