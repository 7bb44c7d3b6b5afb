"""Session j probe: cold reads of 1 MiB file slots through kvikio's compat mode against raw ``preadv``.

Every variant reads the same 1024 slots (4 KiB header + 1 MiB payload each) on 4 threads, with the file's
page cache dropped first (``posix_fadvise(DONTNEED)``), so no variant reads another's cached pages:

* ``raw preadv 2 iov``: ``os.preadv`` of [header, payload] per slot on O_DIRECT (what the posix backend does);
* ``gds 2 calls``: the gds backend as the file tier calls it (header and payload, two kvikio preads per slot);
* ``gds 1 call``: the gds backend with one contiguous slot buffer (one kvikio pread per slot);
* the two gds variants again with kvikio's opportunistic O_DIRECT reads on (``auto_direct_io_read``).

Run on a CUDA machine: ``python notes/probes/kvikio_read_probe.py [--dir D] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np
from tiered_kv.backends.gds import GdsBackend
from tiered_kv.backends.posix import aligned_empty

HDR = 4096
MiB = 1 << 20


def drop_cache(path: str) -> None:
    """Drop the file's clean pages from the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn: Any, n: int, nbytes: int) -> float:
    """GB/s of ``fn()``, which moves ``n`` slots of ``nbytes``."""
    t0 = time.perf_counter()
    fn()
    return n * nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    """Write the file once, then time each variant ``--rounds`` times, cold, in turn."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.environ.get("TIERED_KV_BENCH_DIR"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--json", default=None)
    ap.add_argument("--kvikio-threads", type=int, default=0, help="kvikio's pool size (0: what the backend sets)")
    args = ap.parse_args()
    n, payload = args.slots, MiB
    slot = HDR + payload
    directory = args.dir or tempfile.mkdtemp(prefix="tkv-kv-")
    path = os.path.join(directory, "slots.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, slot * n)
    src = aligned_empty(slot * n).numpy()
    src[:] = np.random.default_rng(0).integers(0, 255, src.size, dtype=np.uint8)
    ex = concurrent.futures.ThreadPoolExecutor(4)
    list(ex.map(lambda i: os.pwritev(fd, [src[i * slot : (i + 1) * slot].data], i * slot), range(n)))
    hdrs = aligned_empty(HDR * n).numpy().reshape(n, HDR)
    pays = aligned_empty(payload * n).numpy().reshape(n, payload)
    slots = aligned_empty(slot * n).numpy().reshape(n, slot)

    def raw() -> None:
        list(ex.map(lambda i: os.preadv(fd, [hdrs[i].data, pays[i].data], i * slot), range(n)))

    def raw_write() -> None:
        list(ex.map(lambda i: os.pwritev(fd, [hdrs[i].data, pays[i].data], i * slot), range(n)))

    def gds_write(backend: GdsBackend, one: bool) -> Any:
        def run() -> None:
            futs = [backend.pwrite([slots[i]] if one else [hdrs[i], pays[i]], i * slot) for i in range(n)]
            for f in futs:
                assert f.result() == slot

        return run

    def gds(backend: GdsBackend, one: bool) -> Any:
        def run() -> None:
            futs = [backend.pread([slots[i]] if one else [hdrs[i], pays[i]], i * slot) for i in range(n)]
            for f in futs:
                assert f.result() == slot

        return run

    import kvikio.defaults

    if args.kvikio_threads:
        kvikio.defaults.set("num_threads", args.kvikio_threads)
    print(f"kvikio num_threads {kvikio.defaults.get('num_threads')} task_size {kvikio.defaults.get('task_size')} "
          f"auto_direct_io_write {kvikio.defaults.get('auto_direct_io_write')}", flush=True)
    plain = GdsBackend(path, threads=4)
    variants: list[tuple[str, Any]] = [
        ("raw preadv 2 iov", raw),
        ("gds 2 calls", gds(plain, False)),
        ("gds 1 call", gds(plain, True)),
    ]
    kvikio.defaults.set("auto_direct_io_read", True)
    direct = GdsBackend(path, threads=4)
    variants += [
        ("gds 2 calls, kvikio O_DIRECT reads", gds(direct, False)),
        ("gds 1 call, kvikio O_DIRECT reads", gds(direct, True)),
    ]
    kvikio.defaults.set("auto_direct_io_read", False)
    variants += [
        ("write: raw pwritev 2 iov", raw_write),
        ("write: gds 2 calls", gds_write(plain, False)),
        ("write: gds 1 call", gds_write(plain, True)),
    ]
    rows: dict[str, list[float]] = {name: [] for name, _ in variants}
    for r in range(args.rounds):
        for name, fn in variants:
            if "O_DIRECT" in name:
                kvikio.defaults.set("auto_direct_io_read", True)
            drop_cache(path)
            rows[name].append(timed(fn, n, slot))
            kvikio.defaults.set("auto_direct_io_read", False)
            assert np.array_equal(pays[7], src[7 * slot + HDR : 8 * slot]) or "1 call" in name
            print(f"round {r} {name}: {rows[name][-1]:.2f} GB/s", flush=True)
    for name, vals in rows.items():
        base = rows["write: raw pwritev 2 iov" if name.startswith("write") else "raw preadv 2 iov"]
        ratio = statistics.median(v / b for v, b in zip(vals, base, strict=True))
        print(f"{name:40s} median {statistics.median(vals):.2f} GB/s, x raw (same round) {ratio:.2f}")
    plain.close()
    direct.close()
    os.close(fd)
    os.unlink(path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
