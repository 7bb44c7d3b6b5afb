"""RemoteTier.close() right after the last awaited copy returns, on asyncio's loop and on uvloop.

Regression: ``drain()`` looped ``while self._tasks: await asyncio.gather(*self._tasks)``. The awaiter of a
copy resumes before the finished task's done callback drops it from the set, and from Python 3.12 on
``gather`` of finished tasks completes without yielding to the loop: the loop never ran that callback and
``close()`` spun forever (the GPU machine's hang). A spinning loop cannot time itself out, so the copies and
the close run in a child process bounded by a wall-clock timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from remote_servers import mooncake_server, redis_server, server, store_url  # noqa: F401

from tiered_kv.remote.servers import LocalServer

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import asyncio, sys
import numpy as np, torch, uvloop
from tiered_kv import KVLayout, Tier, TransferEngine
from tiered_kv.remote import RemoteTier

async def main(url: str, device: str) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=8, dtype=torch.float16)
    async with TransferEngine(layout, gpu_blocks=8, host_blocks=8, device=device) as engine:
        engine.pool("gpu").tensor.normal_()
        for round_ in range(3):  # each close() comes right after the await of that tier's last copy
            keys = [np.random.default_rng().bytes(16) for _ in range(4)]
            writer = RemoteTier(engine, url, staging_blocks=4, route=False)
            assert await writer.connect()
            put = writer.put(Tier.GPU, range(4), keys)
            await put
            assert put.found == [True] * 4
            await writer.close()
            keeper = RemoteTier(engine, url, staging_blocks=4, route=False)  # (Mooncake: its segment holds them)
            assert await keeper.connect()
            await keeper.put(Tier.GPU, range(4, 8), keys)
            reader = RemoteTier(engine, url, staging_blocks=4, route=False)
            assert await reader.connect()
            get = reader.get(keys, Tier.HOST, range(4))
            await get
            assert get.found == [True] * 4
            await reader.close()
            await keeper.close()
            print("closed", round_, flush=True)

url, device = sys.argv[1], sys.argv[2]
asyncio.run(main(url, device))
uvloop.run(main(url, device))
print("ok", flush=True)
"""


def _run_child(url: str, device: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-c", CHILD, url, device], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )


def test_close_right_after_the_last_copy_returns(server: LocalServer, device: str) -> None:  # noqa: F811
    out = _run_child(store_url(server), device)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split().count("closed") == 6 and out.stdout.rstrip().endswith("ok"), out.stdout
