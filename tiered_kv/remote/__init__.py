"""The remote tier: KV blocks shared between nodes through a distributed store (Redis/Valkey, Mooncake Store).

Modules (one concept each):

* :mod:`~tiered_kv.remote.url` -- store URLs (``redis://``, ``rediss://``, ``redis+cluster://``,
  ``mooncake://``), password from the environment.
* :mod:`~tiered_kv.remote.objects` -- one immutable self-verifying object per block (the slab slot header).
* :mod:`~tiered_kv.remote.stores` -- the store clients, batched (one round trip per batch).
* :mod:`~tiered_kv.remote.tier` -- :class:`RemoteTier`: fenced, verified copies between engine pools and a store.
* :mod:`~tiered_kv.remote.fetch` -- the remote reads a prefix cache's admission plans, and what they let it reuse.
* :mod:`~tiered_kv.remote.servers` -- real servers on 127.0.0.1 for tests, demos and benchmarks.

Needs ``pip install 'tiered-kv[remote]'`` (redis-py; the Mooncake wheel). Nothing here is imported by
``import tiered_kv``; the store clients import their packages only when a store is opened.
"""

from __future__ import annotations

from .objects import object_name, object_size
from .stores import MooncakeStore, RedisStore, RemoteStore, StoreTimeout, open_store
from .tier import RemoteStatistics, RemoteTier, RemoteTransfer
from .url import PASSWORD_ENV, StoreURL, parse_store_url

__all__ = [
    "PASSWORD_ENV",
    "MooncakeStore",
    "RedisStore",
    "RemoteStatistics",
    "RemoteStore",
    "RemoteTier",
    "RemoteTransfer",
    "StoreTimeout",
    "StoreURL",
    "object_name",
    "object_size",
    "open_store",
    "parse_store_url",
]
