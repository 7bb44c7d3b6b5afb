"""Remote store URLs: which store, where, and how to authenticate.

Primitives: :class:`StoreURL` (a parsed URL) and :func:`parse_store_url`.

Accepted forms::

    redis://host:port/db            Redis or Valkey (db defaults to 0)
    rediss://host:port/db           the same over TLS (certificates: TIERED_KV_REMOTE_TLS_CA / _CERT / _KEY)
    redis+cluster://host:port       a Redis Cluster (any node; keys are sharded across the nodes)
    mooncake://host:port            a Mooncake Store master (``mooncake_master -rpc_port=port``)

A password never goes in the URL (it would end up in logs and process listings): it is read from the
environment variable ``TIERED_KV_REMOTE_PASSWORD`` (Redis ``AUTH``; ``TIERED_KV_REMOTE_USER`` for an ACL
user). Query parameters: ``timeout`` (seconds per batch, default 5), ``ttl`` (Redis: seconds an object
lives, default none), ``segment`` (Mooncake: bytes of this process's memory lent to the store, default
256 MiB; ``0`` lends none: objects then live in the memory of other clients, e.g. a standalone
``mooncake_client``, and outlive this process), ``protocol`` (Mooncake transfer protocol, default ``tcp``).
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse

__all__ = ["PASSWORD_ENV", "SCHEMES", "USER_ENV", "StoreURL", "parse_store_url"]

#: The environment variable holding the store's password.
PASSWORD_ENV = "TIERED_KV_REMOTE_PASSWORD"
#: The environment variable holding the store's ACL user name (Redis 6+), if any.
USER_ENV = "TIERED_KV_REMOTE_USER"
SCHEMES = ("redis", "rediss", "redis+cluster", "mooncake")

_SIZE_UNITS = {"": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}


def _parse_size(text: str) -> int:
    t = text.strip().lower()
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(digits):]
    if not digits.isdigit() or unit not in _SIZE_UNITS:
        raise ValueError(f"segment must be a byte count such as 268435456 or 256MiB, got {text!r}")
    return int(digits) * _SIZE_UNITS[unit]


@dataclasses.dataclass(frozen=True, slots=True)
class StoreURL:
    """A parsed store URL.

    Attributes:
        scheme: ``"redis"``, ``"rediss"``, ``"redis+cluster"`` or ``"mooncake"``.
        host, port: where the store (Redis node, Mooncake master) listens.
        db: Redis database number.
        timeout: seconds one batch may take before it counts as failed.
        ttl: Redis expiry of every object in seconds (``None``: no expiry; the store's eviction policy rules).
        segment: Mooncake: bytes of this process's memory mounted into the store.
        protocol: Mooncake transfer protocol (``"tcp"`` on loopback, ``"rdma"`` across RDMA NICs).
        password, user: from the environment, never from the URL.
    """

    scheme: str
    host: str
    port: int
    db: int = 0
    timeout: float = 5.0
    ttl: int | None = None
    segment: int = 256 * 2**20
    protocol: str = "tcp"
    password: str | None = dataclasses.field(default=None, repr=False)
    user: str | None = None

    @property
    def kind(self) -> str:
        """``"redis"`` (plain, TLS or cluster) or ``"mooncake"``."""
        return "mooncake" if self.scheme == "mooncake" else "redis"

    @property
    def tls(self) -> bool:
        """``rediss://``: TLS."""
        return self.scheme == "rediss"

    @property
    def address(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        db = f"/{self.db}" if self.kind == "redis" and self.scheme != "redis+cluster" else ""
        return f"{self.scheme}://{self.address}{db}"


def parse_store_url(url: str, environ: dict[str, str] | None = None) -> StoreURL:
    """Parse a store URL (see the module docstring).

    Raises:
        TypeError: ``url`` is not a string.
        ValueError: unknown scheme, no host or port, a password in the URL, a bad query parameter.
    """
    if not isinstance(url, str):
        raise TypeError(f"a remote store URL must be a str, got {type(url).__name__}")
    env = os.environ if environ is None else environ
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"unknown remote store URL {url!r}: use one of {', '.join(s + '://host:port' for s in SCHEMES)}")
    if parts.password is not None:
        raise ValueError(f"do not put the password in the URL; set the environment variable {PASSWORD_ENV}")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"bad port in remote store URL {url!r}: {exc}") from None
    if not parts.hostname or port is None:
        raise ValueError(f"remote store URL {url!r} needs a host and a port (e.g. {scheme}://127.0.0.1:6379)")
    path = parts.path.strip("/")
    db = 0
    if path:
        if scheme in ("mooncake", "redis+cluster") or not path.isdigit():
            raise ValueError(f"remote store URL {url!r}: the path must be a Redis database number (redis://host:port/0)")
        db = int(path)
    fields: dict[str, object] = {}
    for name, values in urllib.parse.parse_qs(parts.query, keep_blank_values=True).items():
        value = values[-1]
        try:
            if name == "timeout":
                fields[name] = float(value)
                if not 0 < float(value) <= 3600:
                    raise ValueError
            elif name == "ttl":
                fields[name] = int(value)
                if int(value) < 1:
                    raise ValueError
            elif name == "segment":
                fields[name] = _parse_size(value)
            elif name == "protocol":
                if value not in ("tcp", "rdma"):
                    raise ValueError
                fields[name] = value
            else:
                raise ValueError(f"unknown parameter {name!r} in remote store URL {url!r} (timeout, ttl, segment, protocol)")
        except ValueError as exc:
            raise ValueError(str(exc) or f"bad value {value!r} for {name!r} in remote store URL {url!r}") from None
    return StoreURL(scheme, parts.hostname, port, db, password=env.get(PASSWORD_ENV) or None,
                    user=parts.username or env.get(USER_ENV) or None, **fields)  # type: ignore[arg-type]
