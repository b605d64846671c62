"""Check one ``zerodp bench --device cuda`` record for tools/gpu_check.sh's bench parts.

    python tools/gpu_bench_check.py OUT/bench_ws1/bench.json

A bench run exits 0 even when a system could not be built (it is reported as skipped with the
reason), so the exit code alone would call a CUDA failure of zerodp a pass. This reads the JSON (plain
``json``, no zerodp import: the report runs it with the host's Python too) and prints its summary and
every problem; exit status 1 when there is one:

- ``device`` is not ``cuda``;
- a required system (DDP, FSDP2, zerodp stages 0-3) did not run (its skip reason is named);
- a system that ran has no peak device memory (``memory[].peak_device``, bytes) for some rank;
- a system's largest loss difference to DDP over the probe steps is above ``LOSS_TOL`` (fp32, same
  seed and batches; the order of the reductions differs between systems).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REQUIRED = ("DDP", "FSDP2", "zerodp stage 0", "zerodp stage 1", "zerodp stage 2", "zerodp stage 3")
#: largest |loss - DDP's loss| accepted (absolute, fp32 GPT losses near ln(vocab) ~ 5.5)
LOSS_TOL = 1e-3


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The figures gpu_check.json keeps of one bench record: per system its status (or skip reason),
    median step seconds, ratio to DDP, loss difference to DDP and peak device MiB per rank."""
    systems = {}
    for s in data.get("systems", []):
        if s.get("status") != "ran":
            systems[s["name"]] = {"status": s.get("status"), "reason": s.get("reason")}
            continue
        peaks = [m.get("peak_device") for m in s.get("memory", [])]
        systems[s["name"]] = {
            "status": "ran",
            "median_s": (s.get("step_time") or {}).get("median"),
            "ratio_to_ddp": s.get("ratio_to_ddp"),
            "max_loss_diff_vs_ddp": s.get("max_loss_diff_vs_ddp"),
            "peak_device_mib": [None if p is None else round(p / 2**20, 1) for p in peaks],
        }
    return {
        "device": data.get("device"),
        "world_size": data.get("world_size"),
        "backend": data.get("backend"),
        "preset": data.get("preset"),
        "deepspeed_version": data.get("deepspeed_version"),
        "systems": systems,
    }


def problems(summ: dict[str, Any]) -> list[str]:
    """What makes the record a failure (empty: it passes); see the module docstring."""
    out = []
    if summ.get("device") != "cuda":
        out.append(f"device is {summ.get('device')!r}, not 'cuda'")
    systems = summ.get("systems", {})
    for name in REQUIRED:
        row = systems.get(name)
        if row is None or row["status"] != "ran":
            out.append(f"{name} did not run: {(row or {}).get('reason') or 'no row'}")
    for name, row in systems.items():
        if row["status"] != "ran":
            continue
        if not row["peak_device_mib"] or None in row["peak_device_mib"]:
            out.append(f"{name}: no peak device memory for some rank ({row['peak_device_mib']})")
        diff = row["max_loss_diff_vs_ddp"]
        if diff is None or diff > LOSS_TOL:
            out.append(f"{name}: loss differs from DDP's by {diff} (> {LOSS_TOL})")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tools/gpu_bench_check.py BENCH_JSON", file=sys.stderr)
        return 2
    try:
        data = json.loads(Path(argv[0]).read_text())
    except (OSError, ValueError) as exc:
        print(f"gpu_bench_check: cannot read {argv[0]}: {exc}", file=sys.stderr)
        return 1
    summ = summary(data)
    print(json.dumps(summ, indent=1))
    found = problems(summ)
    for p in found:
        print(f"gpu_bench_check: {p}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
