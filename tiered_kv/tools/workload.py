"""A seeded multi-turn chat workload, deterministic KV content per prefix, and a verifying replay.

Primitives:

* :class:`ChatWorkload` -- iterate it for :class:`ChatTurn` s: shared system prompts, conversations whose
  later turns resend the whole history and come back after other conversations' traffic. The same seed
  gives the same turns on every machine.
* :func:`expected_tokens` -- the bytes a block slot must hold for tokens of a sequence: token ``j`` of a
  block is a pattern derived from ``block_key(parent, tokens[:j + 1])``, the key of the prefix that ends at
  that token. So the content depends on the whole prefix (as real KV does), a partial copy of the first
  ``n`` tokens is checkable, and any block in the wrong place or with stale bytes is caught.
* :func:`write_expected` / :func:`verify_expected` -- play the model: write the content of computed tokens
  into a sequence's GPU blocks; check the reused ones.
* :func:`replay` -- run a workload through a :class:`~tiered_kv.TieredKVCache`, verifying every reused
  token, and return a :class:`ReplayReport`.

Example::

    async with TieredKVCache(layout, gpu_blocks=256, host_blocks=1024, device="cpu") as cache:
        report = await replay(cache, ChatWorkload(seed=1, conversations=32))
        assert report.mismatched_tokens == 0
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..keys import ContentKey, KeyHasher
from ..layout import KVLayout
from ..pools import Tier

if TYPE_CHECKING:
    from ..blocks import Admission
    from ..cache import TieredKVCache

__all__ = [
    "ChatTurn",
    "ChatWorkload",
    "ReplayReport",
    "expected_tokens",
    "replay",
    "token_pattern",
    "verify_expected",
    "write_expected",
]


@dataclasses.dataclass(frozen=True, slots=True)
class ChatTurn:
    """One request of the workload.

    Attributes:
        index: position in the workload.
        conversation: conversation id; ``turn``: its turn number (0 first).
        system_prompt: which shared system prompt the conversation starts with.
        prompt: token ids sent (system prompt + every earlier user message and reply + this message).
        output: token ids the "model" replies with (appended during generation).
    """

    index: int
    conversation: int
    turn: int
    system_prompt: int
    prompt: np.ndarray
    output: np.ndarray


class ChatWorkload:
    """Seeded generator of multi-turn chat traffic.

    Args:
        seed: everything below is drawn from ``numpy.random.default_rng(seed)``.
        conversations: conversations in total.
        system_prompts: distinct shared system prompts (picked with a skew: prompt 0 is the most common).
        system_tokens: tokens per system prompt.
        turns: ``(min, max)`` turns per conversation.
        user_tokens: ``(min, max)`` tokens per user message.
        output_tokens: ``(min, max)`` tokens per reply.
        concurrency: conversations open at once; the next turn comes from a random open one, so a
            conversation returns after other traffic.
        vocab: token ids are drawn from ``[0, vocab)``.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        conversations: int = 64,
        system_prompts: int = 4,
        system_tokens: int = 512,
        turns: tuple[int, int] = (2, 6),
        user_tokens: tuple[int, int] = (16, 128),
        output_tokens: tuple[int, int] = (16, 128),
        concurrency: int = 8,
        vocab: int = 32000,
    ) -> None:
        for name, pair in (("turns", turns), ("user_tokens", user_tokens), ("output_tokens", output_tokens)):
            if not (len(pair) == 2 and 1 <= pair[0] <= pair[1]):
                raise ValueError(f"{name} must be (min, max) with 1 <= min <= max, got {pair!r}")
        for name, value in (("conversations", conversations), ("system_prompts", system_prompts),
                            ("system_tokens", system_tokens), ("concurrency", concurrency), ("vocab", vocab)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.seed = seed
        self.conversations = conversations
        self.system_prompts = system_prompts
        self.system_tokens = system_tokens
        self.turns = turns
        self.user_tokens = user_tokens
        self.output_tokens = output_tokens
        self.concurrency = concurrency
        self.vocab = vocab

    def __iter__(self) -> Iterator[ChatTurn]:
        rng = np.random.default_rng(self.seed)
        systems = [rng.integers(0, self.vocab, self.system_tokens, dtype=np.int64) for _ in range(self.system_prompts)]
        weights = 1.0 / np.arange(1, self.system_prompts + 1)
        weights /= weights.sum()
        # conversation id -> [system prompt id, history tokens, turns left, next turn number]
        open_convs: dict[int, list[Any]] = {}
        started = index = 0
        while started < self.conversations or open_convs:
            while started < self.conversations and len(open_convs) < self.concurrency:
                sp = int(rng.choice(self.system_prompts, p=weights))
                n_turns = int(rng.integers(self.turns[0], self.turns[1] + 1))
                open_convs[started] = [sp, systems[sp], n_turns, 0]
                started += 1
            conv = int(rng.choice(sorted(open_convs)))
            state = open_convs[conv]
            user = rng.integers(
                0, self.vocab, int(rng.integers(self.user_tokens[0], self.user_tokens[1] + 1)), dtype=np.int64
            )
            out = rng.integers(
                0, self.vocab, int(rng.integers(self.output_tokens[0], self.output_tokens[1] + 1)), dtype=np.int64
            )
            prompt = np.concatenate((state[1], user))
            yield ChatTurn(index, conv, state[3], state[0], prompt, out)
            index += 1
            state[1] = np.concatenate((prompt, out))
            state[2] -= 1
            state[3] += 1
            if state[2] == 0:
                del open_convs[conv]

    def __repr__(self) -> str:
        return (
            f"<ChatWorkload seed={self.seed} conversations={self.conversations} system_prompts={self.system_prompts}>"
        )


# ---------------------------------------------------------------------------------------- content


def token_pattern(key: ContentKey, layout: KVLayout) -> np.ndarray:
    """Bytes of one token slot (``layers * kv * heads * head_dim`` elements) derived from a prefix key."""
    nbytes = layout.num_layers * layout.kv_factor * layout.num_kv_heads * layout.head_dim * layout.itemsize
    reps = -(-nbytes // len(key))
    return np.frombuffer(key * reps, dtype=np.uint8, count=nbytes)


def expected_tokens(hasher: KeyHasher, tokens: np.ndarray, start: int, stop: int) -> torch.Tensor:
    """Content of token positions ``[start, stop)`` of a sequence (``stop - start <= tokens_per_block``, one block).

    Returns:
        A CPU tensor ``[layers, kv, heads, stop - start, head_dim]`` of the layout's dtype.
    """
    layout = hasher.layout
    tpb = hasher.tokens_per_block
    b = start // tpb
    assert (stop - 1) // tpb == b, "one block at a time"
    parent = hasher.chain(tokens[: b * tpb])[-1] if b else hasher.root
    base = b * tpb
    rows = [token_pattern(hasher.block_key(parent, tokens[base : j + 1]), layout) for j in range(start, stop)]
    raw = torch.from_numpy(np.stack(rows).copy())  # [n, bytes]
    shape = (stop - start, layout.num_layers, layout.kv_factor, layout.num_kv_heads, layout.head_dim)
    per_token = raw.view(layout.dtype).view(shape)
    return per_token.permute(1, 2, 3, 0, 4).contiguous()


def _spans(tpb: int, start: int, stop: int) -> Iterator[tuple[int, int]]:
    pos = start
    while pos < stop:
        end = min(stop, (pos // tpb + 1) * tpb)
        yield pos, end
        pos = end


def write_expected(cache: TieredKVCache, seq_id: int, start: int, stop: int | None = None) -> None:
    """Write the deterministic content of tokens ``[start, stop)`` into the sequence's GPU blocks (play the model)."""
    tokens = cache.blocks.sequence_tokens(seq_id)
    stop = len(tokens) if stop is None else stop
    table = cache.page_table(seq_id)
    pool = cache.engine.pool(Tier.GPU).tensor
    tpb = cache.layout.tokens_per_block
    for a, b in _spans(tpb, start, stop):
        content = expected_tokens(cache.hasher, tokens, a, b)
        pool[table[a // tpb], :, :, :, a % tpb : a % tpb + (b - a), :].copy_(content.to(pool.device))
    if pool.is_cuda:
        # later offloads of these blocks run on the copy streams: order them after these writes
        cache.engine.sync_with_compute(torch.cuda.current_stream(pool.device))


def verify_expected(cache: TieredKVCache, seq_id: int, start: int, stop: int) -> list[int]:
    """Token positions in ``[start, stop)`` whose GPU content is not what was written for their prefix."""
    tokens = cache.blocks.sequence_tokens(seq_id)
    table = cache.page_table(seq_id)
    pool = cache.engine.pool(Tier.GPU).tensor
    tpb = cache.layout.tokens_per_block
    bad: list[int] = []
    for a, b in _spans(tpb, start, stop):
        expected = expected_tokens(cache.hasher, tokens, a, b)
        actual = pool[table[a // tpb], :, :, :, a % tpb : a % tpb + (b - a), :].cpu()
        eq = actual.contiguous().view(torch.uint8) == expected.view(torch.uint8)
        ok = eq.reshape(-1, b - a, eq.shape[-1]).all(dim=2).all(dim=0)  # per token
        bad.extend(a + int(i) for i in torch.nonzero(~ok).flatten())
    return bad


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayReport:
    """What :func:`replay` saw.

    Attributes:
        turns: requests replayed.
        prompt_tokens: prompt tokens sent; ``reused_tokens``: of them, reused from the cache.
        hits: reused full blocks per tier they were found in.
        verified_tokens: reused tokens whose content was checked; ``mismatched_tokens``: wrong ones.
        add_seconds: wall time spent in ``add_sequences`` (lookup, onboarding, waiting for copies).
        generated_tokens: tokens appended as replies.
    """

    turns: int
    prompt_tokens: int
    reused_tokens: int
    hits: dict[str, int]
    verified_tokens: int
    mismatched_tokens: int
    add_seconds: float
    generated_tokens: int

    @property
    def hit_rate(self) -> float:
        """Reused tokens over prompt tokens."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


async def replay(
    cache: TieredKVCache,
    turns: Iterable[ChatTurn],
    *,
    verify: bool = True,
    write: bool = True,
    observe: Callable[[ChatTurn, Admission, float], None] | None = None,
) -> ReplayReport:
    """Replay turns one at a time: admit, check reused content, write computed content, append the reply, free.

    Args:
        cache: an open cache.
        turns: e.g. a :class:`ChatWorkload`.
        verify: compare every reused token's content with what was written for its prefix.
        write: write content for computed tokens (needed for ``verify`` to mean anything).
        observe: called after each turn with the turn, its admission and the seconds ``add_sequences`` took.

    Cancellation: the sequence in progress is freed and the cancellation propagates.
    """
    n = prompt = reused = verified = mismatched = generated = 0
    hits = {t.value: 0 for t in Tier}
    add_seconds = 0.0
    for turn in turns:
        t0 = time.perf_counter()
        [adm] = await cache.add_sequences([turn.prompt])
        took = time.perf_counter() - t0
        add_seconds += took
        try:
            if verify:
                bad = verify_expected(cache, adm.seq_id, 0, adm.tokens_reused)
                verified += adm.tokens_reused
                mismatched += len(bad)
            if write:
                write_expected(cache, adm.seq_id, adm.tokens_reused)
            cache.commit(adm.seq_id)
            if len(turn.output):
                await cache.append_tokens(adm.seq_id, turn.output)
                if write:
                    # the reply's KV except its last token (never fed back to the model)
                    write_expected(cache, adm.seq_id, len(turn.prompt), len(turn.prompt) + len(turn.output) - 1)
                cache.commit(adm.seq_id, len(turn.prompt) + len(turn.output) - 1)
                generated += len(turn.output)
        finally:
            cache.free(adm.seq_id)
        n += 1
        prompt += len(turn.prompt)
        reused += adm.tokens_reused
        for tier, count in adm.blocks_from.items():
            hits[tier] += count
        if observe is not None:
            observe(turn, adm, took)
    return ReplayReport(n, prompt, reused, hits, verified, mismatched, add_seconds, generated)
