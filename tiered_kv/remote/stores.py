"""Clients of the distributed stores the remote tier runs on: Redis/Valkey and Mooncake Store.

Primitives:

* :class:`RemoteStore` -- the protocol the remote tier uses: ``connect``, ``register`` (memory the store
  may read/write directly), ``put`` and ``get`` of a *batch* of named objects (one round trip each),
  ``replace`` (a batch of objects found corrupted, each overwritten by a good one), ``ping``, ``close``.
* :class:`RedisStore` -- ``redis.asyncio`` (plain, TLS, or Redis Cluster): ``SET name value NX [EX ttl]``
  and ``MGET`` batches in one pipeline each. ``NX`` makes objects immutable like Mooncake's: a second
  writer of a key keeps the first value. ``replace`` is a compare-and-set in one Lua script per object: the
  value is overwritten only while it is still the corrupted one the reader saw (same SHA-1).
* :class:`MooncakeStore` -- ``mooncake.store.MooncakeDistributedStore`` with ``P2PHANDSHAKE`` metadata (no
  etcd): zero-copy ``batch_put_from`` / ``batch_get_into`` from registered (pinned) host memory. Its calls
  block, so they run on a worker thread; a call that outlives its timeout keeps its buffers until it returns
  (:attr:`RemoteStoreError.pending`). ``replace`` is ``batch_upsert_from``: Mooncake has no compare-and-set,
  so it may overwrite another node's good replacement with an equally good one.
* :func:`open_store` -- the client for a URL (:mod:`tiered_kv.remote.url`).

Every failure (refused, timed out, a store error) is a :class:`~tiered_kv.errors.RemoteStoreError`; a
missing object is not an error (``get`` reports ``-1`` for it). Nothing here trusts the bytes: the remote
tier verifies every object (:mod:`tiered_kv.remote.objects`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import os
import socket
import ssl
import time
from typing import Any, Protocol

import numpy as np

from ..errors import BackendUnavailable, RemoteStoreError
from .url import StoreURL, parse_store_url

__all__ = [
    "KEPT",
    "MISSING",
    "REPLACED",
    "STORED",
    "MooncakeStore",
    "RedisStore",
    "RemoteStore",
    "StoreTimeout",
    "open_store",
]

log = logging.getLogger(__name__)

#: ``get`` result of an object the store does not have (any other negative result is a store error code).
MISSING = -1
#: ``replace`` outcomes: the corrupted object was overwritten; the name held nothing and the object was stored;
#: the name holds another object than the corrupted one (a replacement by another node), which stays.
REPLACED, STORED, KEPT = "replaced", "stored", "kept"
#: REPLICA_IS_NOT_READY (its put is still being written), OBJECT_NOT_FOUND, LEASE_EXPIRED: a miss, not a store error
_MOONCAKE_MISSES = (-703, -704, -707)
_CLOSE_WAIT = 60  # seconds close() waits for Mooncake calls that outlived their timeout
_ABANDONED: list[Any] = []  # Mooncake clients left open because a call still ran at close()


class StoreTimeout(RemoteStoreError):
    """A batch did not finish within the store's timeout.

    Attributes:
        pending: the worker-thread call still running (Mooncake), whose buffers must not be reused until
            it is done; ``None`` when nothing runs on (Redis: the connection is dropped).
    """

    def __init__(self, message: str, pending: concurrent.futures.Future[Any] | None = None) -> None:
        super().__init__(message)
        self.pending = pending


class RemoteStore(Protocol):
    """What the remote tier needs of a store."""

    url: StoreURL
    kind: str

    async def connect(self) -> None:
        """Connect (bounded by the URL's timeout). Raises :class:`RemoteStoreError` if it cannot."""
        ...

    def register(self, buffer: np.ndarray) -> None:
        """Let the store read and write ``buffer`` directly (a no-op where the client copies)."""
        ...

    async def put(self, names: list[str], objects: list[np.ndarray]) -> list[bool]:
        """Store each object under its name unless the name exists; one round trip. ``True``: stored or present."""
        ...

    async def get(self, names: list[str], out: list[np.ndarray]) -> list[int]:
        """Read each object into ``out[i]``; one round trip.

        Per object: bytes read, :data:`MISSING`, or another negative (a store error).
        """
        ...

    async def replace(self, names: list[str], objects: list[np.ndarray], corrupt: list[str | None]) -> list[str | None]:
        """Overwrite objects found corrupted with good ones; one round trip.

        Args:
            names: the objects' names.
            objects: the good objects.
            corrupt: per name, the SHA-1 (hex) of the corrupted bytes read, or ``None`` when they were not of
                the object's size (a store with compare-and-set replaces only that value).

        Returns:
            Per object: :data:`REPLACED`, :data:`STORED`, :data:`KEPT`, or ``None`` (not stored: an error).
        """
        ...

    async def ping(self) -> float:
        """Seconds of one round trip."""
        ...

    async def close(self) -> None:
        """Release the connection (idempotent)."""
        ...


async def _bounded(awaitable: Any, seconds: float, what: str, url: StoreURL) -> Any:
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except TimeoutError:
        raise StoreTimeout(f"{url}: {what} took longer than {seconds:g} s") from None


def _probe(url: StoreURL, what: str) -> None:
    try:
        with socket.create_connection((url.host, url.port), timeout=min(url.timeout, 2.0)):
            pass
    except OSError as exc:
        raise RemoteStoreError(f"cannot reach the {what} at {url}: {exc}") from exc


#: KEYS[1] the name; ARGV: the good object, the corrupted object's SHA-1 ("" when its size was wrong), the TTL
#: ("0": none). Overwrites the value only while it is the corrupted one; 2 replaced, 1 stored (absent), 0 kept.
_REPLACE_SCRIPT = """
local cur = redis.call('GET', KEYS[1])
local still_bad = cur and ((ARGV[2] ~= '' and redis.sha1hex(cur) == ARGV[2])
    or (ARGV[2] == '' and string.len(cur) ~= string.len(ARGV[1])))
if cur and not still_bad then
    return 0
end
if tonumber(ARGV[3]) > 0 then
    redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
else
    redis.call('SET', KEYS[1], ARGV[1])
end
if cur then
    return 2
end
return 1
"""


class RedisStore:
    """A Redis / Valkey store through ``redis.asyncio`` (one connection pool per store).

    Args:
        url: a ``redis://``, ``rediss://`` or ``redis+cluster://`` URL (:func:`parse_store_url`).
    """

    kind = "redis"

    def __init__(self, url: StoreURL) -> None:
        try:
            import redis.asyncio  # noqa: F401
        except ImportError:
            raise BackendUnavailable("the Redis remote tier needs redis-py: pip install 'tiered-kv[remote]'") from None
        self.url = url
        self._client: Any = None

    def _make_client(self) -> Any:
        import redis.asyncio as aioredis
        from redis.asyncio.cluster import RedisCluster

        u = self.url
        common: dict[str, Any] = dict(
            password=u.password, username=u.user, socket_timeout=u.timeout, socket_connect_timeout=u.timeout
        )
        if u.tls:
            common.update(
                ssl=True,
                ssl_ca_certs=os.environ.get("TIERED_KV_REMOTE_TLS_CA"),
                ssl_certfile=os.environ.get("TIERED_KV_REMOTE_TLS_CERT"),
                ssl_keyfile=os.environ.get("TIERED_KV_REMOTE_TLS_KEY"),
                ssl_cert_reqs=ssl.CERT_REQUIRED if os.environ.get("TIERED_KV_REMOTE_TLS_CA") else ssl.CERT_NONE,
            )
        if u.scheme == "redis+cluster":
            return RedisCluster(host=u.host, port=u.port, **common)
        return aioredis.Redis(host=u.host, port=u.port, db=u.db, **common)

    async def connect(self) -> None:
        """Connect and ``PING``. Raises :class:`RemoteStoreError` (refused, auth, timeout).

        Cancellation: the half-open client is closed and the cancellation propagates.
        """
        import redis.exceptions

        _probe(self.url, "Redis store")  # a refused port fails at once (the client would retry until the timeout)
        if self._client is None:
            self._client = self._make_client()
        try:
            await _bounded(self._client.ping(), self.url.timeout, "connect", self.url)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise RemoteStoreError(f"cannot reach the Redis store at {self.url}: {exc}") from exc

    def register(self, buffer: np.ndarray) -> None:
        """Nothing to register: redis-py copies."""

    async def put(self, names: list[str], objects: list[np.ndarray]) -> list[bool]:
        """``SET name value NX [EX ttl]`` for every object in one pipeline (one round trip).

        Cancellation: the connection is dropped with the pipeline; objects already sent may be stored
        (each ``SET`` is atomic, so none is torn).
        """
        if not names:
            return []
        import redis.exceptions

        client = self._require()
        pipe = client.pipeline(transaction=False)
        for name, obj in zip(names, objects, strict=True):
            pipe.set(name, obj.data, nx=True, ex=self.url.ttl)
        try:
            replies = await _bounded(
                pipe.execute(raise_on_error=False), self.url.timeout, f"put of {len(names)} objects", self.url
            )
        except (redis.exceptions.RedisError, OSError) as exc:
            raise RemoteStoreError(f"Redis put of {len(names)} objects at {self.url} failed: {exc}") from exc
        # NX: True when set, None when the name existed (immutable: the first value stays) -- both are fine
        return [not isinstance(r, Exception) for r in replies]

    async def replace(self, names: list[str], objects: list[np.ndarray], corrupt: list[str | None]) -> list[str | None]:
        """Compare-and-set of every object in one pipeline (one Lua script each; see :meth:`RemoteStore.replace`).

        Cancellation: as :meth:`put` (each script is atomic).
        """
        if not names:
            return []
        import redis.exceptions

        pipe = self._require().pipeline(transaction=False)
        for name, obj, digest in zip(names, objects, corrupt, strict=True):
            pipe.eval(_REPLACE_SCRIPT, 1, name, obj.data, digest or "", self.url.ttl or 0)
        try:
            replies = await _bounded(
                pipe.execute(raise_on_error=False), self.url.timeout, f"replace of {len(names)} objects", self.url
            )
        except (redis.exceptions.RedisError, OSError) as exc:
            raise RemoteStoreError(f"Redis replace of {len(names)} objects at {self.url} failed: {exc}") from exc
        outcomes = {0: KEPT, 1: STORED, 2: REPLACED}
        return [None if isinstance(r, Exception) else outcomes.get(int(r)) for r in replies]

    async def get(self, names: list[str], out: list[np.ndarray]) -> list[int]:
        """``MGET`` of every name (one round trip; a cluster splits it per node), copied into ``out``.

        Cancellation: the connection is dropped; ``out`` may hold partial data (not yet verified by anyone).
        """
        if not names:
            return []
        import redis.exceptions

        client = self._require()
        try:
            if self.url.scheme == "redis+cluster":
                values = await _bounded(
                    client.mget_nonatomic(names), self.url.timeout, f"get of {len(names)} objects", self.url
                )
            else:
                values = await _bounded(client.mget(names), self.url.timeout, f"get of {len(names)} objects", self.url)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise RemoteStoreError(f"Redis get of {len(names)} objects at {self.url} failed: {exc}") from exc

        def copy_out() -> list[int]:  # a worker thread: large copies stay off the event loop
            sizes: list[int] = []
            for value, dst in zip(values, out, strict=True):
                if value is None:
                    sizes.append(MISSING)
                elif len(value) != dst.size:
                    sizes.append(len(value))  # the caller sees the size mismatch and treats it as a bad object
                else:
                    dst[:] = np.frombuffer(value, dtype=np.uint8)
                    sizes.append(len(value))
            return sizes

        result: list[int] = await asyncio.get_running_loop().run_in_executor(None, copy_out)
        return result

    async def ping(self) -> float:
        """Seconds of one ``PING`` round trip. Cancellation: propagates."""
        import redis.exceptions

        client = self._require()
        t0 = time.perf_counter()
        try:
            await _bounded(client.ping(), self.url.timeout, "ping", self.url)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise RemoteStoreError(f"Redis ping at {self.url} failed: {exc}") from exc
        return time.perf_counter() - t0

    async def delete(self, names: list[str]) -> None:
        """Remove objects (tests and tools; the cache never deletes). Cancellation: propagates."""
        if names:
            await self._require().delete(*names)

    async def close(self) -> None:
        """Close the connection pool. Cancellation: propagates; a later call closes again."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def _require(self) -> Any:
        if self._client is None:
            raise RemoteStoreError(f"the Redis store at {self.url} is not connected")
        return self._client

    def __repr__(self) -> str:
        return f"<RedisStore {self.url}>"


def _local_hostname(url: StoreURL) -> str:
    """The address other nodes reach this process at: loopback for a loopback master, else the route's source."""
    explicit = os.environ.get("TIERED_KV_REMOTE_HOSTNAME")
    if explicit:
        return explicit
    try:
        if ipaddress.ip_address(socket.gethostbyname(url.host)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent: this only picks a route
        s.connect((url.host, url.port))
        return str(s.getsockname()[0])


class MooncakeStore:
    """A Mooncake Store client (``P2PHANDSHAKE``, no etcd) that lends ``url.segment`` bytes of memory to the store.

    Args:
        url: a ``mooncake://master-host:port`` URL.

    Notes:
        Objects live in the memory segments that clients mount; this process's segment goes away with it
        (its objects then become misses for everyone). Run a long-lived ``mooncake_client`` (or keep
        processes up) to keep objects beyond one engine's life.
    """

    kind = "mooncake"

    def __init__(self, url: StoreURL) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailable(
                f"the Mooncake remote tier needs the Mooncake wheel (pip install 'tiered-kv[remote]') and its system "
                f"libraries (libibverbs1 librdmacm1 libnuma1 liburing2 libcurl4): {exc}"
            ) from None
        self.url = url
        self._store: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="tiered_kv-mooncake")
        self._registered: list[tuple[int, int]] = []
        self._inflight: set[concurrent.futures.Future[Any]] = set()  # calls running on the worker threads

    async def _call(self, what: str, fn: Any, *args: Any) -> Any:
        future = self._pool.submit(fn, *args)
        self._inflight.add(future)
        future.add_done_callback(self._inflight.discard)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.url.timeout)
        except TimeoutError:
            raise StoreTimeout(f"{self.url}: {what} took longer than {self.url.timeout:g} s", pending=future) from None
        except RuntimeError as exc:
            raise RemoteStoreError(f"Mooncake {what} at {self.url} failed: {exc}") from exc

    async def connect(self) -> None:
        """Probe the master (a refused port fails at once) and set up the client.

        Cancellation: propagates; a set-up already running finishes on its thread.
        """
        from mooncake.store import MooncakeDistributedStore

        if self._store is not None:
            return
        _probe(self.url, "Mooncake master")  # set-up against a dead master retries for 90 s
        store = MooncakeDistributedStore()
        host = _local_hostname(self.url)
        rc = await self._call(
            "set-up",
            store.setup,
            host,
            "P2PHANDSHAKE",
            self.url.segment,
            16 * 2**20,
            self.url.protocol,
            "",
            self.url.address,
        )
        if rc != 0:
            raise RemoteStoreError(f"Mooncake set-up against the master at {self.url} failed (code {rc})")
        self._store = store
        for ptr, n in self._registered:
            self._register(ptr, n)

    def _register(self, ptr: int, nbytes: int) -> None:
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise RemoteStoreError(f"Mooncake could not register {nbytes} bytes of host memory (code {rc})")

    def register(self, buffer: np.ndarray) -> None:
        """Register ``buffer`` for zero-copy transfers (again after every reconnect)."""
        entry = (int(buffer.ctypes.data), int(buffer.nbytes))
        self._registered.append(entry)
        if self._store is not None:
            self._register(*entry)

    async def put(self, names: list[str], objects: list[np.ndarray]) -> list[bool]:
        """``batch_put_from`` (one call, zero-copy from registered memory).

        Cancellation: the call finishes on its thread; ``objects`` stay in use until it does.
        """
        if not names:
            return []
        store = self._require()
        codes = await self._call(
            f"put of {len(names)} objects",
            store.batch_put_from,
            names,
            [int(o.ctypes.data) for o in objects],
            [int(o.nbytes) for o in objects],
        )
        return [c == 0 for c in codes]

    async def replace(self, names: list[str], objects: list[np.ndarray], corrupt: list[str | None]) -> list[str | None]:
        """``batch_upsert_from`` (one call, zero-copy): Mooncake has no compare-and-set, ``corrupt`` is not used.

        Cancellation: as :meth:`put`.
        """
        if not names:
            return []
        store = self._require()
        codes = await self._call(
            f"replace of {len(names)} objects",
            store.batch_upsert_from,
            names,
            [int(o.ctypes.data) for o in objects],
            [int(o.nbytes) for o in objects],
        )
        return [REPLACED if c == 0 else None for c in codes]

    async def get(self, names: list[str], out: list[np.ndarray]) -> list[int]:
        """``batch_get_into`` (one call, zero-copy into registered memory).

        Cancellation: the call finishes on its thread; ``out`` stays in use until it does.
        """
        if not names:
            return []
        store = self._require()
        codes = await self._call(
            f"get of {len(names)} objects",
            store.batch_get_into,
            names,
            [int(o.ctypes.data) for o in out],
            [int(o.nbytes) for o in out],
        )
        # an object not written yet, not there, or whose lease expired mid-read is a miss; other codes are store errors
        return [MISSING if c in _MOONCAKE_MISSES else int(c) for c in codes]

    async def ping(self) -> float:
        """Seconds of one ``is_exist`` round trip to the master. Cancellation: propagates."""
        store = self._require()
        t0 = time.perf_counter()
        rc = await self._call("ping", store.is_exist, "tkv1/ping")
        if rc < 0:
            raise RemoteStoreError(f"Mooncake master at {self.url} answered {rc}")
        return time.perf_counter() - t0

    async def delete(self, names: list[str]) -> None:
        """Remove objects (tests and tools; fails while a read lease is held). Cancellation: propagates."""
        store = self._require()
        for name in names:
            await self._call("remove", store.remove, name)

    async def close(self) -> None:
        """Unmount this process's segment and stop the client. Cancellation: propagates."""
        store, self._store = self._store, None
        if store is None:
            return
        # a call that outlived its timeout still runs in the client: closing the client under it would crash
        pending = [asyncio.wrap_future(f) for f in list(self._inflight)]
        if pending:
            _, late = await asyncio.wait(pending, timeout=_CLOSE_WAIT)
            if late:
                log.warning("Mooncake calls still running after %d s; the client is left open", _CLOSE_WAIT)
                _ABANDONED.append(store)  # never destroyed while a call may still use it
                self._pool.shutdown(wait=False)
                return
        await asyncio.get_running_loop().run_in_executor(self._pool, store.close)
        self._pool.shutdown(wait=False)

    def _require(self) -> Any:
        if self._store is None:
            raise RemoteStoreError(f"the Mooncake store at {self.url} is not connected")
        return self._store

    def __repr__(self) -> str:
        return f"<MooncakeStore {self.url}>"


def open_store(url: str | StoreURL) -> RedisStore | MooncakeStore:
    """The (not yet connected) client for ``url``.

    Raises:
        ValueError, TypeError: a bad URL.
        BackendUnavailable: the store's client package is not installed.
    """
    u = url if isinstance(url, StoreURL) else parse_store_url(url)
    return MooncakeStore(u) if u.kind == "mooncake" else RedisStore(u)
