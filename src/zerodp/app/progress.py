"""The progress display of ``zerodp train`` (rank 0, stderr).

On a terminal it is a tqdm bar redrawn in place. Otherwise (a log file, CI) it is a
:class:`ProgressLog`: plain lines, one when training starts (steps done so far: 0, or the step a
resumed run starts from) and then at most one per ``interval_s`` (10 s) of its clock; nothing is
printed at close, which could come sooner (the run's summary follows on stdout).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from tqdm import tqdm

#: seconds between two lines of :class:`ProgressLog` (at least).
LOG_INTERVAL_S = 10.0


class ProgressLog:
    """tqdm's ``update``/``set_postfix``/``close`` as plain log lines, at most one per ``interval_s``.

    Args:
        total: steps of the whole run.
        initial: steps already done (a resumed run).
        stream: where lines go.
        interval_s: minimum seconds between two lines, measured with ``clock``.
        clock: seconds (monotonic); injectable for tests.
    """

    def __init__(
        self,
        total: int,
        initial: int = 0,
        stream: TextIO = sys.stderr,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        desc: str = "train",
    ) -> None:
        self.total, self.n, self.stream = total, initial, stream
        self.interval_s, self.clock, self.desc = interval_s, clock, desc
        self.start = clock()
        self.postfix: dict[str, str] = {}
        self._line(self.start)

    def set_postfix(self, postfix: Mapping[str, object], refresh: bool = False) -> None:
        self.postfix = {k: str(v) for k, v in postfix.items()}

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self.last_line >= self.interval_s:
            self._line(now)

    def _line(self, now: float) -> None:
        self.last_line = now
        extra = "".join(f", {k}={v}" for k, v in self.postfix.items())
        self.stream.write(f"{self.desc}: {self.n}/{self.total} steps, {now - self.start:.0f} s{extra}\n")
        self.stream.flush()

    def close(self) -> None:
        """Prints nothing: a line now could follow the previous one within ``interval_s``."""


def progress_bar(total: int, enabled: bool, initial: int = 0, stream: TextIO | None = None) -> tqdm | ProgressLog:
    """tqdm on a terminal (``stream``, default stderr), else a :class:`ProgressLog`; disabled: a
    tqdm that prints nothing."""
    stream = stream if stream is not None else sys.stderr
    tty = stream.isatty()
    if enabled and not tty:
        return ProgressLog(total, initial, stream)
    return tqdm(
        total=total,
        initial=initial,
        disable=not enabled,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=0.2,
        file=stream,
    )
