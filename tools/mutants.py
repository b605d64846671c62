"""Mutation check: apply deliberate faults to a temporary copy of the source, one at a time, and run
the tests that should catch each one. ``make mutants`` runs it; the last line is ``N/N mutants killed``.

A mutant is a named text substitution in one file of ``src/`` (``old`` must occur exactly once, so a
mutant that no longer matches the code fails loudly as *stale* instead of silently testing nothing)
plus the pytest selection that must fail once it is applied. Each run uses a fresh copy of the
working tree (``git ls-files`` plus untracked, non-ignored files) with ``PYTHONPATH`` pointing at the
copy's ``src/``, so the developer's tree and installed package are never modified.

Usage: ``python tools/mutants.py [--list] [--only NAME ...] [--keep]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutant_list import MUTANTS, Mutant  # noqa: E402


@dataclass
class Outcome:
    mutant: Mutant
    status: str  # "killed", "survived", "stale", "error"
    seconds: float
    detail: str = ""


def tree_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [f for f in out.splitlines() if (ROOT / f).is_file()]


def copy_tree(dest: Path) -> None:
    for f in tree_files():
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, target)


def apply(mutant: Mutant, tree: Path) -> str:
    """Apply ``mutant`` in ``tree``; return "" or why it is stale."""
    path = tree / mutant.file
    if not path.is_file():
        return f"{mutant.file} does not exist"
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        return f"the text to replace occurs {count} times in {mutant.file} (expected exactly once)"
    path.write_text(text.replace(mutant.old, mutant.new))
    return ""


def run_tests(tree: Path, selection: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *selection]
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)


def check(mutant: Mutant, base: Path, timeout_s: float) -> Outcome:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zerodp-mutant-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(base, tree)
        why = apply(mutant, tree)
        if why:
            return Outcome(mutant, "stale", time.monotonic() - t0, why)
        try:
            proc = run_tests(tree, mutant.tests, timeout_s)
        except subprocess.TimeoutExpired:
            return Outcome(mutant, "killed", time.monotonic() - t0, f"tests timed out after {timeout_s:.0f} s")
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        if proc.returncode == 1:  # tests ran and at least one failed
            return Outcome(mutant, "killed", time.monotonic() - t0, tail[0])
        if proc.returncode == 0:
            return Outcome(mutant, "survived", time.monotonic() - t0, tail[0])
        return Outcome(
            mutant,
            "error",
            time.monotonic() - t0,
            f"pytest exit {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]}",
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant's test run")
    args = ap.parse_args(argv)
    # a terminated run still removes its temporary trees (TemporaryDirectory cleans up on SystemExit)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    mutants = MUTANTS
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTANTS})
        if unknown:
            ap.error(f"unknown mutant(s) {unknown}; known: {', '.join(m.name for m in MUTANTS)}")
        mutants = [m for m in MUTANTS if m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:40s} {m.file}  ->  {' '.join(m.tests)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="zerodp-mutants-base-") as tmp:
        base = Path(tmp) / "tree"
        copy_tree(base)
        # the unmutated tree must pass the same selections, or a "kill" would mean nothing (one pytest
        # run for all of them: the test modules launch each world size once for what is selected)
        selection = sorted({t for m in mutants for t in m.tests})
        t0 = time.monotonic()
        proc = run_tests(base, selection, args.timeout)
        if proc.returncode != 0:
            print(f"unmutated tree fails {' '.join(selection)}:\n{(proc.stdout + proc.stderr)[-2000:]}")
            return 2
        print(f"unmutated   {len(selection)} selected tests pass ({time.monotonic() - t0:.1f} s)", flush=True)
        outcomes = []
        for m in mutants:
            o = check(m, base, args.timeout)
            outcomes.append(o)
            print(f"{o.status:9s} {m.name:40s} {o.seconds:6.1f} s  {o.detail}", flush=True)
    killed = sum(o.status == "killed" for o in outcomes)
    print(f"{killed}/{len(outcomes)} mutants killed")
    return 0 if killed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
