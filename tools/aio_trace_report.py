"""Summarise traces written by tools/aio_trace (its docstring says how to record one).

    python tools/aio_trace_report.py PREFIX [WINDOW_S]

Per process: the rate and mean number of direct-I/O calls in flight per window, by file and direction
(e.g. ``optiR`` optimizer.swp reads); the disk-busy time (any call in flight) split by which files were in
flight and how many calls; per-call service times; and the time the sub-group loop spent in each traced
part (``upd`` an update with its waits, ``grad_take`` waiting for a sub-group's gradients, ...).
"""

from __future__ import annotations

import collections
import glob
import json
import sys


def windows(io: list, t0: float, width: float) -> None:
    n = int((max(e[3] for e in io) - t0) / width) + 1
    moved = [collections.Counter() for _ in range(n)]
    inflight = [0.0] * n
    for _, _, a, b, nbytes, write, name in io:
        dur, i = max(b - a, 1e-9), int((a - t0) / width)
        while a < b:
            end = min(b, t0 + (i + 1) * width)
            moved[i][name[:4] + ("W" if write else "R")] += nbytes * (end - a) / dur
            inflight[i] += end - a
            a, i = end, i + 1
    for i in range(n):
        if moved[i]:
            parts = " ".join(f"{k}:{v / width / 1e6:,.0f}" for k, v in sorted(moved[i].items()))
            total = sum(moved[i].values()) / width / 1e6
            print(f"  {i * width:6.0f} s {total:7,.0f} MB/s  in flight {inflight[i] / width:4.2f}  {parts}")


def busy_split(io: list) -> None:
    edges = sorted([(e[2], 1, i) for i, e in enumerate(io)] + [(e[3], -1, i) for i, e in enumerate(io)])
    live: set[int] = set()
    last, split = 0.0, collections.Counter()
    for t, d, i in edges:
        if live:
            files = sorted({io[j][6] for j in live})
            split["+".join(f[:9] for f in files), min(len(live), 4)] += t - last
        live.add(i) if d == 1 else live.discard(i)
        last = t
    print(f"  disk busy {sum(split.values()):.1f} s: (files in flight, calls in flight capped at 4) -> s")
    for k, v in split.most_common(10):
        print(f"    {k}: {v:.1f}")


def main() -> None:
    width = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    for path in sorted(glob.glob(sys.argv[1] + ".*.json")):
        events = json.load(open(path))["events"]
        io = [e for e in events if e[0] == "io"]
        if not io:
            continue
        t0 = min(e[2] for e in io)
        print(f"{path}: {len(io)} calls over {max(e[3] for e in io) - t0:.0f} s")
        windows(io, t0, width)
        busy_split(io)
        per_call = collections.defaultdict(list)
        for e in io:
            per_call[e[6][:9], "write" if e[5] else "read", e[4] >> 20].append(e[3] - e[2])
        print("  service time per call (file, direction, MiB): calls, median ms, p90 ms")
        for k, v in sorted(per_call.items(), key=lambda kv: -len(kv[1]))[:8]:
            v.sort()
            print(f"    {k}: {len(v)}, {v[len(v) // 2] * 1e3:.1f}, {v[int(len(v) * 0.9)] * 1e3:.1f}")
        parts = collections.defaultdict(lambda: [0, 0.0])
        for e in events:
            if e[0] != "io":
                parts[e[0]][0] += 1
                parts[e[0]][1] += e[3] - e[2]
        print("  sub-group loop (calls, s): " + ", ".join(f"{k} {n} {s:.1f}" for k, (n, s) in parts.items()))


if __name__ == "__main__":
    main()
