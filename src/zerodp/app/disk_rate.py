"""The disk's own transfer rate over short windows during a run, read from ``/proc/diskstats``
(sectors read and written by every process, 512 bytes each) by a sampling thread.

A step's average rate (bytes / disk busy time) cannot tell a disk that stalls for a while and then runs
at full speed from requests that keep it half busy throughout; the rate per window can. Used by
:mod:`zerodp.app.infinity_run`; ``tools/disk_mix_probe.py --sustained`` gives the same windows for the
disk alone.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time

SECTOR = 512


def diskstats(device: str) -> list[str] | None:
    """``device``'s row of ``/proc/diskstats`` split into fields (index 2 the name, 5 sectors read, 9
    sectors written, 12 ``io_ticks`` ms), None if absent."""
    with open("/proc/diskstats", encoding="ascii") as f:
        for line in f:
            parts = line.split()
            if parts[2] == device:
                return parts
    return None


def disk_bytes(device: str) -> int | None:
    """Bytes read + written by ``device`` since boot (``/proc/diskstats`` sectors), None if absent."""
    row = diskstats(device)
    return None if row is None else (int(row[5]) + int(row[9])) * SECTOR


class DiskRateSampler:
    """A daemon thread that records ``(monotonic s, bytes moved)`` of ``device`` every ``period_s``;
    :meth:`windows` gives the MB/s of each period inside a time span. No-op when ``device`` is None."""

    def __init__(self, device: str | None, period_s: float = 5.0) -> None:
        self.device, self.period_s = device, period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> DiskRateSampler:
        if self.device is not None and disk_bytes(self.device) is not None:
            self._sample()
            self._thread = threading.Thread(target=self._run, name="zerodp-disk-rate", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sample(self) -> None:
        assert self.device is not None  # only started with a device
        moved = disk_bytes(self.device)
        if moved is not None:
            self.samples.append((time.monotonic(), moved))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def windows(self, start: float, end: float) -> list[float]:
        """Bytes/s of each sampling period that lies inside ``[start, end]`` (monotonic seconds)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        return [(b1 - b0) / (t1 - t0) for (t0, b0), (t1, b1) in itertools.pairwise(inside) if t1 > t0]


def summary(rates: list[float], probe: float) -> str:
    """``min / median / max MB/s`` of the windows and how many fell below half of ``probe`` (bytes/s)."""
    if not rates:
        return "n/a (no full window)"
    low = sum(r < probe / 2 for r in rates)
    return (
        f"{min(rates) / 1e6:,.0f} / {statistics.median(rates) / 1e6:,.0f} / {max(rates) / 1e6:,.0f} MB/s, "
        f"{low} of {len(rates)} windows below half the probe"
    )


__all__ = ["DiskRateSampler", "disk_bytes", "diskstats", "summary"]
