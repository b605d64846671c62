"""Asynchronous direct file I/O: a fixed thread pool issuing ``os.preadv``/``os.pwritev`` on files
opened with ``O_DIRECT``, into page-aligned host buffers.

DeepSpeed key: ``aio`` (``block_size``, ``queue_depth``, ``thread_count``, ``single_submit``,
``overlap_events``; see :class:`zerodp.offload.config.AioConfig`). A transfer is cut into requests of
``block_size`` bytes; one system call carries up to ``queue_depth`` consecutive requests as an I/O
vector (one with ``single_submit``); ``thread_count`` threads run the calls, which release the GIL, so
transfers proceed while the caller computes. Errors (a short read, ``ENOSPC``, ``EIO``) are raised by
:meth:`IOHandle.wait` with the file, offset and byte count.

``O_DIRECT`` needs the buffer address, the file offset and the length to be multiples of the logical
block size; :data:`ALIGN` (4096) covers every common device. A file system without direct I/O
(tmpfs) falls back to buffered I/O; :attr:`SwapFile.direct` says which one is in use.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from zerodp.offload.config import AioConfig
from zerodp.runtime.device import host_empty

ALIGN = 4096


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def aligned_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` (rounded up to :data:`ALIGN`) whose address is aligned;
    page-locked when ``pin`` and CUDA is present (:func:`zerodp.runtime.device.host_empty`)."""
    n = align_up(nbytes)
    raw = host_empty(n + ALIGN, torch.uint8, pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + n]


class SwapFile:
    """One swap file opened for direct I/O (buffered when the file system refuses ``O_DIRECT``).

    Raises:
        OSError: the file cannot be created (the message names the path).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        flags = os.O_RDWR | os.O_CREAT
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.direct = False
            self.fd = os.open(path, flags, 0o600)

    def deleted(self) -> bool:
        """True when the file was unlinked (or replaced) while open."""
        try:
            return os.fstat(self.fd).st_nlink == 0 or os.stat(self.path).st_ino != os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class IOHandle:
    """The requests of one transfer; :meth:`wait` blocks until all are done and raises on error."""

    futures: list[Future] = field(default_factory=list)
    nbytes: int = 0

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> int:
        for f in self.futures:
            f.result()
        self.futures = []
        return self.nbytes


class AsyncIO:
    """The thread pool. ``read``/``write`` return at once with an :class:`IOHandle`.

    ``busy_seconds``: wall time during which at least one request was in flight (the union of the
    requests' intervals), so ``bytes / busy_seconds`` is the bandwidth while transferring, apart from
    the time the caller left the disk idle. Its threads take the calls in the order they were
    submitted: the NVMe optimizer offload queues each sub-group's gradient read (``gradients.swp``)
    right behind its region's read in its pool, so the two land together."""

    def __init__(self, cfg: AioConfig) -> None:
        self.block = cfg.block_size
        self.per_call = 1 if cfg.single_submit else cfg.queue_depth
        self.pool = ThreadPoolExecutor(max_workers=cfg.thread_count, thread_name_prefix="zerodp-aio")
        self.bytes_read = 0
        self.bytes_written = 0
        self.busy_seconds = 0.0
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0

    def read(self, f: SwapFile, buf: torch.Tensor, offset: int) -> IOHandle:
        """Fill ``buf`` (aligned uint8 host tensor) from ``f`` at byte ``offset``."""
        self.bytes_read += buf.numel()
        return self._submit(f, buf, offset, write=False)

    def write(self, f: SwapFile, buf: torch.Tensor, offset: int) -> IOHandle:
        """Write ``buf`` (aligned uint8 host tensor) to ``f`` at byte ``offset``."""
        self.bytes_written += buf.numel()
        return self._submit(f, buf, offset, write=True)

    def _submit(self, f: SwapFile, buf: torch.Tensor, offset: int, write: bool) -> IOHandle:
        if offset % ALIGN or buf.numel() % ALIGN or buf.data_ptr() % ALIGN:
            raise ValueError(
                f"direct I/O needs {ALIGN}-byte alignment: offset {offset}, "
                f"{buf.numel()} bytes at address {buf.data_ptr():#x}"
            )
        mv = memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers; typeshed's Buffer misses it
        handle = IOHandle(nbytes=buf.numel())
        span = self.block * self.per_call
        for start in range(0, buf.numel(), span):
            views = [
                mv[s : min(s + self.block, start + span, buf.numel())]
                for s in range(start, min(start + span, buf.numel()), self.block)
            ]
            handle.futures.append(self.pool.submit(self._timed, f, views, offset + start, write))
        return handle

    def _timed(self, f: SwapFile, views: list[memoryview], offset: int, write: bool) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1
        try:
            _transfer(f, views, offset, write)
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self.busy_seconds += time.perf_counter() - self._busy_since

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _transfer(f: SwapFile, views: list[memoryview], offset: int, write: bool) -> None:
    want = sum(len(v) for v in views)
    while views:
        try:
            n = os.pwritev(f.fd, views, offset) if write else os.preadv(f.fd, views, offset)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"{'writing' if write else 'reading'} {want} bytes at offset "
                f"{offset} of swap file {f.path}: {os.strerror(exc.errno or 0)}",
            ) from None
        if n == 0:
            raise OSError(
                errno.EIO,
                f"{'writing' if write else 'reading'} swap file {f.path} at offset "
                f"{offset}: end of file ({want} bytes wanted; was it truncated?)",
            )
        # partial transfer: continue after what was done
        while views and n >= len(views[0]):
            n -= len(views[0])
            offset += len(views[0])
            want -= len(views[0])
            views = views[1:]
        if n:
            views[0] = views[0][n:]
            offset += n
            want -= n


__all__ = ["ALIGN", "AsyncIO", "IOHandle", "SwapFile", "align_up", "aligned_buffer"]
