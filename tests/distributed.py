"""Launch test workers and collect their results: tests/dist_worker.py (or another worker) under
torch's own launcher (:func:`run_worker`, :func:`run_offload_worker`), and a script in a fresh
interpreter (:func:`run_python`); worker side: the common command line and scenario loop
(:func:`worker_args`, :func:`run_selected`, :func:`run_scenarios`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fork_launcher import ForkLauncher

WORKER = Path(__file__).with_name("dist_worker.py")
#: ``torchrun``: every worker run under torchrun (:func:`run_worker`); ``fork`` (the default): forked
LAUNCHER_ENV = "ZERODP_TEST_LAUNCHER"
FORK_LAUNCHER = ForkLauncher()
TIMEOUT_S = 600
TEARDOWN_ABORT = "terminate called without an active exception"


def run_worker(
    world_size: int,
    stages: str = "0,1,2,3",
    scenarios: str = "all",
    worker: Path = WORKER,
    extra_args: Sequence[str] = (),
    torchrun: bool = False,
) -> list[dict]:
    """Run the worker on ``world_size`` local gloo ranks; return one results dict per rank.

    ``extra_args`` are appended to the worker's command line (e.g. ``["--ckpt-dir", d]``). The ranks are
    forked by :class:`fork_launcher.ForkLauncher` (torchrun's environment, without its 5 s start), or
    launched by torchrun itself with ``torchrun`` or ``ZERODP_TEST_LAUNCHER=torchrun``.
    """
    with tempfile.TemporaryDirectory() as out:
        argv = ["--out", out, "--stages", stages, "--scenarios", scenarios, *extra_args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        launcher = os.environ.get(LAUNCHER_ENV, "fork")
        if launcher not in ("fork", "torchrun"):
            raise ValueError(f"{LAUNCHER_ENV}={launcher!r}: allowed are 'fork' (the default) and 'torchrun'")
        if torchrun or launcher == "torchrun":
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}"]
            proc = subprocess.run(
                [*launch, str(worker), *argv], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
            )
        else:
            proc = FORK_LAUNCHER.run(str(worker), argv, world_size, env, TIMEOUT_S)
        files = [Path(out, f"rank{r}.json") for r in range(world_size)]
        if proc.returncode != 0:
            complete = all(f.exists() for f in files)
            if not (complete and TEARDOWN_ABORT in proc.stderr):
                raise RuntimeError(
                    f"worker failed (world {world_size}, rc {proc.returncode}):\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
                )
            # Every rank finished every scenario and wrote its results; a rank then aborted while the
            # process group was torn down (seen rarely, only with more ranks than cores). The results
            # are asserted on as usual; the abort is reported, not hidden.
            warnings.warn(
                f"world {world_size}: a rank aborted during process-group teardown after "
                f"writing its results ({TEARDOWN_ABORT!r})",
                stacklevel=2,
            )
        return [json.loads(f.read_text()) for f in files]


def run_offload_worker(
    world_size: int, stages: str, scenarios: str, worker: Path, torchrun: bool = False
) -> tuple[list[dict], list[str]]:
    """:func:`run_worker` with ``--nvme DIR --ckpt DIR`` (fresh temporary directories); returns the
    per-rank results and what the workers left in the NVMe directory (should be nothing)."""
    with tempfile.TemporaryDirectory() as nvme, tempfile.TemporaryDirectory() as ckpt:
        args = ["--nvme", nvme, "--ckpt", ckpt]
        results = run_worker(world_size, stages, scenarios, worker=worker, extra_args=args, torchrun=torchrun)
        return results, os.listdir(nvme)


def run_python(script: str, timeout_s: int = 120) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter (one thread), capturing its output."""
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def selected_runs(items: Sequence[Any], module: Any, scenario_of: dict[str, str]) -> dict[int, tuple[str, str]]:
    """What the selected tests of ``module`` need launched: {world size: (stages, scenarios)}, each a
    comma-separated list for :func:`run_worker`.

    ``items`` is the session's selected test items; each test is parametrized by ``world_size`` and
    ``stage`` and names its scenario by a ``name`` parameter or through ``scenario_of[function name]``
    (``"scenario@stage"`` for a test without a ``stage`` parameter). A ``-k`` or node-id selection thus
    launches only what it asserts on.
    """
    wanted: dict[int, tuple[set[int], set[str]]] = {}
    for item in items:
        if getattr(item, "module", None) is not module or not hasattr(item, "callspec"):
            continue
        params = item.callspec.params
        if "world_size" not in params:
            continue
        name, _, fixed_stage = (params.get("name") or scenario_of[item.originalname]).partition("@")
        stages, names = wanted.setdefault(params["world_size"], (set(), set()))
        stages.add(params["stage"] if "stage" in params else int(fixed_stage))
        names.add(name)
    return {ws: (",".join(map(str, sorted(st))), ",".join(sorted(nm))) for ws, (st, nm) in sorted(wanted.items())}


def worker_args(*required: str) -> argparse.Namespace:
    """Worker side: parse :func:`run_worker`'s command line (``--out``, ``--stages``, ``--scenarios``,
    default ``all``; plus the ``required`` options, e.g. ``"--nvme"``) and join the default process
    group (gloo, a 120 s collective timeout)."""
    import zerodp

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="3")
    ap.add_argument("--scenarios", default="all")
    for option in required:
        ap.add_argument(option, required=True)
    args = ap.parse_args()
    zerodp.init_distributed(timeout_s=120)
    return args


def run_selected(args: argparse.Namespace, scenarios: Mapping[str, Callable[[], dict]]) -> None:
    """Worker side: :func:`run_scenarios` on the scenarios ``args.scenarios`` names (``all``: every one,
    in ``scenarios``' order)."""
    names = list(scenarios) if args.scenarios == "all" else args.scenarios.split(",")
    run_scenarios(args.out, [(n, scenarios[n]) for n in names])


def run_scenarios(out_dir: str, jobs: Sequence[tuple[str, Any]]) -> None:
    """Worker side: run each ``(key, fn)`` on this rank, recording ``{"ok": True, **fn()}`` or the
    traceback, with a barrier after each (no rank runs ahead into the next scenario's collectives); write
    ``out_dir/rank{r}.json`` and shut the process group down."""
    import traceback

    import torch.distributed as dist

    import zerodp

    results: dict[str, dict] = {}
    for key, fn in jobs:
        try:
            results[key] = {"ok": True, **fn()}
        except Exception:  # recorded and asserted on by pytest
            results[key] = {"ok": False, "error": traceback.format_exc()}
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    zerodp.shutdown_distributed()
