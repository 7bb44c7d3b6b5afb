"""Real Redis and Mooncake servers on 127.0.0.1 for the remote-tier tests (started per module, stopped by PID)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tiered_kv.remote.servers import LocalServer, start_mooncake_master, start_redis

#: small Mooncake segments and short timeouts: tests run many clients on a 2-core machine
QUERY = {"redis": "?timeout=3", "mooncake": "?timeout=5&segment=32MiB"}


def store_url(server: LocalServer, **params: object) -> str:
    extra = "".join(f"&{k}={v}" for k, v in params.items())
    return server.url + QUERY[server.kind] + extra


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalServer]:
    with start_redis() as server:
        yield server


@pytest.fixture(scope="module")
def mooncake_server() -> Iterator[LocalServer]:
    with start_mooncake_master() as server:
        yield server


@pytest.fixture(scope="module", params=["redis", "mooncake"])
def server(request: pytest.FixtureRequest) -> LocalServer:
    """Each test runs against a real Redis server and a real Mooncake master."""
    return request.getfixturevalue(f"{request.param}_server")  # type: ignore[no-any-return]
