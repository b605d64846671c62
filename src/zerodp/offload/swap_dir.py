"""Swap directories of the NVMe offload (``nvme_path/zerodp_<job>/rank<r>/``): who owns them, their
removal when the job is killed by SIGTERM or SIGINT, and the ones left by a job that died without a
chance (SIGKILL, power loss).

- Owner record: each rank directory holds ``owner.json`` (host name, pid, the process's start time
  in clock ticks since boot from ``/proc/<pid>/stat`` and the kernel's boot id), written before any
  swap file is created.
- SIGTERM / SIGINT: when the first swap directory of a process is made in its main thread, handlers
  are installed for both (a signal whose handler is ``SIG_IGN`` is left alone). The handler removes
  the names of this process's swap files and directories (the open files stay readable by this
  process until it exits, so a ``KeyboardInterrupt`` handler can still save a checkpoint; training
  cannot go on: the next step reports the deleted file), then does what the previous handler did:
  a Python handler is called (SIGINT's default raises ``KeyboardInterrupt``), ``SIG_DFL`` is
  restored and the signal re-sent, so the process ends with the signal's status. torchrun's agent
  forwards the signal it gets to its workers, so this also covers ``timeout``/a scheduler stopping
  ``torchrun``. A rank busy in one long C call (a collective waiting for a dead peer) runs the
  handler when that call returns.
- Stale directories: at the start of an offload, the job directories under ``nvme_path`` are read;
  one whose every rank directory has an owner record on this host whose process is gone (no such
  pid, another start time, or another boot) is stale. Rank 0 of each host names them with their
  allocated bytes in one warning, and removes them when ``remove_stale_swap`` is true or when the
  user runs ``zerodp clean-swap PATH``. A directory without an owner record (being made, or by
  another zerodp version), or owned on another host, is never judged stale.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import threading
import warnings
from dataclasses import dataclass
from typing import Any

OWNER_FILE = "owner.json"
JOB_PREFIX = "zerodp_"
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_live: dict[str, list] = {}  # rank directory -> its swap-file list (objects with .path), this process
_previous: dict[int, Any] = {}  # signal -> the handler ours replaced
_lock = threading.Lock()
_announced: set[str] = set()  # nvme paths already checked by this process


def _start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks after boot (``/proc/<pid>/stat`` field 22), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def owner_record() -> dict[str, Any]:
    """This process's owner record: host, pid, start ticks, boot id."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": _start_ticks(pid), "boot": _boot_id()}


def owner_alive(rec: dict[str, Any]) -> bool | None:
    """True if the process of owner record ``rec`` runs, False if it is gone, None if that cannot be
    told here (another host)."""
    if rec.get("host") != socket.gethostname():
        return None
    if rec.get("boot") and rec.get("boot") != _boot_id():
        return False
    start = _start_ticks(int(rec["pid"]))
    return start is not None and (rec.get("start") is None or start == rec["start"])


def make_rank_dir(base: str, job: str, rank: int, files: list) -> str:
    """Create ``base/zerodp_<job>/rank<rank>/`` with this process's owner record; ``files`` (the
    swap files that will live there, appended by the caller) are unlinked on SIGTERM / SIGINT."""
    directory = os.path.join(base, f"{JOB_PREFIX}{job}", f"rank{rank}")
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{OWNER_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(owner_record(), f)
    os.replace(tmp, os.path.join(directory, OWNER_FILE))
    with _lock:
        _live[directory] = files
    _install_handlers()
    return directory


def release(directory: str) -> None:
    """Remove ``directory``'s owner record and the directory, and its job directory once empty (the
    swap files in it are removed by the caller first)."""
    with _lock:
        _live.pop(directory, None)
    with contextlib.suppress(OSError):
        os.remove(os.path.join(directory, OWNER_FILE))
    with contextlib.suppress(OSError):
        os.rmdir(directory)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(directory))  # the job directory, once every rank's is gone


def unlink_live() -> None:
    """Remove the names of every swap file and directory this process owns (open files stay usable)."""
    with _lock:
        live = list(_live.items())
    for directory, files in live:
        for f in list(files):
            if f is not None:
                with contextlib.suppress(OSError):
                    os.remove(f.path)
        release(directory)


def _on_signal(signum: int, frame: Any) -> None:
    unlink_live()
    prev = _previous.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
        return
    if prev == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    """Install :func:`_on_signal` for SIGTERM and SIGINT once, from the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in HANDLED_SIGNALS:
        if sig in _previous:
            continue
        current = signal.getsignal(sig)
        if current == signal.SIG_IGN or current is _on_signal:
            continue
        _previous[sig] = current
        signal.signal(sig, _on_signal)


@dataclass(frozen=True)
class StaleDir:
    """A job directory left by processes that are gone: ``path``, allocated ``bytes``, ``owners``."""

    path: str
    bytes: int
    owners: tuple[str, ...]


def _allocated(path: str) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, n)).st_blocks * 512
    return total


def find_stale(base: str) -> list[StaleDir]:
    """Job directories under ``base`` whose every rank directory has an owner record on this host
    whose process is gone (module docstring); others are never listed."""
    out: list[StaleDir] = []
    try:
        entries = sorted(e.path for e in os.scandir(base) if e.name.startswith(JOB_PREFIX) and e.is_dir())
    except OSError:
        return out
    for job_dir in entries:
        try:
            ranks = [e.path for e in os.scandir(job_dir) if e.is_dir()]
        except OSError:
            continue
        owners: list[str] = []
        for rank_dir in ranks:
            try:
                with open(os.path.join(rank_dir, OWNER_FILE)) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                rec = None
            if not isinstance(rec, dict) or "pid" not in rec or owner_alive(rec) is not False:
                owners = []
                break
            owners.append(f"{rec.get('host')}:{rec['pid']}")
        if owners:
            out.append(StaleDir(job_dir, _allocated(job_dir), tuple(owners)))
    return out


def remove_stale(base: str) -> list[StaleDir]:
    """Remove the stale job directories under ``base`` (each judged again just before); returns them."""
    removed = []
    for s in find_stale(base):
        shutil.rmtree(s.path, ignore_errors=True)
        removed.append(s)
    return removed


def describe(stale: list[StaleDir]) -> str:
    return "; ".join(f"{s.path} ({s.bytes:,} bytes, owner {', '.join(s.owners)})" for s in stale)


def check_stale(base: str, remove: bool, key: str, rank: int) -> None:
    """At an offload's start: rank 0 of this host (``LOCAL_RANK``, else ``rank``) warns once per
    process and path about stale job directories under ``base``, and removes them when ``remove``."""
    local = int(os.environ.get("LOCAL_RANK", rank))
    if local != 0 or base in _announced:
        return
    _announced.add(base)
    stale = find_stale(base)
    if not stale:
        return
    total = sum(s.bytes for s in stale)
    if remove:
        remove_stale(base)
        warnings.warn(
            f"{key} {base!r}: removed {len(stale)} swap director{'y' if len(stale) == 1 else 'ies'} "
            f"left by jobs whose processes are gone ({total:,} bytes): {describe(stale)}",
            stacklevel=3,
        )
        return
    warnings.warn(
        f"{key} {base!r} holds {len(stale)} swap director{'y' if len(stale) == 1 else 'ies'} left by "
        f"jobs whose processes are gone, {total:,} bytes in all: {describe(stale)}. Remove them with "
        f"`zerodp clean-swap {base}` or set {key.rsplit('.', 1)[0]}.remove_stale_swap true",
        stacklevel=3,
    )


__all__ = [
    "OWNER_FILE",
    "StaleDir",
    "check_stale",
    "describe",
    "find_stale",
    "make_rank_dir",
    "owner_alive",
    "owner_record",
    "release",
    "remove_stale",
    "unlink_live",
]
