# ruff: noqa: B023 -- the wrappers below are used within their own loop turn
"""Session r probe: the steps of one awaited 128-block partial copy, timed inside the engine (no profiler).

``partial_turn_probe.py`` found, on an H200, the 4-of-16 GPU->GPU copy's launch returning 26.6 us after the call,
``copy()`` returning at 65 us and the coroutine resuming at 84 us, against 55 us for a synchronized contiguous copy.
Here the engine's ``_launched`` (the bookkeeping after the one-call launch) and ``_watch``/``_poll`` (the await's
in-place poll) are replaced by copies of themselves with ``perf_counter`` stamps between their steps, and the
bench's turns of the 4-of-16 and 12-of-16 GPU->GPU rows run as in ``partial_turn_probe.py``. Prints the median
time of each stamp after the call. Run on a CUDA machine from notes/probes/: ``python partial_steps_probe.py``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch
from partial_turn_probe import one_row

from tiered_kv import KVLayout, TransferEngine
from tiered_kv import engine as engine_mod
from tiered_kv.device import expected_end
from tiered_kv.transfer import Transfer

STAMPS: dict[str, float] = {}
pc = time.perf_counter


def launched(self: Any, route: Any, event: Any, s_list: list[int], d_list: list[int], choice: Any) -> Transfer:
    """``TransferEngine._launched`` with stamps."""
    STAMPS["launched in"] = pc()
    src_t, dst_t, src_pool, dst_pool, _handler, _memory, direction, native = route
    count = len(s_list)
    nbytes = count * choice[2]
    native.launched += 1
    totals = choice[1]
    totals[0] += 1
    totals[1] += nbytes
    marker = engine_mod.Marker(native.stream)
    marker.event = event
    marker.job = engine_mod._LAUNCHED
    STAMPS["marker"] = pc()
    transfer = Transfer(marker, src_t, dst_t, count, nbytes)
    self._submitted += 1
    fences = self._fences
    STAMPS["transfer"] = pc()
    if fences._done:
        fences.release_done()
    STAMPS["release_done"] = pc()
    if count == 1:
        fences.fence(marker, src_pool.name, s_list, dst_pool.name, d_list)
    else:
        fences.register(marker, [(src_pool.name, s_list)], [(dst_pool.name, d_list)])
    STAMPS["register"] = pc()
    done = functools.partial(self._finished, self._inbox, marker, None)
    native.stream.watch_native(event, done, nbytes)
    STAMPS["watch_native"] = pc()
    self._inflight[marker] = (direction, transfer)
    STAMPS["launched out"] = pc()
    return transfer


def watch(self: Any, marker: Any, transfer: Transfer) -> None:
    """``TransferEngine._watch`` with stamps (the in-place branch)."""
    STAMPS["watch in"] = pc()
    _wake, due_ns = expected_end(0, transfer.nbytes, getattr(marker.lane, "rate", 0.0))
    span = max(due_ns, 0) / 1e9
    due = transfer.submitted_at + span
    now = pc()
    spin = self._await_spin
    if due <= now + spin:
        until = now + spin
        polls = 0
        STAMPS["first poll"] = pc()
        while True:
            polls += 1
            event = marker.event
            if event.query():
                STAMPS["query done"] = pc()
                self._poll(marker)
                STAMPS["poll done"] = pc()
                break
            if pc() >= until:
                break
        STAMPS["polls"] = polls
        self._in_place += 1
        if self._poller is not None:
            self._poller.finished += 1
        if marker.completed:
            self._loop.call_soon(self._settle)
        STAMPS["watch out"] = pc()
        return
    STAMPS["not in place"] = 1.0
    self._poller.watch(marker, due, span / 4)


async def main_async() -> dict[str, Any]:
    """Rows with the stamps."""
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    out: dict[str, Any] = {}
    async with TransferEngine(layout, gpu_blocks=256, host_blocks=128, device="cuda") as engine:
        side = torch.cuda.Stream()
        engine_mod.TransferEngine._launched = launched  # type: ignore[method-assign]
        engine_mod.TransferEngine._watch = watch  # type: ignore[method-assign]
        # the streams hold the engine's bound _watch: bind the stamped one
        for stream in engine._streams.values():
            if getattr(stream, "watch", None) is not None:
                stream.watch = engine._watch
        for n in (4, 12):
            per: dict[str, list[float]] = defaultdict(list)
            inner_copy = engine.copy

            def stamped_copy(*args: Any, **kwargs: Any) -> Transfer:
                STAMPS.clear()
                t0 = pc()
                STAMPS["t0"] = t0
                t = inner_copy(*args, **kwargs)
                STAMPS["copy returned"] = pc()
                return t

            engine.copy = stamped_copy  # type: ignore[method-assign]
            original_await = Transfer.__await__

            def stamped_await(self: Transfer) -> Any:
                result = yield from original_await(self)
                STAMPS["resumed"] = pc()
                if self.num_blocks > 1 and "t0" in STAMPS:
                    t0 = STAMPS["t0"]
                    for k, v in STAMPS.items():
                        per[k].append(v if k in ("polls", "not in place") else (v - t0) * 1e6)
                return result

            Transfer.__await__ = stamped_await  # type: ignore[method-assign]
            row = await one_row(engine, "stamped", n, "gpu->gpu", side)
            Transfer.__await__ = original_await  # type: ignore[method-assign]
            engine.copy = inner_copy  # type: ignore[method-assign]
            steps = {k: round(statistics.median(v), 1) for k, v in per.items()}
            steps["samples"] = len(per["t0"])
            print(json.dumps({"tokens": f"{n}/16", "row": row, "steps_us": steps}), flush=True)
            out[f"{n}/16"] = {"row": row, "steps_us": steps}
    return out


if __name__ == "__main__":
    got = asyncio.run(main_async())
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
    with open(os.path.join(out_dir, "steps.json"), "w") as f:
        json.dump(got, f, indent=1)
