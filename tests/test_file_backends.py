"""File backends (posix, gds mode selection, the fault injector) and the slab format, below the engine."""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import sys
import time
import types
from typing import Any

import numpy as np
import pytest
import torch
from tiered_kv.backends import FileBackend
from tiered_kv.backends import gds as gds_mod
from tiered_kv.backends import posix as posix_mod
from tiered_kv.backends.gds import GdsMode, select_backend
from tiered_kv.backends.posix import DIRECT_ALIGN, PosixBackend, aligned_empty, direct_io_supported, preallocate

from tiered_kv import BackendUnavailable, KVLayout
from tiered_kv.file import FileTier, FileTierConfig
from tiered_kv.slab import HEADER_SIZE, Superblock, pack_header, payload_checksum, unpack_header
from tiered_kv.testing import FaultyBackend

HAS_KVIKIO = importlib.util.find_spec("kvikio") is not None


def _file(tmp_path, size: int = 1 << 20) -> str:
    path = str(tmp_path / "f.bin")
    fd = posix_mod.create_file(path)
    preallocate(fd, size)
    os.close(fd)
    return path


# --------------------------------------------------------------------------------------------- posix


def test_posix_aligned_and_bounced_round_trip(tmp_path) -> None:
    path = _file(tmp_path)
    be = PosixBackend(path, threads=2)
    assert isinstance(be, FileBackend)
    try:
        aligned = aligned_empty(2 * DIRECT_ALIGN)
        aligned.random_(0, 255)
        assert be.pwrite([aligned], 0).result() == 2 * DIRECT_ALIGN
        # unaligned address (offset by 1 byte) but aligned total: bounce buffer, still correct
        raw = torch.empty(3 * DIRECT_ALIGN + 1, dtype=torch.uint8)
        raw.random_(0, 255)
        odd = raw[1:]
        assert be.pwrite([odd[:1000], odd[1000:]], 4 * DIRECT_ALIGN).result() == 3 * DIRECT_ALIGN
        back = np.zeros(3 * DIRECT_ALIGN + 1, dtype=np.uint8)[1:]
        assert be.pread([back], 4 * DIRECT_ALIGN).result() == 3 * DIRECT_ALIGN
        assert np.array_equal(back, odd.numpy())
        back2 = aligned_empty(2 * DIRECT_ALIGN)
        assert be.pread([back2], 0).result() == 2 * DIRECT_ALIGN
        assert torch.equal(back2, aligned)
        if be.direct:
            assert be.bounced == 2
        assert be.sync(True).result() == 0 and be.sync(False).result() == 0
    finally:
        be.close()
    be.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        be.pwrite([aligned], 0)


def test_posix_short_read_at_end_of_file_and_hooks(tmp_path) -> None:
    path = _file(tmp_path, 2 * DIRECT_ALIGN)
    be = PosixBackend(path, threads=1)
    try:
        buf = aligned_empty(4 * DIRECT_ALIGN)
        seen: list[int] = []
        assert be.pread([buf], 0, after=seen.append).result() == 2 * DIRECT_ALIGN
        assert seen == [2 * DIRECT_ALIGN]
        hdr = aligned_empty(DIRECT_ALIGN)

        def fill() -> None:
            hdr.fill_(7)

        assert be.pwrite([hdr], 0, before=fill).result() == DIRECT_ALIGN
        check = aligned_empty(DIRECT_ALIGN)
        be.pread([check], 0).result()
        assert int(check.min()) == 7 == int(check.max())

        def boom(n: int) -> None:
            raise ValueError("bad")

        with pytest.raises(ValueError, match="bad"):
            be.pread([check], 0, after=boom).result()
        with pytest.raises(TypeError, match="torch tensors or numpy"):
            be.pwrite([b"abc"], 0)  # type: ignore[list-item]
        with pytest.raises(ValueError, match="contiguous"):
            be.pwrite([torch.zeros(8, 8, dtype=torch.uint8).t()], 0)
    finally:
        be.close()


def test_direct_io_probe_is_cached_per_directory(tmp_path, monkeypatch) -> None:
    first = direct_io_supported(tmp_path)
    calls: list[tuple[object, ...]] = []

    def refuse(*a: object, **k: object) -> int:
        calls.append(a)
        raise OSError(errno.EINVAL, "x")

    monkeypatch.setattr(os, "open", refuse)  # the os module tiered_kv.backends.posix uses
    assert direct_io_supported(tmp_path) is first  # cached: no second probe
    assert calls == []
    assert os.listdir(tmp_path) == []


def test_preallocate_falls_back_to_truncate(tmp_path, monkeypatch) -> None:
    def unsupported(fd: int, off: int, size: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "not here")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    fd = posix_mod.create_file(tmp_path / "x")
    try:
        assert preallocate(fd, 123 * 4096) == "truncate"
        assert os.fstat(fd).st_size == 123 * 4096
    finally:
        os.close(fd)

    def full(fd: int, off: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "full")

    monkeypatch.setattr(os, "posix_fallocate", full)
    fd = posix_mod.create_file(tmp_path / "y")
    try:
        with pytest.raises(OSError) as info:
            preallocate(fd, 4096)
        assert info.value.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_file_tier_on_enospc_while_preallocating_leaves_no_file(tmp_path, monkeypatch, layout: KVLayout) -> None:
    def full(fd: int, off: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "full")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError):
        FileTier(layout, FileTierConfig(tmp_path, 8, gds="off"))
    assert os.listdir(tmp_path) == []  # no slab and no lock file left behind (issue 11, finding 11)


# --------------------------------------------------------------------------------------------- faulty backend


def test_faulty_backend_counts_exactly(tmp_path) -> None:
    path = _file(tmp_path)
    fb = FaultyBackend(PosixBackend(path, threads=1), enospc_on_write={2, 4}, short_read_on=1, eio_on_read=3)
    assert isinstance(fb, FileBackend)
    try:
        buf = aligned_empty(4 * DIRECT_ALIGN)
        outcomes: list[int | str] = []
        for _ in range(5):
            try:
                outcomes.append(fb.pwrite([buf], 0).result())
            except OSError as exc:
                assert exc.errno is not None
                outcomes.append(errno.errorcode[exc.errno])
        assert outcomes == [4 * DIRECT_ALIGN, "ENOSPC", 4 * DIRECT_ALIGN, "ENOSPC", 4 * DIRECT_ALIGN]
        assert fb.pread([buf], 0).result() == 2 * DIRECT_ALIGN  # short: half
        assert fb.pread([buf], 0).result() == 4 * DIRECT_ALIGN
        with pytest.raises(OSError, match="injected on read #3"):
            fb.pread([buf], 0).result()
        assert (fb.writes, fb.reads, fb.faults) == (5, 3, 4)
    finally:
        fb.close()


# --------------------------------------------------------------------------------------------- slab format


@pytest.mark.parametrize("key", [b"\x00\xff", "caf\u00e9", 0, -1, 2**200, b"k" * 1024])
def test_slot_header_round_trip_and_every_byte_matters(key: object) -> None:
    out = np.zeros(HEADER_SIZE, dtype=np.uint8)
    pack_header(out.data, b"F" * 16, 5, 77, key, 3000, payload_checksum(b"x" * 3000))  # type: ignore[arg-type]
    h = unpack_header(out.data)
    assert not isinstance(h, str) and h is not None
    assert (h.key, h.slot, h.generation, h.payload_length, h.fingerprint) == (key, 5, 77, 3000, b"F" * 16)
    for pos in (0, 9, 20, 33, 41, 50, 60, 73, 76, 500, HEADER_SIZE - 1):
        bad = out.copy()
        bad[pos] ^= 1
        assert isinstance(unpack_header(bad.data), str), pos
    assert unpack_header(np.zeros(HEADER_SIZE, dtype=np.uint8).data) is None


def test_bad_keys() -> None:
    out = np.zeros(HEADER_SIZE, dtype=np.uint8)
    with pytest.raises(ValueError, match="at most 1024"):
        pack_header(out.data, b"F" * 16, 0, 1, b"k" * 1025, 1, b"c" * 16)
    with pytest.raises(TypeError):
        pack_header(out.data, b"F" * 16, 0, 1, True, 1, b"c" * 16)  # not a key; a bool passes as an int
    with pytest.raises(ValueError, match="empty"):
        pack_header(out.data, b"F" * 16, 0, 1, b"", 1, b"c" * 16)


def test_superblock() -> None:
    sb = Superblock(b"F" * 16, 10, 8192, 3072, "layers=1")
    raw = sb.pack()
    assert Superblock.unpack(raw) == sb
    assert "magic" in Superblock.unpack(b"x" * HEADER_SIZE)  # type: ignore[operator]
    flipped = bytearray(raw)
    flipped[40] ^= 1
    assert "checksum" in Superblock.unpack(bytes(flipped))  # type: ignore[operator]


# --------------------------------------------------------------------------------------------- gds mode


def test_gds_mode_parsing(monkeypatch) -> None:
    assert (
        GdsMode.coerce("ON") is GdsMode.ON
        and GdsMode.coerce(False) is GdsMode.OFF
        and GdsMode.coerce("auto") is GdsMode.AUTO
    )
    assert GdsMode.coerce("1") is GdsMode.ON and GdsMode.coerce("no") is GdsMode.OFF
    with pytest.raises(ValueError, match="'on', 'off' or 'auto'"):
        GdsMode.coerce("maybe")
    monkeypatch.setenv("TIERED_KV_GDS", "off")
    assert GdsMode.from_env() is GdsMode.OFF
    monkeypatch.setenv("TIERED_KV_GDS", "sometimes")
    with pytest.raises(ValueError, match="TIERED_KV_GDS"):
        GdsMode.from_env()
    with pytest.raises(ValueError, match="GDS mode"):
        FileTierConfig("/tmp", 4, gds="sometimes")


def _fake_kvikio(monkeypatch, gds_available: object, libcuda: bool) -> None:
    driver = types.ModuleType("kvikio.cufile_driver")

    def get(name: str) -> object:
        assert name == "is_gds_available"
        if isinstance(gds_available, float):
            time.sleep(gds_available)  # a driver query that hangs
            return True
        return gds_available

    driver.get = get  # type: ignore[attr-defined]
    kvikio = types.ModuleType("kvikio")
    kvikio.__version__ = "26.10-fake"  # type: ignore[attr-defined]
    kvikio.cufile_driver = driver  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "kvikio.cufile_driver", driver)
    monkeypatch.setattr(gds_mod, "_libcuda_loads", lambda: libcuda)


def test_select_backend_without_kvikio(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", None)  # import fails
    assert select_backend("off") == ("posix", None)
    kind, probe = select_backend("auto")
    assert kind == "posix" and probe is not None and "kvikio does not import" in probe.reason
    with pytest.raises(BackendUnavailable, match="GDS mode ON, but kvikio does not import"):
        select_backend("on")


def test_auto_means_posix_when_libcuda_is_missing(monkeypatch) -> None:
    _fake_kvikio(monkeypatch, True, libcuda=False)
    kind, probe = select_backend("auto")
    assert kind == "posix" and probe is not None and "libcuda.so.1" in probe.reason
    with pytest.raises(BackendUnavailable, match=r"libcuda\.so\.1"):
        select_backend("on")


def test_on_fails_fast_without_gds(monkeypatch, tmp_path, layout: KVLayout) -> None:
    _fake_kvikio(monkeypatch, False, libcuda=True)
    assert select_backend("auto")[0] == "gds"  # kvikio + driver: kvikio's own compat mode takes over
    t0 = time.perf_counter()
    with pytest.raises(BackendUnavailable, match="GDS unavailable"):
        select_backend("on")
    with pytest.raises(BackendUnavailable):
        FileTier(layout, FileTierConfig(tmp_path, 4, gds="on"))
    assert time.perf_counter() - t0 < 5
    assert os.listdir(tmp_path) == []  # nothing was created


def test_on_does_not_hang_on_a_hanging_driver_query(monkeypatch) -> None:
    _fake_kvikio(monkeypatch, 3.0, libcuda=True)
    monkeypatch.setattr(gds_mod, "PROBE_TIMEOUT_S", 0.2)
    t0 = time.perf_counter()
    with pytest.raises(BackendUnavailable):
        select_backend("on")
    assert time.perf_counter() - t0 < 2


def test_on_with_gds_and_mode_logged_once(monkeypatch, caplog) -> None:
    _fake_kvikio(monkeypatch, True, libcuda=True)
    monkeypatch.setattr(gds_mod, "_logged", set())
    with caplog.at_level(logging.INFO, logger="tiered_kv.backends.gds"):
        assert select_backend("on")[0] == "gds"
        assert select_backend("on")[0] == "gds"
    assert [r.getMessage() for r in caplog.records].count(
        "tiered_kv file tier I/O: gds (GDS mode ON, kvikio 26.10-fake, cuFile available)"
    ) == 1


# ----------------------------------------------------------------------------------------- real kvikio (GPU machine)


@pytest.mark.gpu
@pytest.mark.gds
@pytest.mark.parametrize("device_io", [False, True])
def test_gds_backend_round_trip(tmp_path, device_io: bool) -> None:
    if not HAS_KVIKIO:
        pytest.skip("kvikio is not installed")
    from tiered_kv.backends.gds import GdsBackend

    path = _file(tmp_path)
    be = GdsBackend(path, device_io=device_io)
    assert isinstance(be, FileBackend)
    try:
        host = aligned_empty(8 * DIRECT_ALIGN)
        host.random_(0, 255)
        src = host.cuda() if device_io else host
        seen: list[object] = []
        assert (
            be.pwrite([src[:DIRECT_ALIGN], src[DIRECT_ALIGN:]], DIRECT_ALIGN, before=lambda: seen.append("w")).result()
            == 8 * DIRECT_ALIGN
        )
        dst = torch.zeros_like(src)
        assert be.pread([dst], DIRECT_ALIGN, after=seen.append).result() == 8 * DIRECT_ALIGN
        assert seen == ["w", 8 * DIRECT_ALIGN]
        assert torch.equal(dst.cpu(), host)
        np_dst = np.zeros(8 * DIRECT_ALIGN, dtype=np.uint8)
        assert be.pread([np_dst], DIRECT_ALIGN).result() == 8 * DIRECT_ALIGN
        assert np.array_equal(np_dst, host.numpy())
        assert be.sync(True).result() == 0
    finally:
        be.close()


class _FakeFuture:
    """kvikio.IOFuture stand-in: ``get()`` may be called once (it consumes the future)."""

    def __init__(self, n: int) -> None:
        self._n: int | None = n

    def done(self) -> bool:
        return True

    def get(self) -> int:
        assert self._n is not None, "IOFuture.get() called twice"
        n, self._n = self._n, None
        return n


def _fake_kvikio_io(monkeypatch, gds_available: bool) -> dict[str, Any]:
    """A kvikio whose CuFile does POSIX I/O on host numpy buffers, to drive GdsBackend on a CPU machine."""
    import enum

    _fake_kvikio(monkeypatch, gds_available, libcuda=True)
    kvikio = sys.modules["kvikio"]
    settings: dict[str, Any] = {
        "num_threads": 1,
        "compat_mode": "auto",
        "auto_direct_io_read": False,
        "kvikio_calls": 0,
    }

    class CompatMode(enum.Enum):
        ON = "on"
        OFF = "off"
        AUTO = "auto"

    defaults = types.ModuleType("kvikio.defaults")
    defaults.get = settings.__getitem__  # type: ignore[attr-defined]
    defaults.set = settings.__setitem__  # type: ignore[attr-defined]

    class CuFile:
        def __init__(self, path: str, flags: str) -> None:
            assert flags == "r+"
            self.fd = os.open(path, os.O_RDWR)

        def pwrite(self, buf: np.ndarray, size: int, offset: int) -> _FakeFuture:
            assert isinstance(buf, np.ndarray) and buf.nbytes == size
            settings["kvikio_calls"] += 1
            return _FakeFuture(os.pwrite(self.fd, buf.data, offset))

        def pread(self, buf: np.ndarray, size: int, offset: int) -> _FakeFuture:
            assert isinstance(buf, np.ndarray) and buf.nbytes == size
            settings["kvikio_calls"] += 1
            return _FakeFuture(os.preadv(self.fd, [buf.data], offset))

        def fileno(self) -> int:
            return self.fd

        def close(self) -> None:
            os.close(self.fd)

    kvikio.CompatMode = CompatMode  # type: ignore[attr-defined]
    kvikio.defaults = defaults  # type: ignore[attr-defined]
    kvikio.CuFile = CuFile  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    return settings


@pytest.mark.parametrize("through", ["host path", "kvikio"])
async def test_engine_through_gds_backend_with_fake_kvikio(monkeypatch, tmp_path, layout: KVLayout, through) -> None:
    """The gds backend's wiring (buffers, futures consumed once, hooks, settings), end to end on a CPU.

    ``kvikio``: every request is sent the way a request with a CUDA buffer goes (kvikio's futures), with host
    buffers, which the fake kvikio takes.
    """
    from tiered_kv.backends.gds import GdsBackend

    from tiered_kv import Tier, TransferEngine
    from tiered_kv.testing import assert_blocks_equal, fill_random

    settings = _fake_kvikio_io(monkeypatch, gds_available=False)
    if through == "kvikio":
        monkeypatch.setattr(GdsBackend, "_kvikio_request", staticmethod(lambda buffers: True))
    cfg = FileTierConfig(tmp_path, 8, gds="auto", io_threads=3)
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device="cpu", file_config=cfg) as eng:
        be = eng.file_tier.backend
        assert be.name == "gds" and not be.device_io
        assert settings["num_threads"] == 3 and settings["compat_mode"].value == "on"
        assert settings["auto_direct_io_read"] is True  # kvikio's POSIX path reads with O_DIRECT, like posix
        src = [fill_random(eng.block(Tier.GPU, i)).clone() for i in range(4)]
        await eng.copy(Tier.GPU, [0, 1], Tier.FILE, [0, 1], keys=[b"a", b"b"])
        await eng.copy(Tier.GPU, [2, 3], Tier.HOST, [0, 1])
        await eng.copy(Tier.HOST, [0, 1], Tier.FILE, [2, 3], keys=[b"c", b"d"])
        await eng.copy(Tier.FILE, [0, 1], Tier.HOST, [2, 3])
        await eng.copy(Tier.FILE, [2, 3], Tier.GPU, [0, 1])
        assert_blocks_equal(eng.block(Tier.HOST, 2), src[0])
        assert_blocks_equal(eng.block(Tier.HOST, 3), src[1])
        assert_blocks_equal(eng.block(Tier.GPU, 0), src[2])
        assert_blocks_equal(eng.block(Tier.GPU, 1), src[3])
    if through == "kvikio":
        assert settings["kvikio_calls"] >= 16  # 8 slots written and read, header and payload each
    else:
        assert settings["kvikio_calls"] == 0  # every buffer was host memory: none went through kvikio's pool


def test_gds_backend_host_buffers_take_one_vectored_call(monkeypatch, tmp_path) -> None:
    """A request of host buffers (a slot's header and payload) is one pwritev / preadv, not a kvikio call each.

    kvikio's host path runs one POSIX call per buffer on its own pool; the gds backend's host requests are the
    posix backend's (one vectored O_DIRECT call on its own thread), with the same hooks.
    """
    from tiered_kv.backends.gds import GdsBackend

    settings = _fake_kvikio_io(monkeypatch, gds_available=False)
    calls: list[tuple[str, int]] = []

    def counting(name: str) -> Any:
        call = getattr(os, name)

        def counted(fd: int, bufs: Any, offset: int) -> int:
            calls.append((name, len(bufs)))
            return int(call(fd, bufs, offset))

        return counted

    for name in ("pwritev", "preadv"):
        monkeypatch.setattr(os, name, counting(name))
    path = _file(tmp_path)
    be = GdsBackend(path, mode="auto", threads=2)
    try:
        header, payload = aligned_empty(DIRECT_ALIGN), aligned_empty(4 * DIRECT_ALIGN)
        header.random_(0, 255)
        payload.random_(0, 255)
        seen: list[object] = []
        assert be.pwrite([header, payload], DIRECT_ALIGN, before=lambda: seen.append("w")).result() == 5 * DIRECT_ALIGN
        back = aligned_empty(5 * DIRECT_ALIGN).numpy()  # aligned: read in place, no bounce buffer
        assert be.pread([back[:DIRECT_ALIGN], back[DIRECT_ALIGN:]], DIRECT_ALIGN, after=seen.append).result() == (
            5 * DIRECT_ALIGN
        )
        assert seen == ["w", 5 * DIRECT_ALIGN]
        assert np.array_equal(back, torch.cat([header, payload]).numpy())
        assert calls == [("pwritev", 2), ("preadv", 2)] and settings["kvikio_calls"] == 0
        assert be.sync(True).result() == 0
        with pytest.raises(TypeError, match="torch tensors or numpy arrays"):
            be.pwrite([bytearray(DIRECT_ALIGN)], 0)  # type: ignore[list-item]
    finally:
        be.close()
    with pytest.raises(RuntimeError, match="closed"):
        be.pwrite([header], 0)


async def test_gds_backend_follows_the_tiers_direct_setting(monkeypatch, tmp_path, layout: KVLayout) -> None:
    """``FileTierConfig.direct`` reaches the gds backend's host path as it reaches the posix backend."""
    from tiered_kv import Tier, TransferEngine
    from tiered_kv.testing import assert_blocks_equal, fill_random

    _fake_kvikio_io(monkeypatch, gds_available=False)
    for direct in (False, None):
        cfg = FileTierConfig(tmp_path / str(direct), 4, gds="auto", direct=direct)
        async with TransferEngine(layout, gpu_blocks=2, host_blocks=2, device="cpu", file_config=cfg) as eng:
            assert eng.file_tier.backend.name == "gds"
            assert eng.file_tier.direct is (
                False if direct is False else posix_mod.direct_io_supported(str(tmp_path / str(direct)))
            )
            src = fill_random(eng.block(Tier.HOST, 0)).clone()
            await eng.copy(Tier.HOST, [0], Tier.FILE, [1], keys=[b"k"])
            await eng.copy(Tier.FILE, [1], Tier.HOST, [1])
            assert_blocks_equal(eng.block(Tier.HOST, 1), src)


def test_gds_backend_compat_mode_leaves_a_users_direct_read_setting(monkeypatch, tmp_path) -> None:
    """O_DIRECT reads are turned on for kvikio's POSIX path only where the user did not choose (env)."""
    from tiered_kv.backends.gds import GdsBackend

    settings = _fake_kvikio_io(monkeypatch, gds_available=False)
    monkeypatch.setenv("KVIKIO_AUTO_DIRECT_IO_READ", "0")
    be = GdsBackend(_file(tmp_path), mode="auto", threads=2)
    try:
        assert settings["compat_mode"].value == "on" and not be.gds
        assert settings["auto_direct_io_read"] is False
    finally:
        be.close()


def test_gds_backend_on_mode_sets_compat_off(monkeypatch, tmp_path) -> None:
    from tiered_kv.backends.gds import GdsBackend

    settings = _fake_kvikio_io(monkeypatch, gds_available=True)
    be = GdsBackend(_file(tmp_path), mode="on", threads=2)
    try:
        assert settings["compat_mode"].value == "off"
        assert be.gds and be.device_io
        assert settings["auto_direct_io_read"] is False  # cuFile: kvikio's POSIX read setting is not ours to move
    finally:
        be.close()
    os.makedirs(tmp_path / "x")
    with pytest.raises(ValueError, match="posix backend"):
        GdsBackend(_file(tmp_path / "x"), mode="off")


def test_emulated_host_memory_is_page_aligned() -> None:
    from tiered_kv.device import resolve_device

    dev = resolve_device("cpu")
    for dtype, shape in ((torch.float16, (3, 5, 7)), (torch.int32, (2, 1, 3, 9)), (torch.uint8, (4097,))):
        t = dev.empty_host(shape, dtype)
        assert t.data_ptr() % 4096 == 0 and t.shape == shape and t.dtype == dtype and t.is_contiguous()
