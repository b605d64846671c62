"""Every mutant of tools/mutant_list.py still matches its code exactly once and names existing test files, so
`make mutants` cannot silently skip one after a rename or merge."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_mutant_is_stale() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "mutant_stale.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 problems" in r.stdout
