"""Where the slab lives: the directory and its files are checked before they are used, and fail in sentences.

Primitives:

* :func:`prepare_directory` -- create (0700) or check the tier's directory: a path that is a file or a dangling
  symlink, a directory that cannot be created, or one writable by other users without the sticky bit is a
  :class:`~tiered_kv.errors.StorageError` naming the path and what to do.
* :func:`open_owned` -- ``os.open`` with ``O_NOFOLLOW`` (a symlink planted at ``kv.lock`` or ``kv.slab`` is never
  followed) that refuses a file owned by another user.
* :func:`check_space` -- the slab's bytes against the free space of the filesystem, and the index's bytes
  against the machine's memory, before anything is created.
* :func:`storage_error` -- an ``OSError`` (ENOSPC, EROFS, EACCES, ...) as a :class:`~tiered_kv.errors.StorageError`.
* :func:`directory_problem` -- the same checks as a sentence or ``None`` (``tiered-kv doctor``).
* :func:`slab_problem` -- what :class:`~tiered_kv.file.tier.FileTier` checks next in an existing directory (the
  free space, :func:`check_space`; creating a file there, :func:`open_owned`) as a sentence or ``None``
  (``tiered-kv doctor``, so that it refuses what the engine refuses, e.g. ``/proc``).

Why: in a shared directory, a slab planted by another user must never be opened, chmod'ed or served as
verified, and a symlink at ``kv.lock`` must not make the process create a file elsewhere; ENOSPC, a read-only
or missing directory, a ``file_dir`` that is a file, or a ``file_blocks`` too large must fail with a sentence
(not a bare ``OSError`` or a numpy allocation message) and leave no lock file or half-created slab behind.
"""

from __future__ import annotations

import errno
import os
import stat

from ..errors import StorageError

__all__ = ["check_space", "directory_problem", "open_owned", "prepare_directory", "slab_problem", "storage_error"]

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: Index bytes per slot (state, key reference, generation, key bytes when used): a conservative estimate.
INDEX_BYTES_PER_SLOT = 96


def _size(n: int) -> str:
    """A size in bytes with a unit chosen by its magnitude, so that small sizes still show (not "0.00 GiB")."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def storage_error(exc: OSError, path: str | os.PathLike[str], doing: str, size: int | None = None) -> StorageError:
    """``exc`` as a :class:`StorageError` with the path, the size asked (if any) and what to do."""
    what = {
        errno.ENOSPC: "the filesystem is full: free space there or lower file_blocks",
        errno.EDQUOT: "the disk quota is exhausted: free space there or lower file_blocks",
        errno.EFBIG: "the file would be larger than the filesystem allows: lower file_blocks",
        errno.EROFS: "the filesystem is read-only: give file_dir on a writable filesystem",
        errno.EACCES: "permission denied: give file_dir a directory this user can write",
        errno.EPERM: "operation not permitted: give file_dir a directory this user owns",
        errno.ENOENT: "a parent directory does not exist or was removed: create it or give another file_dir",
        errno.ENOTDIR: "a component of the path is not a directory: give file_dir a directory",
        errno.ELOOP: (
            "the path is a symbolic link, which the file tier never follows: remove it or give another file_dir"
        ),
    }.get(exc.errno or 0, "check the path and the filesystem")
    sized = f" ({_size(size)} asked)" if size is not None else ""
    err = StorageError(exc.errno or 0, f"cannot {doing} {os.fspath(path)}{sized}: {exc.strerror or exc}; {what}")
    err.filename = os.fspath(path)
    err.__cause__ = exc
    return err


def directory_problem(directory: str | os.PathLike[str]) -> str | None:
    """Why ``directory`` must not hold a file tier (an existing path only), or ``None`` if it may."""
    path = os.fspath(directory)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None  # it will be created (0700)
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return f"{path} is a dangling symbolic link: remove it or give file_dir an existing directory"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} exists and is not a directory: give file_dir a directory"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return (
            f"{path} is writable by other users (mode {st.st_mode & 0o7777:o}) and not sticky: another user could "
            "replace the slab or plant a symlink; chmod go-w it (or +t), or use a directory of your own"
        )
    return None


def prepare_directory(directory: str | os.PathLike[str]) -> bool:
    """Create ``directory`` (0700) if missing and check it; returns whether it was created here.

    Raises:
        StorageError: see :func:`directory_problem`, or the directory cannot be created.
    """
    problem = directory_problem(directory)
    if problem is not None:
        raise StorageError(errno.EINVAL, problem)
    path = os.fspath(directory)
    if os.path.isdir(path):
        return False
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        return False  # created meanwhile by someone else: checked below on open
    except OSError as exc:
        raise storage_error(exc, path, "create the file tier's directory") from None
    return True


def open_owned(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC)``, refusing a file owned by another user.

    Raises:
        StorageError: the path is a symlink, the file belongs to another user, or the open fails.
    """
    try:
        fd = os.open(path, flags | _O_NOFOLLOW | _O_CLOEXEC, mode)
    except OSError as exc:
        raise storage_error(exc, path, "open") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise StorageError(
            errno.EPERM,
            f"{path} belongs to another user (uid {st.st_uid}, this process runs as uid "
            f"{os.geteuid()}): it is never opened; remove it or use a directory of your own",
        )
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise StorageError(errno.EINVAL, f"{path} is not a regular file: remove it or use another directory")
    return fd


def check_space(slab_path: str, slab_bytes: int, num_slots: int, existing_bytes: int = 0) -> None:
    """Refuse, before anything is created, a slab larger than the free space or an index larger than memory.

    Raises:
        StorageError: with the sizes and what to do.
    """
    path = os.path.dirname(slab_path) or "."
    index_bytes = num_slots * INDEX_BYTES_PER_SLOT
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        memory = 0
    if memory and index_bytes > memory:
        raise StorageError(
            errno.ENOMEM,
            f"file_blocks={num_slots} needs about {_size(index_bytes)} of memory for the slot "
            f"index, more than this machine has ({_size(memory)}): lower file_blocks",
        )
    try:
        vfs = os.statvfs(path)
    except OSError as exc:
        raise storage_error(exc, path, "inspect the filesystem of") from None
    free = vfs.f_bavail * vfs.f_frsize
    grow = slab_bytes - existing_bytes
    if grow > free:
        raise StorageError(
            errno.ENOSPC,
            f"the slab {slab_path} needs {_size(slab_bytes)} "
            f"(file_blocks={num_slots}) but the filesystem has {_size(free)} free: "
            "free space there or lower file_blocks",
        )


def slab_problem(directory: str | os.PathLike[str], slab_bytes: int = 4096) -> str | None:
    """Why the file tier could not create a slab of ``slab_bytes`` in the existing ``directory``, or ``None``.

    The checks :class:`~tiered_kv.file.tier.FileTier` runs after :func:`prepare_directory`: the free space
    (:func:`check_space`) and creating a file there (:func:`open_owned`, as for ``kv.lock``; the probe file is
    removed). Nothing is left behind.
    """
    path = os.fspath(directory)
    try:
        check_space(os.path.join(path, "kv.slab"), slab_bytes, 1)
    except StorageError as exc:
        return exc.strerror or str(exc)
    probe = os.path.join(path, f".tiered_kv-doctor-{os.getpid()}")
    try:
        fd = open_owned(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except StorageError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError as exc:
        return storage_error(exc, probe, "remove a file in").strerror
    return None
