"""The file tier's I/O pipeline: one engine batch into or out of the slab, block by block, never parking a thread.

:class:`FileCopy` is one batch (a :class:`~tiered_kv.handlers.Job` without a lane): ``start(done)`` hands the
launch to a worker and returns; ``done(error)`` is called once, from whichever thread finishes last. It works
through the narrow :class:`~tiered_kv.file.slabio.SlabIO` interface (:mod:`~tiered_kv.file.slabio`; it and
:class:`~tiered_kv.file.slabio.IoCounters` are importable from here too), judges each slot with
:mod:`~tiered_kv.file.slot_checks` (read length, verification, the error a failed call is reported as) and moves
a group of GPU blocks across the host<->device link with the op :mod:`~tiered_kv.file.link` builds.

Per block, each step is a named method run when the previous one's completion fires (``_step`` guards it:
after a failure no further block starts, and an exception in a step fails that block):

* host pool -> file: checksum on the launcher thread, then ``pwrite`` (header, payload, padding).
* file -> host pool: ``pread``, length checked on the I/O thread, verified on a worker; at most
  ``reads_in_flight`` reads started at once (``FileCopy._pump``), the next one when a block is verified.

GPU pools go through the staging ring (:mod:`~tiered_kv.file.ring`) in *groups*: a group of up to
``ring.group`` blocks takes its staging blocks at once and crosses the host<->device link in **one stream op**
(one copier call for all its block pairs) with **one completion**, instead of one op, one event and one
thread hop per block (on a host where a torch call costs tens of microseconds that fixed cost, not the ring
depth, bounds 1 MiB blocks). After a failure no further group starts.

* GPU -> file: the group's GPU blocks -> its staging blocks on the offload stream (``_link``); from that
  op's completion, per staging block a tier worker checksums it and starts its ``pwrite`` (with GDS: of the
  GPU block itself; the staged copy is what is checksummed).
* file -> GPU: one ``pread`` per block into its staging block, each verified on a worker; once every member
  of the group is in, the verified ones go staging -> GPU blocks in one op on the onboard stream: a block
  that fails verification is left out of the op and never reaches the GPU pool, and the group's good blocks
  still land. With GDS: ``pread`` into the GPU blocks, one staged copy back for the group, each verified.

With a deadline (:mod:`~tiered_kv.file.deadline`) every backend call fails with ``FileTimeout`` once it has run
``timeout`` seconds; a buffer such a call may still read or write (a staging block, a bounce buffer) is given
back only when the call really returns. Reads into a host pool then land in a bounce buffer, verified there and
copied to the pool block, and GDS reads go through staging: no pool block is ever the target of a read that
may return after its copy failed.

A batch that writes finishes through the index (:meth:`~tiered_kv.file.index.SlotIndex.finish_write`: its
slots become valid only if every block landed and, per :class:`~tiered_kv.file.config.Durability`, was
synced); a read that fails verification drops its slot (:meth:`~tiered_kv.file.index.SlotIndex.drop_if`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..backends import Completion
from ..backends.posix import aligned_empty
from ..copyops import Copier
from ..device import Stream
from ..errors import IntegrityError, TransferError
from ..handlers import Done
from ..layer_major import LayerMajorPool
from ..pools import BlockPool
from ..slab import HEADER_SIZE, Key, pack_header, payload_checksum
from .config import Durability
from .deadline import FileTimeout, after_io
from .link import group_copy_op
from .slabio import IoCounters, SlabIO
from .slot_checks import check_read_length, slot_error, verify_slot

__all__ = ["FileCopy", "IoCounters", "SlabIO"]

Buffer = torch.Tensor | np.ndarray
Step = Callable[[int, int | None], None]  # (block j of the batch, its staging block or None)


class FileCopy:
    """One engine batch into (``write``) or out of the slab (see the module docstring).

    Args:
        io: the tier's :class:`SlabIO`.
        write: into the slab (else out of it).
        pool: the HOST or GPU pool on the other side (block-major, or a layer-major GPU pool).
        blocks: pool block per job.
        slots: file slot per job.
        keys: content key to write / expected, per job.
        gens: generation to write / expected, per job.
        stream: offload/onboard stream for GPU<->staging copies; ``None`` for host pools.
        copier: the engine's copier (gathers / scatters a layer-major GPU block).
    """

    lane: Stream | None = None  # completion by callback: later copies wait for it on the loop

    def __init__(self, io: SlabIO, write: bool, pool: BlockPool | LayerMajorPool, blocks: list[int], slots: list[int],
                 keys: list[Key], gens: list[int], stream: Stream | None, copier: Copier | None = None) -> None:
        self.io = io
        self.write = write
        self.layer_major = pool if isinstance(pool, LayerMajorPool) else None
        self._side = pool if isinstance(pool, BlockPool) else None
        self.pool = pool.tensor if isinstance(pool, BlockPool) else torch.empty(0)
        if self.layer_major is not None and copier is None:
            raise ValueError("copies between a layer-major pool and the file tier need the engine's copier")
        self.copier = copier
        self.blocks = blocks
        self.slots = slots
        self.keys = keys
        self.gens = gens
        self.stream = stream
        # GDS straight from/to the GPU block: only for block-major pools (a layer-major block is not one region)
        # (and never a read that may outlive its deadline: it would write into the GPU block after the copy failed)
        self.direct_device = (
            stream is not None and io.backend.device_io and self.layer_major is None and (write or io.bounce is None)
        )
        self._lock = threading.Lock()
        self._left = len(slots)
        self._error: BaseException | None = None
        self._done: Done | None = None
        self._hdrs = np.empty((0, HEADER_SIZE), dtype=np.uint8)
        self._pool_np = np.empty(0, dtype=np.uint8)
        # host-pool reads: the next block to start, reads it may still start, whether a thread is starting them
        self._next = 0
        self._credit = 0
        self._pumping = False
        self._bounces: dict[int, np.ndarray] = {}  # host-pool read j -> its bounce buffer

    # entry point ------------------------------------------------------------------------------

    def start(self, done: Done) -> None:
        """Hand the launch to a worker thread and return: the loop thread does O(1) work per transfer.

        Args:
            done: called once with ``None`` or the error, from whichever thread finishes last.
        """
        self._done = done
        if not self.slots:
            done(None)
            return
        self.io.workers.submit(self._launch).add_done_callback(self._launch_failed)

    def abort(self, error: BaseException) -> None:
        """Called instead of :meth:`start` (``Job.abort``): a write's claimed slots are given up, nothing was read."""
        if self.write:
            self.io.index.finish_write(self.slots, self.gens, False)
        self.io.counters.add(**({"wf": len(self.slots)} if self.write else {"rf": len(self.slots)}))

    def _launch_failed(self, fut: concurrent.futures.Future[None]) -> None:
        exc = fut.exception()
        if exc is not None:  # only a bug or an allocation failure (staging) gets here
            with self._lock:
                started = self._left != len(self.slots) or self._error is not None
            if not started:
                if self.write:
                    self.io.index.finish_write(self.slots, self.gens, False)
                assert self._done is not None
                self._done(TransferError(f"starting a file copy of {len(self.slots)} blocks failed: {exc!r}"))

    def _launch(self) -> None:
        ring = self.io.ring() if self.stream is not None else None
        n = len(self.slots)
        self._hdrs = aligned_empty(HEADER_SIZE * n).numpy().reshape(n, HEADER_SIZE)  # one aligned header per block
        if ring is None:
            self._pool_np = self.pool.reshape(self.pool.shape[0], -1).view(torch.uint8).numpy()  # block -> bytes
            if not self.write:
                self._pump(self.io.reads_in_flight)
                return
            for j in range(n):
                self._step(j, None, step=self._run_host)
            return
        for first in range(0, n, ring.group):  # a group of staging blocks crosses the link in one stream op
            js = list(range(first, min(n, first + ring.group)))
            ring.acquire_group(len(js), functools.partial(self._run_group, js))

    def _step(self, j: int, buf: int | None, step: Step) -> None:
        """Run ``step(j, buf)`` unless the batch already failed; an exception in it fails block ``j``."""
        if self._error is not None:  # fail fast: do not start more blocks after one failed
            self._job_done(j, buf, None)
            return
        try:
            step(j, buf)
        except BaseException as exc:  # reported through done()
            self._job_done(j, buf, exc)

    # host pools ---------------------------------------------------------------------------------

    def _run_host(self, j: int, buf: int | None) -> None:
        # numpy views: a few hundred ns per block, where torch indexing costs microseconds
        payload = self._pool_np[self.blocks[j]]
        # Checksum on the launcher thread (xxh3 runs at ~15 GB/s, above any single disk, and releases the
        # GIL), so the I/O threads only do I/O and keep as many requests in flight as raw pwritev would.
        self._write(j, buf, payload, payload)

    # file -> host pool: a window of reads in flight, each verified on a worker ------------------------------

    def _pump(self, credit: int) -> None:
        """Start up to ``credit`` more host-pool reads (one per finished read, ``reads_in_flight`` at launch).

        Only a window of reads is started, not the whole batch: a started read holds a future, a work item and
        a callback until it is done, and a thousand of them outlive the young GC generations and set off full
        collections (~150 ms with the GIL held in a process that imported torch), which stall every I/O
        thread. A few per thread keep each one busy.
        One thread at a time starts reads; a call while another thread does only adds its credit (so a backend
        that completes inline cannot recurse).
        """
        n = len(self.slots)
        with self._lock:
            self._credit += credit
            if self._pumping:
                return
            self._pumping = True
        while True:
            with self._lock:
                skip = self._error is not None  # fail fast: after a failure the rest finish unread
                if self._next >= n or (self._credit <= 0 and not skip):
                    self._pumping = False
                    return
                j = self._next
                self._next = j + 1
                if not skip:
                    self._credit -= 1
            if skip:
                self._job_done(j, None, None)
                continue
            try:
                fut = self.io.backend.pread(
                    self._host_read_buffers(j),
                    self.io.geometry.offset(self.slots[j]),
                    after=functools.partial(self._read_check, j),
                )
            except BaseException as exc:  # reported through done(); the rest then finish unread
                self._give_bounce(j, None)
                self._job_done(j, None, exc)
                continue
            fut.add_done_callback(functools.partial(self._host_read_done, j))

    def _host_read_buffers(self, j: int) -> list[Buffer]:
        pad = self.io.trash_pad
        payload = self._pool_np[self.blocks[j]]
        if self.io.bounce is not None:
            payload = self._bounces[j] = self.io.bounce.take()
        return [self._hdrs[j], payload] if pad is None else [self._hdrs[j], payload, pad]

    def _read_check(self, j: int, n: int) -> None:
        """On the I/O thread, right after the read of block ``j`` (``n`` bytes): the length only.

        The checksum runs on a tier worker (``_host_verify``), not here: under load xxh3 of a cache-cold MiB
        takes ~120 us and the header checks ~50 us more, during which this thread would start no read (the gap
        between one thread's reads grows from ~50 to ~210 us).
        """
        check_read_length(self.io.geometry, self.slots[j], n)

    def _host_read_done(self, j: int, fut: Completion) -> None:
        """Block ``j`` was read (or failed): verify it on a worker; the verification starts the next read."""
        try:
            fut.result()
        except BaseException as exc:  # reported through done()
            self._give_bounce(j, exc)
            self._job_done(j, None, exc)
            self._pump(1)
            return
        try:
            self.io.workers.submit(self._host_verify, j)
        except BaseException as exc:  # reported through done()
            self._job_done(j, None, exc)
            self._pump(1)

    def _host_verify(self, j: int) -> None:
        """On a tier worker: verify block ``j`` (header and xxh3-128 payload checksum); it is good only if so."""
        bounce = self._bounces.get(j)
        try:
            if self._error is None:  # after a failure the block is not reported good anyway (see _job_done)
                block = self._pool_np[self.blocks[j]]
                self._verify(j, self._hdrs[j], block if bounce is None else bounce)
                if bounce is not None:  # verified, and read in time: only now does the pool block change
                    np.copyto(block, bounce)
        except BaseException as exc:  # reported through done()
            self._give_bounce(j, None)
            self._job_done(j, None, exc)
        else:
            self._give_bounce(j, None)
            self._job_done(j, None, None)
        self._pump(1)

    def _give_bounce(self, j: int, exc: BaseException | None) -> None:
        """Give read ``j``'s bounce buffer back once no call may write into it any more."""
        bounce = self._bounces.pop(j, None)
        if bounce is not None:
            pool = self.io.bounce
            assert pool is not None
            after_io(exc, lambda: pool.give(bounce))

    # GPU pools through staging, a group of blocks per stream op -------------------------------------

    def _run_group(self, js: list[int], bufs: list[int]) -> None:
        """Blocks ``js`` hold staging blocks ``bufs``: start their group (all of it, or none after a failure)."""
        if not bufs:  # the ring cannot give this many: too many of its blocks are held by calls past their deadline
            exc = FileTimeout("no staging block for this copy: the ring's blocks are held by file I/O calls that "
                              "outlived their deadline (a stalled disk or a hung mount?)")
            for j in js:
                self._job_done(j, None, exc)
            return
        if self._error is not None:  # fail fast: do not start more groups after a block failed
            for j, buf in zip(js, bufs, strict=True):
                self._job_done(j, buf, None)
            return
        if self.write:  # GPU blocks -> staging in one op; then one pwrite per block
            self._link(js, bufs, to_staging=True, then=self._write_group)
            return
        group = _Group(js, bufs)
        for k in range(len(js)):
            self._read_member(group, k)

    def _write_group(self, js: list[int], bufs: list[int]) -> None:
        """The group is staged: each block is checksummed and its ``pwrite`` started on a tier worker.

        Not on the I/O threads, which then only write (like host pools): a staged MiB just written by the
        device is cache-cold, and its xxh3 takes 230-260 us on an H100 host, about a sixth of each I/O thread's
        time at 1 MiB (GPU->file runs at 0.70-0.76x raw ``pwritev`` with it there, at raw speed without).
        One task per block, so a group's checksums run on all workers at once.
        """
        for j, buf in zip(js, bufs, strict=True):
            try:
                self.io.workers.submit(self._step, j, buf, self._write_staged)
            except BaseException as exc:  # the tier is closing: reported through done()
                self._job_done(j, buf, exc)

    def _write_staged(self, j: int, buf: int | None) -> None:
        assert buf is not None
        staging = self.io.ring().array[buf]
        self._write(j, buf, self._gpu_block(j) if self.direct_device else staging, staging)

    def _read_member(self, group: _Group, k: int) -> None:
        """Read (and, unless GDS, verify) member ``k`` of a read group; the group crosses the link when all are in.

        Every member of a started group is read and verified, also after another block failed: the group's
        verified blocks land together (a block that failed verification is left out of the group's op).
        """
        io, geo = self.io, self.io.geometry
        j, buf = group.js[k], group.bufs[k]
        hdr = self._hdrs[j]
        staging = io.ring().array[buf]  # a numpy row: no torch call per block

        def failed(exc: BaseException) -> None:
            self._job_done(j, buf, exc)
            self._member_in(group, k, ok=False)

        def check(n: int) -> None:
            check_read_length(geo, self.slots[j], n)

        def read(_: object) -> None:
            if self.direct_device:  # GDS: the GPU block was read; it is verified after the group's staged copy
                self._member_in(group, k, ok=True)
                return
            _chain(
                io.workers.submit(self._verify, j, hdr, staging), lambda _: self._member_in(group, k, ok=True), failed
            )

        try:
            payload: Buffer = self._gpu_block(j) if self.direct_device else staging
            pad = [io.trash_pad] if io.trash_pad is not None else []
            fut = io.backend.pread([hdr, payload, *pad], geo.offset(self.slots[j]), after=check)
        except BaseException as exc:  # reported through done()
            failed(exc)
            return
        _chain(fut, read, failed)

    def _member_in(self, group: _Group, k: int, *, ok: bool) -> None:
        """Member ``k`` of a read group is read and verified (``ok``) or failed; the last one sends the group on."""
        with self._lock:
            if ok:
                group.good.append(k)
            group.left -= 1
            last = group.left == 0
        if not last or not group.good:
            return
        good = sorted(group.good)
        js = [group.js[k] for k in good]
        bufs = [group.bufs[k] for k in good]
        if not self.direct_device:  # staging -> GPU blocks in one op; a block is done when the op is
            self._link(js, bufs, to_staging=False, then=self._blocks_done)
        else:  # GDS: GPU blocks -> staging in one op, then each staged copy is verified
            self._link(js, bufs, to_staging=True, then=self._verify_group)

    def _verify_group(self, js: list[int], bufs: list[int]) -> None:
        ring = self.io.ring()
        for j, buf in zip(js, bufs, strict=True):
            fut = self.io.workers.submit(self._verify, j, self._hdrs[j], ring.array[buf])
            _chain(fut, functools.partial(self._ok, j, buf), functools.partial(self._job_done, j, buf))

    def _ok(self, j: int, buf: int, _: object) -> None:
        self._job_done(j, buf, None)

    def _blocks_done(self, js: list[int], bufs: list[int]) -> None:
        for j, buf in zip(js, bufs, strict=True):
            self._job_done(j, buf, None)

    def _link(
        self, js: list[int], bufs: list[int], *, to_staging: bool, then: Callable[[list[int], list[int]], None]
    ) -> None:
        """One stream op: GPU blocks of ``js`` -> staging blocks ``bufs`` (or back), and one completion.

        The completion runs ``then(js, bufs)`` on the stream's waiter thread. If the op fails, every block of
        it fails with that error (and ``then`` does not run). Never raises: a failure fails the blocks.
        """
        stream = self.stream
        assert stream is not None
        failure: list[BaseException] = []

        def fail_all(exc: BaseException) -> None:
            for j, buf in zip(js, bufs, strict=True):
                self._job_done(j, buf, exc)

        def run() -> None:
            try:
                with self._cuda_device():
                    op()
            except BaseException as exc:  # reported by the completion below
                failure.append(exc)

        def landed() -> None:
            if failure:
                fail_all(failure[0])
                return
            try:
                then(js, bufs)
            except BaseException as exc:  # a bug; do not strand the group
                fail_all(exc)

        try:
            op, explicit = self._group_op([self.blocks[j] for j in js], bufs, to_staging)
            stream.submit(run, explicit=explicit)
            stream.notify(landed)
        except BaseException as exc:  # reported through done()
            fail_all(exc)

    def _group_op(self, blocks: list[int], bufs: list[int], to_staging: bool) -> tuple[Callable[[], None], bool]:
        """The op copying ``blocks`` of the GPU pool to/from staging ``bufs``, and whether it names its stream."""
        return group_copy_op(
            device=self.io.device,
            ring=self.io.ring(),
            pool=self.pool,
            side=self.layer_major if self.layer_major is not None else self._side,
            copier=self.copier,
            stream=self.stream,
            blocks=blocks,
            bufs=bufs,
            to_staging=to_staging,
        )

    def _gpu_block(self, j: int) -> torch.Tensor:
        """Block ``j`` of a block-major GPU pool as bytes (the I/O buffer of GDS)."""
        return self.pool[self.blocks[j]].reshape(-1).view(torch.uint8)

    def _cuda_device(self) -> contextlib.AbstractContextManager[Any]:
        dev = self.io.device
        return torch.cuda.device(dev.torch_device) if dev.is_cuda else contextlib.nullcontext()

    # steps -----------------------------------------------------------------------------------------

    def _write(self, j: int, buf: int | None, payload: Buffer, host_payload: Buffer) -> None:
        """Fill slot ``j``'s header (checksum of ``host_payload``) on this thread, then start its ``pwrite``."""
        io, geo, hdr = self.io, self.io.geometry, self._hdrs[j]
        pack_header(
            hdr.data,
            geo.fingerprint,
            self.slots[j],
            self.gens[j],
            self.keys[j],
            geo.payload_bytes,
            payload_checksum(host_payload),
        )
        bufs = [hdr, payload] + ([io.zero_pad] if io.zero_pad is not None else [])
        fut = io.backend.pwrite(bufs, geo.offset(self.slots[j]))

        def written(n: int) -> None:
            if n != geo.slot_size:
                raise TransferError(f"short write to file slot {self.slots[j]}: {n} of {geo.slot_size} bytes")
            self._job_done(j, buf, None)

        self._then(fut, j, buf, written)

    def _verify(self, j: int, hdr: np.ndarray, payload: Buffer) -> None:
        verify_slot(self.io.geometry, self.io.index, self.slots[j], self.keys[j], self.gens[j], hdr, payload)

    def _then(
        self, fut: Completion | concurrent.futures.Future[Any], j: int, buf: int | None, fn: Callable[[Any], None]
    ) -> None:
        """When ``fut`` is done: ``fn(result)`` on success, else finish job ``j`` with the error."""

        def cb(f: Any) -> None:
            try:
                value = f.result()
            except BaseException as exc:  # reported through done()
                self._job_done(j, buf, exc)
                return
            self._step(j, buf, step=lambda j, buf: fn(value))

        fut.add_done_callback(cb)

    # completion ------------------------------------------------------------------------------------

    def _job_done(self, j: int, buf: int | None, exc: BaseException | None) -> None:
        io = self.io
        slot = self.slots[j]
        if exc is not None:
            exc = self._wrap(slot, exc)
            if isinstance(exc, IntegrityError) and not self.write:
                io.index.drop_if(slot, self.gens[j])
                io.counters.add(**{"if": 1, "rf": 1})
            else:
                io.counters.add(**({"wf": 1} if self.write else {"rf": 1}))
        elif self._error is None:
            # success of this block (the transfer may still fail on another one)
            nbytes = io.geometry.payload_bytes
            io.counters.add(**({"nw": 1, "bw": nbytes} if self.write else {"nr": 1, "br": nbytes}))
        if buf is not None:
            io.ring().release_after(buf, exc)
        with self._lock:
            if exc is not None and self._error is None:
                self._error = exc
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def _wrap(self, slot: int, exc: BaseException) -> BaseException:
        return slot_error(self.write, slot, exc, self.io.backend, self.io.geometry)

    def _finish(self) -> None:
        io = self.io
        error = self._error
        assert self._done is not None
        if not self.write:
            self._done(error)
            return
        if error is not None or io.durability is Durability.NONE:
            io.index.finish_write(self.slots, self.gens, error is None)
            self._done(error)
            return

        def synced(f: Completion) -> None:
            err: BaseException | None = None
            try:
                f.result()
            except BaseException as exc:  # reported through done()
                err = self._wrap(self.slots[0], exc)
            io.index.finish_write(self.slots, self.gens, err is None)
            assert self._done is not None
            self._done(err)

        try:
            io.backend.sync(io.durability is Durability.FLUSH).add_done_callback(synced)
        except BaseException as exc:  # reported through done()
            io.index.finish_write(self.slots, self.gens, False)
            self._done(self._wrap(self.slots[0], exc))

    def __repr__(self) -> str:
        return f"<FileCopy {'write' if self.write else 'read'} blocks:{len(self.slots)} left:{self._left}>"


class _Group:
    """A read group: its blocks, their staging blocks, and which members are in (under the copy's lock)."""

    __slots__ = ("bufs", "good", "js", "left")

    def __init__(self, js: list[int], bufs: list[int]) -> None:
        self.js = js
        self.bufs = bufs
        self.left = len(js)
        self.good: list[int] = []  # members read and verified


def _chain(
    fut: Completion | concurrent.futures.Future[Any], ok: Callable[[Any], None], failed: Callable[[BaseException], None]
) -> None:
    """When ``fut`` is done: ``ok(result)``, or ``failed(error)`` if it (or ``ok``) raised."""

    def cb(f: Any) -> None:
        try:
            value = f.result()
        except BaseException as exc:  # reported through failed()
            failed(exc)
            return
        try:
            ok(value)
        except BaseException as exc:  # reported through failed()
            failed(exc)

    fut.add_done_callback(cb)
