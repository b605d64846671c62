"""The launcher side of ``zerodp bench``: the environment of its workers (:func:`launch_env`) and the
``--sweep-ranks`` probes, one probe-only torchrun job per world size whose ``bench.json`` files the
main run reads back with ``--sweep-from`` (:func:`run_sweep`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from zerodp.app import bench_device


def sweep_commands(args: argparse.Namespace, prefix: list[str]) -> tuple[list[list[str]], list[str]]:
    """Launcher side of ``--sweep-ranks``: one probe-only command per world size (DDP and zerodp, no
    timing, no charts), given the torchrun ``prefix`` without ``--nproc-per-node``; and the JSON
    files they write (to pass as ``--sweep-from``).

    Raises:
        ValueError: a world size that is not an integer >= 1.
    """
    cmds, files = [], []
    for tok in filter(None, args.sweep_ranks.split(",")):
        if not tok.strip().isdigit() or int(tok) < 1:
            raise ValueError(f"--sweep-ranks takes integers >= 1 separated by commas, got {tok!r}")
        n = int(tok)
        out = Path(args.out) / f"sweep_{n}"
        flags = [
            f"--preset={args.preset}",
            "--only=DDP,zerodp stage 0,zerodp stage 1,zerodp stage 2,zerodp stage 3",
            "--rounds=0",
            f"--probe-steps={args.probe_steps}",
            f"--out={out}",
            "--no-plots",
            "--no-fresh-rss",
            f"--device={args.device}",
        ]
        flags += [
            f"--{k.replace('_', '-')}={getattr(args, k)}"
            for k in ("n_layer", "n_head", "d_model", "seq_len", "micro_batch")
            if getattr(args, k) is not None
        ]
        cmds.append(prefix + ["--nproc-per-node", str(n), "-m", "zerodp.app.bench"] + flags)
        files.append(str(out / "bench.json"))
    return cmds, files


def launch_env(device: str = "cpu") -> dict[str, str]:
    """Environment for the bench workers: one thread each, glibc returning freed tensor memory to the
    OS at once (so RSS follows live memory), DeepSpeed's CPU accelerator when ``--device`` resolves to
    the CPU (no GPU, or ``--device cpu`` on a GPU machine)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    if bench_device.device_type(device) == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def run_sweep(args: argparse.Namespace, prefix: list[str]) -> str | None:
    """Run the ``--sweep-ranks`` probes; returns the comma-joined JSON files, or None when none ran.

    Raises:
        RuntimeError: a sweep run failed (its exit code and command line).
    """
    cmds, files = sweep_commands(args, prefix)
    for cmd in cmds:
        rc = subprocess.run(cmd, env=launch_env(args.device), stdout=subprocess.DEVNULL).returncode
        if rc != 0:
            raise RuntimeError(f"sweep run failed with exit code {rc}: {' '.join(cmd)}")
    return ",".join(files) or None


__all__ = ["launch_env", "run_sweep", "sweep_commands"]
