"""Offload a GPU pool to NVMe and bring it back, verified, with GB/s per stage.

Stages (each a few batched ``engine.copy`` calls, progress shown per chunk):

1. GPU -> host (offload), 2. host -> file (spill), 3. host pool wiped, file -> host (fill, every block's
header, checksum and layout fingerprint verified), 4. GPU pool wiped, host -> GPU (onboard), then every
byte compared with what was there at the start; finally 5. GPU -> file and 6. file -> GPU directly
(GPUDirect Storage where cuFile works, else pipelined through pinned staging buffers).

    python examples/offload_to_nvme.py --dir /mnt/nvme/kv --blocks 512 --device auto

On a machine without a GPU the emulated device stands in for it (figures are then CPU memcpy + disk).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import torch

from tiered_kv import KVLayout, Tier, TransferEngine
from tiered_kv.testing import fill_random
from tiered_kv.tools.bench.common import print_table
from tiered_kv.tools.progress import Progress


async def run(directory: str, blocks: int, device: str, chunk: int, quiet: bool = False) -> list[dict[str, object]]:
    # 32 layers x K/V x 8 heads x 16 tokens x 128 dims, fp16: 2 MiB per block (an 8B-class model)
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.float16)
    rows: list[dict[str, object]] = []
    async with TransferEngine(layout, gpu_blocks=blocks, host_blocks=blocks, file_dir=directory, file_blocks=2 * blocks,
                              device=device) as engine:
        gpu = engine.pool(Tier.GPU).tensor
        fill_random(gpu, torch.Generator().manual_seed(0))
        original = gpu.detach().cpu().clone()
        keys = [f"block-{i}" for i in range(blocks)]

        async def stage(name: str, src: Tier, dst: Tier, dst_offset: int = 0, with_keys: bool = False) -> None:
            t0 = time.perf_counter()
            with Progress(name, "blocks", blocks, disable=quiet) as bar:
                pending = []
                for start in range(0, blocks, chunk):
                    idx = list(range(start, min(blocks, start + chunk)))
                    src_idx = [i + (dst_offset if src is Tier.FILE else 0) for i in idx]
                    dst_idx = [i + (dst_offset if dst is Tier.FILE else 0) for i in idx]
                    t = engine.copy(src, src_idx, dst, dst_idx, keys=[keys[i] for i in idx] if with_keys else None)
                    t.add_done_callback(lambda tr: bar.update(tr.num_blocks))
                    pending.append(t)
                await asyncio.gather(*pending)
            seconds = time.perf_counter() - t0
            nbytes = blocks * layout.bytes_per_block
            rows.append({"stage": name, "GiB": nbytes / 2**30, "seconds": seconds, "GB/s": nbytes / seconds / 1e9})

        await stage("gpu->host (offload)", Tier.GPU, Tier.HOST)
        await stage("host->file (spill)", Tier.HOST, Tier.FILE, with_keys=True)
        engine.pool(Tier.HOST).tensor.zero_()
        await stage("file->host (fill, verified)", Tier.FILE, Tier.HOST, with_keys=True)
        gpu.zero_()
        await stage("host->gpu (onboard)", Tier.HOST, Tier.GPU)
        if not torch.equal(gpu.cpu().view(torch.uint8), original.view(torch.uint8)):
            raise SystemExit("error: blocks came back different after GPU -> host -> file -> host -> GPU")
        await stage("gpu->file (direct)", Tier.GPU, Tier.FILE, dst_offset=blocks, with_keys=True)
        gpu.zero_()
        await stage("file->gpu (direct, verified)", Tier.FILE, Tier.GPU, dst_offset=blocks, with_keys=True)
        if not torch.equal(gpu.cpu().view(torch.uint8), original.view(torch.uint8)):
            raise SystemExit("error: blocks came back different after GPU -> file -> GPU")
        for key in keys[:3]:
            assert engine.file_tier.lookup(key) is not None
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="directory for the slab file (default: a temporary directory)")
    parser.add_argument("--blocks", type=int, default=256, help="2 MiB blocks to move (default: %(default)s)")
    parser.add_argument("--chunk", type=int, default=32, help="blocks per engine.copy call (default: %(default)s)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tiered-kv-nvme-", dir=args.dir) as tmp:
        rows = asyncio.run(run(tmp, args.blocks, args.device, args.chunk, args.quiet))
    print_table(rows, f"\n{args.blocks} blocks of 2 MiB, every byte verified")


if __name__ == "__main__":
    main()
