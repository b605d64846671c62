"""``zerodp clean-swap PATH``: list, and remove, the swap directories under an ``nvme_path`` left by
jobs whose processes are gone (killed by SIGKILL, a power loss). A directory whose owner runs, whose
owner is on another host, or without an owner record is never touched (:mod:`zerodp.offload.swap_dir`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from zerodp.offload.swap_dir import find_stale, remove_stale


def add_parser(sub: Any) -> None:
    """Add the ``clean-swap`` subcommand to ``sub`` (argparse subparsers)."""
    cs = sub.add_parser(
        "clean-swap",
        help="remove swap directories of dead jobs under an nvme_path",
        description="List the zerodp_<job> swap directories under PATH whose owner processes (host and pid "
        "recorded in each rank directory) are gone, with their sizes, and remove them. Directories "
        "of running jobs, of other hosts or without an owner record are kept.",
    )
    cs.add_argument("path", metavar="PATH", help="the offload_optimizer / offload_param nvme_path")
    cs.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    cs.set_defaults(handler=run, parser=cs)


def run(args: argparse.Namespace) -> int:
    """List (``--dry-run``) or remove the stale swap directories; 0 on success, 2 for a bad PATH."""
    if not os.path.isdir(args.path):
        args.parser.error(f"argument PATH: {args.path!r} is not a directory")
    stale = find_stale(args.path) if args.dry_run else remove_stale(args.path)
    verb = "would remove" if args.dry_run else "removed"
    for s in stale:
        print(f"{verb} {s.path}  {s.bytes:,} bytes  (owner {', '.join(s.owners)}, not running)")
    print(
        f"{verb} {len(stale)} swap director{'y' if len(stale) == 1 else 'ies'}, "
        f"{sum(s.bytes for s in stale):,} bytes under {args.path}"
    )
    return 0


__all__ = ["add_parser", "run"]
