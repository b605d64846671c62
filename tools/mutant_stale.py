"""Lists mutants of tools/mutant_list.py whose text no longer occurs exactly once in their file (stale), and
test ids whose file is missing; exits 1 if any. Seconds, no tests run: a check to run after a merge or rename."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from mutant_list import MUTANTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    bad = 0
    for m in MUTANTS:
        count = (ROOT / m.file).read_text().count(m.old)
        if count != 1:
            print(f"stale: {m.name}: its text occurs {count} times in {m.file}")
            bad += 1
        for t in m.tests:
            if not (ROOT / t.split("::")[0]).exists():
                print(f"missing test file: {m.name}: {t}")
                bad += 1
    print(f"{len(MUTANTS)} mutants, {bad} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
