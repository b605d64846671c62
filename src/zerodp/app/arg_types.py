"""argparse types of the ``zerodp`` command line: each refuses a value out of range with a message
naming the range (argparse prints it with the flag and exits with status 2)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``lo``."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v

    parse.__name__ = f"int>={lo}"
    return parse


def float_in(lo: float, hi: float, lo_open: bool = True) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in ``(lo, hi]`` (``[lo, hi]`` without ``lo_open``)."""

    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if not (math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi):
            raise argparse.ArgumentTypeError(f"expected a number in {'(' if lo_open else '['}{lo}, {hi}], got {s}")
        return v

    parse.__name__ = "number"
    return parse


__all__ = ["float_in", "int_at_least"]
