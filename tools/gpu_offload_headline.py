"""ZeRO-Offload's single-GPU headline for tools/gpu_check.sh (issue 29, item 6): the largest GPT that
trains on one GPU capped to a memory budget, with ``offload_optimizer`` cpu, then with ``offload_param``
and ``offload_optimizer`` on NVMe, and the same model without offload running out of memory.

    python tools/gpu_offload_headline.py --device cuda --budget-gib 8 --time-s 50 --out headline.json
    python tools/gpu_offload_headline.py --device cpu --tiny --out headline.json   # the CPU rehearsal

Steps: measure the host's rates (building parameters, fused CPU AdamW, page-locked allocation, direct
I/O on ``--nvme-path``); size each mode's GPT from the budgets (tools/offload_headline_sizing.py: bytes
per parameter per mode, activations, host memory and disk free, the time left; when time binds, the
device budget is lowered to what the ``cpu`` mode's model needs, so the no-offload run is still past
it: on CUDA that need is measured, the ``cpu`` and ``nvme`` modes training that model uncapped first,
:func:`probed_budget`); then run each mode in a child process (a fresh CUDA context, its own peak statistics) with
``torch.cuda.set_per_process_memory_fraction(budget / total)``:

- ``none``: stage 2 without offload, the ``cpu`` mode's model: passes when it raises
  ``torch.cuda.OutOfMemoryError`` (caught and reported with the phase it happened in);
- ``cpu``: stage 2, ``offload_optimizer.device: cpu``; ``nvme``: stage 3, parameters and optimizer
  states on NVMe (the model built under ``zerodp.zero.Init``): pass when every step's loss is finite
  and the peak ``torch.cuda.max_memory_allocated`` is within the budget.

Each mode reports params, peak device memory, host RSS (VmRSS, VmHWM), tokens/s (median timed step),
and the share of copy time hidden behind compute (``1 - host waits for copies per step / the same
copies alone``) and, for NVMe, of swap I/O time (``1 - read and write waits / disk busy``). The JSON
has ``pass`` (exit status 0 when true, 1 otherwise; 2 for bad arguments).

``--device cpu`` runs the same lines with the host as the device (``ZERODP_HOST_OFFLOAD_ON_CPU=1`` so
the host offload's pipeline runs): the memory cap and the OOM run are skipped, with the reason, in the
JSON. It ran on one H200 (docs/benchmarks/2026-12-04-first-gpu-run.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import offload_headline_sizing as sizing  # noqa: E402  (tools/, next to this file)

MODES = ("none", "cpu", "nvme")
GIB = 2**30
NO_CAP_ON_CPU = (
    "no memory cap on the CPU: torch.cuda.set_per_process_memory_fraction caps CUDA's allocator, "
    "so the no-offload model cannot run out of a budget here"
)


# ---- the parent: rates, sizes, children, the JSON ------------------------------------------------
def calibrate(device: str, nvme_path: str, numel: int) -> sizing.Rates:
    """Host rates on ``numel`` elements (see :class:`sizing.Rates`); pinning only with CUDA."""
    import torch

    from zerodp.app.bench_offload import raw_direct_io
    from zerodp.runtime.device import host_empty

    t = time.perf_counter()
    torch.empty(numel, dtype=torch.bfloat16).normal_(0.0, 0.02)
    init = (time.perf_counter() - t) / numel
    ps = [torch.zeros(numel // 4, requires_grad=True) for _ in range(4)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(ps, lr=1e-4, fused=True)
    times = []
    for _ in range(4):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    rates = sizing.Rates(init_s_per_param=init, adam_s_per_param=statistics.median(times[1:]) / numel)
    if device == "cuda":
        t = time.perf_counter()
        host_empty(numel * 4, torch.uint8, pin=True)
        rates.pin_s_per_byte = (time.perf_counter() - t) / (numel * 4)
    w, r = raw_direct_io(nvme_path, numel * 4, repeats=1)
    rates.write_s_per_byte, rates.read_s_per_byte = w / (numel * 4), r / (numel * 4)
    return rates


def host_available() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def plan(
    budget: int, seconds: float, rates: sizing.Rates, host: int, disk: int, shape: sizing.Shape, steps: int
) -> tuple[int, dict[str, sizing.Choice], str | None]:
    """The device budget used and each mode's size (``none`` trains the ``cpu`` mode's model). Half of
    ``seconds`` goes to the ``none`` and ``cpu`` runs, half to ``nvme``. Returns the budget (lowered
    when time or host memory binds the ``cpu`` model, with the reason) and the choices."""
    half = seconds / 2
    caps = {
        "host": int(sizing.HOST_SHARE * host / sizing.BYTES_PER_PARAM["cpu"]["host"]) if host else None,
        "time": sizing.time_cap(("none", "cpu"), half, rates, steps),
    }
    cpu = sizing.choose("cpu", budget, shape.n_layer, shape.seq_len, shape.micro_batch, caps)
    why = None
    if cpu.limited_by != "device":
        lowered = sizing.budget_for(cpu.params, "cpu", cpu.shape)
        if lowered < budget:
            why = f"the cpu mode's model is limited by {cpu.limited_by}: the budget is what that model needs"
            budget = lowered
            cpu = sizing.choose("cpu", budget, shape.n_layer, shape.seq_len, shape.micro_batch, caps)
    per = sizing.BYTES_PER_PARAM["nvme"]
    nvme = sizing.choose(
        "nvme",
        budget,
        shape.n_layer,
        shape.seq_len,
        shape.micro_batch,
        {
            "host": int(sizing.HOST_SHARE * host / per["host"]) if host else None,
            "disk": int(sizing.DISK_SHARE * disk / per["nvme"]),
            "time": sizing.time_cap(("nvme",), half, rates, steps),
        },
    )
    none = sizing.Choice(
        "none",
        cpu.shape,
        cpu.params,
        cpu.params * sizing.BYTES_PER_PARAM["none"]["device"] + cpu.shape.activation_bytes(),
        {},
        "the cpu mode's model",
    )
    return budget, {"none": none, "cpu": cpu, "nvme": nvme}, why


#: margin over the probes' peak reserved memory when the budget is measured (see :func:`probed_budget`)
PROBE_MARGIN = 1.10
#: the caching allocator's rounding of large segments
SEGMENT = 2 * 2**20


def probed_budget(probes: dict[str, dict]) -> int:
    """The device budget when time or host memory binds the ``cpu`` model: the largest peak reserved
    memory (``torch.cuda.max_memory_reserved``, what the cap limits) of the uncapped probe runs of the
    ``cpu`` and ``nvme`` modes on that model, plus :data:`PROBE_MARGIN`, rounded up to a 2 MiB segment.
    The formulas' device bytes leave out the engine's buffers and the allocator's rounding (the first
    GPU run, 2026-12-04: a 228 MiB budget from them ran both offload modes out of memory).

    Raises:
        RuntimeError: a probe did not train (its status and error are named).
    """
    for mode, rec in probes.items():
        if rec.get("status") != "trained" or not rec.get("peak_reserved_bytes"):
            raise RuntimeError(f"the uncapped {mode} probe did not train: {rec.get('status')} {rec.get('error', '')}")
    need = max(rec["peak_reserved_bytes"] for rec in probes.values()) * PROBE_MARGIN
    return int(-(-need // SEGMENT) * SEGMENT)


def run_child(mode: str, spec: dict, timeout: float, workdir: Path, tag: str = "") -> dict:
    """Run ``mode`` in a child process (``--child``) within ``timeout`` seconds; its JSON record (an
    ``error`` record when the child exits non-zero or writes none). ``tag``: a prefix of the child's
    files (the probes' are ``probe_``), so that no run reads another's record."""
    spec_path, out_path = workdir / f"{tag}{mode}.spec.json", workdir / f"{tag}{mode}.result.json"
    out_path.unlink(missing_ok=True)  # a record left by an earlier run must not stand for this one
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "ZERODP_HOST_OFFLOAD_ON_CPU": "1" if spec["device"] == "cpu" else "0"}
    cmd = [sys.executable, __file__, "--child", mode, "--spec", str(spec_path), "--child-out", str(out_path)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout), env=env)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "status": "timeout", "note": f"stopped after {timeout:.0f} s"}
    seconds = time.perf_counter() - t
    if out_path.exists() and proc.returncode == 0:
        return {**json.loads(out_path.read_text()), "seconds": seconds}
    return {
        "mode": mode,
        "status": "error",
        "seconds": seconds,
        "error": f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-600:]}",
    }


def judge(mode: str, rec: dict, device: str, budget: int) -> tuple[bool | None, str]:
    """(passed, why); passed None: skipped (not counted)."""
    status = rec.get("status")
    if mode == "none":
        if device != "cuda":
            return None, NO_CAP_ON_CPU
        if status == "oom":
            return True, f"out of memory as expected ({rec.get('phase')})"
        return False, f"expected an out-of-memory error, got status {status!r} {rec.get('error', '')}".strip()
    if status != "trained":
        return False, f"status {status!r}: {rec.get('error') or rec.get('note', '')}"
    if not all(math.isfinite(x) for x in rec["losses"]):
        return False, f"a loss is not finite: {rec['losses']}"
    peak = rec.get("peak_device_bytes")
    if device == "cuda" and (peak is None or peak > budget):
        return False, f"peak device memory {peak} bytes is above the budget {budget}"
    return True, "trained"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--budget-gib", type=float, default=None, help="device memory budget (default 8; --tiny 0.004)")
    ap.add_argument("--time-s", type=float, default=50.0, help="seconds for the whole tool (default 50)")
    ap.add_argument("--steps", type=int, default=3, help="steps per mode, the first one untimed (default 3)")
    ap.add_argument("--nvme-path", default=None, help="swap directory (default: a fresh one beside --out)")
    ap.add_argument("--tiny", action="store_true", help="2 layers, sequence 32: the CPU rehearsal")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        import offload_headline_child

        return offload_headline_child.main(args.child, args.spec, args.child_out)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    budget_gib = args.budget_gib if args.budget_gib is not None else (0.004 if args.tiny else 8.0)
    if args.out is None:
        ap.error("--out is required")
    if bad:
        ap.error(f"--modes: unknown mode(s) {bad}; allowed: {', '.join(MODES)}")
    if budget_gib <= 0 or args.time_s <= 0 or args.steps < 2:
        ap.error(
            f"--budget-gib and --time-s must be > 0 and --steps >= 2; got {budget_gib}, {args.time_s}, {args.steps}"
        )
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_offload_headline: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    return run(args, modes, int(budget_gib * GIB))


def child_spec(args: argparse.Namespace, budget: int | None, choice: sizing.Choice, nvme_path: str) -> dict:
    """What a child run needs (``budget`` None: uncapped, a probe)."""
    return {
        "device": args.device,
        "budget_bytes": budget,
        "model": choice.shape.model(),
        "micro_batch": choice.shape.micro_batch,
        "steps": args.steps,
        "nvme_path": nvme_path,
    }


def run(args: argparse.Namespace, modes: list[str], requested: int) -> int:
    t0 = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    made = args.nvme_path is None
    nvme_path = args.nvme_path or tempfile.mkdtemp(prefix="offload_headline_nvme_", dir=out.parent)
    shape = sizing.Shape(2, 0, 32, 2) if args.tiny else sizing.Shape(12, 0, 256, 2)
    rates = calibrate(args.device, nvme_path, 1 << 18 if args.tiny else 1 << 22)
    left = args.time_s - (time.perf_counter() - t0)
    # on CUDA a lowered budget is measured by running the cpu and nvme models uncapped first: the
    # models are sized for a bit more than half of the time left
    sizing_s = left * (0.55 if args.device == "cuda" else 1.0)
    disk = shutil.disk_usage(nvme_path).free
    report: dict[str, Any] = {
        "device": args.device,
        "budget_requested_bytes": requested,
        "time_s": args.time_s,
        "steps": args.steps,
        "bytes_per_param": sizing.BYTES_PER_PARAM,
        "rates": vars(rates),
        "host_available_bytes": host_available(),
        "disk_free_bytes": disk,
        "nvme_path": nvme_path,
        "modes": {},
        "note": "the CPU rehearsal: no memory cap (on a GPU: docs/gpu.md)" if args.device != "cuda" else "",
    }
    try:
        budget, choices, why = plan(requested, sizing_s, rates, report["host_available_bytes"], disk, shape, args.steps)
    except ValueError as exc:
        report["error"] = str(exc)
        return finish(report, out, made, nvme_path)
    deadline = t0 + args.time_s
    if why is not None and args.device == "cuda":
        # the budget is measured, not computed: both offload modes train the cpu mode's model, uncapped
        # first; the budget is their larger peak plus a margin, and all three modes then run under it
        cpu = choices["cpu"]
        choices["nvme"] = sizing.Choice("nvme", cpu.shape, cpu.params, cpu.device_bytes, {}, "the cpu mode's model")
        probes = {}
        for mode in ("cpu", "nvme"):
            spec = child_spec(args, None, choices[mode], nvme_path)
            probes[mode] = run_child(mode, spec, 0.25 * (deadline - time.perf_counter()), out.parent, "probe_")
        report["probes"] = probes
        try:
            budget = probed_budget(probes)
        except RuntimeError as exc:
            report["error"] = str(exc)
            return finish(report, out, made, nvme_path)
        why += (
            f"; measured: the larger peak reserved memory of the uncapped cpu and nvme runs of that model "
            f"plus {PROBE_MARGIN - 1:.0%}"
        )
    report.update(budget_bytes=budget, budget_lowered_because=why, sizes={m: c.record() for m, c in choices.items()})
    for mode in modes:
        if mode == "none" and args.device != "cuda":
            report["modes"][mode] = {"mode": mode, "status": "skipped", "pass": None, "why": NO_CAP_ON_CPU}
            continue
        c = choices[mode]
        spec = child_spec(args, budget, c, nvme_path)
        # twice the estimate, or a share of what is left (the last mode: all of it), within the deadline
        left = deadline - time.perf_counter()
        share = {"none": 0.25, "cpu": 0.5, "nvme": 1.0}[mode]
        timeout = min(left, max(2 * sizing.estimate_s(mode, c.params, rates, args.steps), share * left))
        rec = run_child(mode, spec, timeout, out.parent)
        passed, reason = judge(mode, rec, args.device, budget)
        report["modes"][mode] = {**rec, "params": c.params, "pass": passed, "why": reason}
        print(f"{mode:>5}: {c.params:,} params, {rec.get('status')}: {reason}", flush=True)
    return finish(report, out, made, nvme_path)


def finish(report: dict, out: Path, made: bool, nvme_path: str) -> int:
    """Decide ``pass``, write the JSON, remove a swap directory this tool made; the exit status."""
    judged = [m["pass"] for m in report["modes"].values() if m.get("pass") is not None]
    report["pass"] = bool(judged) and all(judged) and "error" not in report
    out.write_text(json.dumps(report, indent=1))
    if made:
        shutil.rmtree(nvme_path, ignore_errors=True)
    print(f"offload headline: {'pass' if report['pass'] else 'FAIL'} (wrote {out})")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
