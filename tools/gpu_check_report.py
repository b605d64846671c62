"""Assemble tools/gpu_check.sh's ``gpu_check.json`` from the parts it recorded and print the summary.

    python tools/gpu_check_report.py OUT_DIR [--dry-run=0|1] [--budget-s=N] [--seconds=N]

Reads ``OUT_DIR/parts/*.json`` (one per part: name, status pass/fail/timeout/budget_spent/skipped/dry/not_supported,
rc, seconds, note, log), the figures the parts wrote (``versions.json``, ``train_compare.json``, the
pytest junit files ``*.xml``: passed/failed/skipped counts, the bench records ``bench_wsN/bench.json``
summarised by tools/gpu_bench_check.py, ``offload_headline.json`` of tools/gpu_offload_headline.py),
writes ``OUT_DIR/gpu_check.json`` and
prints one line per part, ending with ``gpu check: N/M pass`` (M: the parts that ran or had to; a part
skipped for lack of GPUs or not supported yet is listed, not counted). Exit status 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench_check  # noqa: E402  (tools/, next to this file)

#: statuses counted in M (the denominator); "dry", "not_supported" and lack-of-GPU skips are not
COUNTED = ("pass", "fail", "timeout", "budget_spent")
#: the parts gpu_check.sh records, in order (the report names any that is missing)
PARTS = (
    "install",
    "versions",
    "cuda_marked_tests",
    "device_tests_ws1",
    "device_tests_ws2",
    "train_compare",
    "bench_ws1",
    "bench_ws2",
    "offload_headline",
    "cli_commands",
)


def junit_counts(path: Path) -> dict[str, int] | None:
    """passed/failed/errors/skipped of a pytest junit file (None when it is missing or unreadable)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def cli_summary(path: Path) -> list[dict[str, Any]] | None:
    """tools/gpu_cli_check.sh's summary.tsv: per command its name, exit status, seconds and last log line
    (None when the file is missing)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    rows = []
    for line in lines:
        name, rc, seconds, last = (line.split("\t", 3) + ["", "", ""])[:4]
        rows.append(
            {"name": name, "rc": int(rc) if rc.lstrip("-").isdigit() else None, "seconds": seconds, "last": last}
        )
    return rows


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def build(out: Path, dry: bool, budget_s: int, seconds: float) -> dict[str, Any]:
    parts = {}
    for name in PARTS:
        rec = read_json(out / "parts" / f"{name}.json")
        parts[name] = (
            rec
            if rec is not None
            else {
                "name": name,
                "status": "fail",
                "rc": -1,
                "seconds": 0.0,
                "note": "the script recorded nothing for this part",
            }
        )
    figures: dict[str, Any] = {
        "versions": read_json(out / "versions.json"),
        "train_compare": read_json(out / "train_compare.json"),
    }
    for key, xml in (
        ("cuda_marked_tests", "cuda_marked.xml"),
        ("device_tests_ws1", "device_ws1.xml"),
        ("device_tests_ws2", "device_ws2.xml"),
    ):
        figures[key] = junit_counts(out / xml)
        part = parts[key]
        if part["status"] == "pass" and not (figures[key] or {}).get("passed"):
            # pytest exits 0 when every test skips (no CUDA): not a pass
            parts[key] = {**part, "status": "fail", "note": "no test passed (all skipped, or no junit file)"}
    for key in ("bench_ws1", "bench_ws2"):
        data = read_json(out / key / "bench.json")
        figures[key] = (
            None
            if data is None
            else {**gpu_bench_check.summary(data), "problems": gpu_bench_check.problems(gpu_bench_check.summary(data))}
        )
    figures["offload_headline"] = headline = read_json(out / "offload_headline.json")
    if parts["offload_headline"]["status"] == "pass" and not (headline or {}).get("pass"):
        parts["offload_headline"] = {
            **parts["offload_headline"],
            "status": "fail",
            "note": "offload_headline.json is missing or does not say pass",
        }
    figures["cli_commands"] = cli_summary(out / "cli" / "summary.tsv")
    counted = [p for p in parts.values() if p["status"] in COUNTED]
    passed = sum(p["status"] == "pass" for p in counted)
    return {
        "dry_run": dry,
        "budget_s": budget_s,
        "seconds": seconds,
        "parts": parts,
        "figures": figures,
        "passed": passed,
        "counted": len(counted),
        "note": "zerodp's CUDA path; see docs/gpu.md. A dry run runs no part.",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dry-run", type=int, choices=(0, 1), default=0)
    ap.add_argument("--budget-s", type=int, default=480)
    ap.add_argument("--seconds", type=float, default=0.0)
    args = ap.parse_args(argv)
    report = build(args.out, bool(args.dry_run), args.budget_s, args.seconds)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    for p in report["parts"].values():
        note = f" ({p['note']})" if p.get("note") else ""
        print(f"  {p['name']:<20} {p['status']:<13} {p['seconds']:7.1f} s{note}")
    print(f"wrote {args.out / 'gpu_check.json'}")
    print(f"gpu check: {report['passed']}/{report['counted']} pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
