"""What optimizer swapping (:mod:`.nvme`, ``offload_optimizer``) and parameter swapping (:mod:`.param_swap`,
``offload_param``) agree on across ranks for their swap directory ``<nvme_path>/zerodp_<job>/rank<r>/``
(ownership, signals and stale directories: :mod:`.swap_dir`).

- :func:`agree_job_id`: one id for the whole job (rank 0's random 62-bit value, broadcast; 16 hex digits).
- :func:`raise_if_any_rank_failed`: collective; every rank raises :class:`OffloadError` naming every
  rank's error, so a bad path on one rank stops all of them at the same call.
- :func:`remove_swap_dir`: closes and deletes the swap files, then the rank's owner record and directory
  and, once every rank's is gone, the job directory (each step ignores ``OSError``; run by a finalizer).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile

import torch
import torch.distributed as dist

from zerodp.offload.aio import SwapFile
from zerodp.offload.swap_dir import check_stale, make_rank_dir, release
from zerodp.runtime import control


class OffloadError(RuntimeError):
    """The NVMe swap space is unusable (path, permissions, free space, a deleted swap file)."""


def remove_swap_dir(directory: str, files: list[SwapFile | None]) -> None:
    """Close and delete ``files`` (None entries skipped), then ``directory`` (:func:`.swap_dir.release`)."""
    for f in files:
        if f is not None:
            f.close()
            with contextlib.suppress(OSError):
                os.remove(f.path)
    release(directory)


def check_swap_dir(base: str, key: str) -> None:
    """Refuse a swap directory ``base`` (config key ``key``) that is missing or where a file cannot be
    created: a probe file is created and removed (permission bits alone miss root, read-only mounts and
    pseudo file systems such as /proc or /sys).

    Raises:
        OffloadError: naming the key, the path and the OS error.
    """
    if not os.path.isdir(base):
        raise OffloadError(f"{key} {base!r} does not exist or is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".zerodp_probe_", dir=base)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise OffloadError(
            f"{key} {base!r} is not writable: creating a file there failed with "
            f"[Errno {exc.errno}] {exc.strerror}; give a writable directory on the NVMe disk"
        ) from None


def check_swap_space(base: str, needed: int, key: str) -> None:
    """Refuse a swap directory ``base`` (config key ``key``) that :func:`check_swap_dir` refuses or that
    has fewer than ``needed`` bytes free.

    Raises:
        OffloadError: naming the key, the path and the OS error, or the bytes needed and free.
    """
    check_swap_dir(base, key)
    free = shutil.disk_usage(base).free
    if needed > free:
        raise OffloadError(f"{key} {base!r}: the swap file needs {needed:,} bytes, {free:,} bytes are free")


def allocate_swap_file(file: SwapFile, needed: int, fast_init: bool, key: str, base: str) -> None:
    """Give ``file`` its ``needed`` bytes: ``ftruncate`` with ``fast_init`` (sparse), else ``posix_fallocate``.

    Raises:
        OffloadError: the allocation failed (names the key, the path, the bytes needed and free, the reason).
    """
    try:
        if fast_init:
            os.ftruncate(file.fd, needed)
        elif needed:
            os.posix_fallocate(file.fd, 0, needed)
    except OSError as exc:
        raise OffloadError(
            f"{key} {base!r}: cannot allocate the swap file {file.path} ({needed:,} bytes, "
            f"{shutil.disk_usage(base).free:,} free): {os.strerror(exc.errno or 0)}"
        ) from None


def open_rank_file(
    base: str,
    job: str,
    rank: int,
    name: str,
    needed: int,
    fast_init: bool,
    remove_stale: bool,
    key: str,
    files: list[SwapFile | None],
) -> tuple[str, SwapFile]:
    """Create ``base/zerodp_<job>/rank<rank>/<name>`` with ``needed`` bytes (config key ``key``), after
    the checks of :func:`check_swap_space` and :func:`zerodp.offload.swap_dir.check_stale`; the file
    is appended to ``files`` (removed with the directory on SIGTERM/SIGINT). Returns (directory, file);
    if creating or allocating the file fails, the directory is removed before the error propagates.

    Raises:
        OffloadError: as :func:`check_swap_space`, :func:`check_stale` and :func:`allocate_swap_file`.
    """
    check_swap_space(base, needed, key)
    check_stale(base, remove_stale, key, rank)
    rank_dir = make_rank_dir(base, job, rank, files)  # owner record; unlinked on SIGTERM/SIGINT
    try:
        file = SwapFile(os.path.join(rank_dir, name))
        files.append(file)
        allocate_swap_file(file, needed, fast_init, key, base)
    except BaseException:
        remove_swap_dir(rank_dir, files)
        raise
    return rank_dir, file


def agree_job_id(pg: dist.ProcessGroup | None) -> str:
    """Collective: one id for the whole job, rank 0's random value, broadcast (16 hex digits)."""
    t = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size(pg) > 1:
        src = dist.get_global_rank(pg, 0) if pg is not None else 0
        dist.broadcast(t, src, group=control.route(t, pg))
    return f"{int(t.item()):016x}"


def raise_if_any_rank_failed(error: str | None, pg: dist.ProcessGroup | None) -> None:
    """Collective: if any rank has an error, every rank raises :class:`OffloadError` with all of them.

    Raises:
        OffloadError: some rank passed a non-empty ``error``; the message joins every rank's with "; ".
    """
    if not dist.is_initialized() or dist.get_world_size(pg) == 1:
        if error:
            raise OffloadError(error)
        return
    flag = torch.tensor([1 if error else 0], dtype=torch.int64)
    dist.all_reduce(flag, group=control.route(flag, pg))
    if flag.item():
        errors: list[str | None] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(errors, error, group=pg)
        raise OffloadError("; ".join(e for e in errors if e))


__all__ = [
    "OffloadError",
    "agree_job_id",
    "allocate_swap_file",
    "check_swap_dir",
    "check_swap_space",
    "raise_if_any_rank_failed",
    "remove_swap_dir",
]
