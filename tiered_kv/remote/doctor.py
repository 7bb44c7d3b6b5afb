"""``tiered-kv doctor --remote URL``: is the store reachable, how long is a round trip, how fast are batches.

Primitive: :func:`remote_checks` -- ``(check, ok, what was found, what to do if not ok)`` rows, the format of
the CLI's doctor. It connects, times ``ping`` round trips, then puts and gets one batch of verified objects
(random bytes under fresh names, checked byte for byte) and reports the bandwidth of each direction.
"""

from __future__ import annotations

import statistics
import time
import uuid

import numpy as np

from ..errors import BackendUnavailable, RemoteStoreError
from .stores import open_store
from .url import parse_store_url

__all__ = ["remote_checks"]

Check = tuple[str, bool, str, str]


async def remote_checks(url: str, *, object_bytes: int = 1 << 20, batch: int = 16, pings: int = 20) -> list[Check]:
    """Probe the store at ``url`` (see the module docstring). Never raises for a store problem: it is a row.

    Cancellation: propagates; the client is closed.
    """
    try:
        u = parse_store_url(url)
        store = open_store(u)
    except (ValueError, TypeError) as exc:
        return [("remote store URL", False, str(exc), "use redis://host:port/db, rediss://..., redis+cluster://... or mooncake://host:port")]
    except BackendUnavailable as exc:
        return [("remote store client", False, str(exc), "pip install 'tiered-kv[remote]'")]
    checks: list[Check] = []
    try:
        try:
            await store.connect()
        except RemoteStoreError as exc:
            return [
                (
                    "remote store",
                    False,
                    f"{u} unreachable: {exc}",
                    "start the store (redis-server / mooncake_master) or fix the URL; "
                    "without it the cache runs on local tiers only",
                )
            ]
        checks.append(("remote store", True, f"{u} ({store.kind}) reachable", ""))
        rtts = [await store.ping() for _ in range(pings)]
        checks.append(
            (
                "remote round trip",
                True,
                f"median {statistics.median(rtts) * 1e3:.3f} ms, max {max(rtts) * 1e3:.3f} ms ({pings} pings)",
                "",
            )
        )
        data = np.random.default_rng().integers(0, 256, (batch, object_bytes), dtype=np.uint8)
        out = np.zeros_like(data)
        store.register(data)
        store.register(out)
        prefix = f"tkv1/doctor/{uuid.uuid4().hex}"
        names = [f"{prefix}/{i}" for i in range(batch)]
        t0 = time.perf_counter()
        ok = await store.put(names, list(data))
        t_put = time.perf_counter() - t0
        t0 = time.perf_counter()
        sizes = await store.get(names, list(out))
        t_get = time.perf_counter() - t0
        intact = all(ok) and sizes == [object_bytes] * batch and bool((out == data).all())
        mib = batch * object_bytes / 2**20
        checks.append(
            (
                "remote bandwidth",
                intact,
                f"{batch} x {object_bytes // 1024} KiB: put {mib / t_put:.0f} MiB/s, "
                f"get {mib / t_get:.0f} MiB/s" + ("" if intact else " -- DATA READ BACK DIFFERED OR WAS MISSING"),
                "the store lost or changed objects: check its memory limits and eviction policy",
            )
        )
        try:
            delete = getattr(store, "delete", None)
            if delete is not None:
                await delete(names)
        except RemoteStoreError:
            pass  # Mooncake refuses removal within a read lease; the objects expire with the doctor's segment
    except RemoteStoreError as exc:
        checks.append(
            (
                "remote store",
                False,
                f"failed during the probe: {exc}",
                "check the store's logs and the timeout (?timeout=)",
            )
        )
    finally:
        await store.close()
    return checks
