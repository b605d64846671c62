"""``zerodp train --preset infinity --nvme-path DIR``: the ZeRO-Infinity scale demo.

Sizes a GPT from this machine's RAM and free disk so that its model states (16 bytes per parameter
in mixed precision: bf16 parameter and gradient, fp32 master, Adam moments) are at least
``--states-ratio`` (default 2) times the RAM, builds it under :class:`zerodp.zero.Init` (no rank ever
holds the whole model) at stage 3 with ``offload_optimizer`` and ``offload_param`` on NVMe, trains a
few steps and reports, per step: loss, step time, bytes the process read and wrote (``/proc/self/io``),
the disk's busy time (``/proc/diskstats``), the time the training thread waited for I/O, and the
achieved bandwidth against a raw sequential direct-I/O write and read of the same disk measured at the
start of the same run; per rank: peak RSS (``getrusage``).

The plan (:func:`plan_run`) is printed first; ``--dry-run`` stops there. A disk or RAM too small for
the plan is refused with the bytes needed and available. Where the bytes go (all ranks together):

- disk: fp32 master + Adam moments (12 bytes/param, ``offload_optimizer`` swap files), the bf16
  parameter shards (2 bytes/param, ``offload_param`` swap file), the reduced bf16 gradient partition
  (2 bytes/param, ``gradients.swp``: each unit's goes there once reduced, :mod:`zerodp.offload.grad_swap`),
  the raw-I/O probe file, 3% slack;
- RAM (:func:`zerodp.app.infinity_ram.ram_accounting`), every row bounded by a layer, a sub-group, a
  configured pool or the activations, none by the parameter count: per rank the runtime, the
  optimizer's sub-group buffers, the parameter swap pool with its read-ahead budget, the gradient
  swap's read buffers and the partitions being reduced or written, and the largest of the phases that
  do not overlap (backward, forward with the step's sub-group loop under ``overlap_step``, step); 15%
  slack. Each row names a holder measured by ``tools/infinity_rss_probe.py``; the rows matched the
  measured peak within 10% (docs/benchmarks/2026-12-02-infinity-2.4x.md). The raw-I/O probe runs
  before the model exists and is not counted. Two unattributed parts of past runs were named: glibc's
  sliding mmap threshold (3.2B runs, freed blocks up to 32 MiB kept in the heap: the worker runs with
  ``MALLOC_MMAP_THRESHOLD_`` fixed, :data:`MALLOC_ENV`), and the reducer's first (calibration) step
  holding every unit's gradient staging until backward returned (3.8B runs, 2 bytes/param: it now
  reduces each unit once complete, :mod:`zerodp.runtime.grad_reducer`).

Consequence: the RAM needed depends on the layer width and the activations (tokens x layers x
``d_model``), not on the parameter count: the model is bounded by the disk.

The worker half (:func:`run_worker`, in :mod:`zerodp.app.infinity_run`) runs under ``torch.distributed.run``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

from zerodp.app.infinity_ram import Knobs, knobs_for, ram_accounting
from zerodp.app.model import GPTConfig, count_parameters
from zerodp.runtime.accounting import human_bytes

#: glibc: a fixed mmap threshold, so freed blocks above it go back to the kernel (the default slides up to
#: 32 MiB after the first large free, and the heap then keeps freed blocks below it)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
#: bytes per parameter of the model states in mixed-precision Adam (ZeRO paper section 3.1: 2 + 2 + 12)
STATE_BYTES = 16


@dataclass(frozen=True)
class Machine:
    ram_total: int  # bytes the model is sized from (MemTotal, or --assume-ram)
    ram_available: int  # bytes (MemAvailable): the RAM check
    disk_free: int  # bytes free at the NVMe path (or --assume-disk-free)
    nvme_path: str
    assumed: tuple[str, ...] = ()  # which of the above were given instead of measured


@dataclass(frozen=True)
class Plan:
    model: GPTConfig
    params: int
    nproc: int
    micro_batch: int
    steps: int
    lr: float  # AdamW learning rate (default_lr of the width unless --lr)
    states_ratio: float
    state_bytes: int
    disk_needed: dict[str, int]
    ram_needed: dict[str, int]
    knobs: Knobs
    ram_phases: dict[str, dict[str, int]]  # backward, forward, sub-group loop, step: the transient line's parts
    grad_accum: int = 1  # micro-batches per optimizer step [gradient_accumulation_steps]

    @property
    def disk_total(self) -> int:
        return sum(self.disk_needed.values())

    @property
    def ram_total(self) -> int:
        return sum(self.ram_needed.values())

    @property
    def ram_rows(self) -> int:
        """The RAM rows without the slack (bytes, all ranks): what measured peaks are compared with."""
        return sum(v for k, v in self.ram_needed.items() if not k.startswith("slack"))


def read_machine(nvme_path: str, assume_ram: int | None = None, assume_disk_free: int | None = None) -> Machine:
    """RAM from ``/proc/meminfo`` and free bytes at ``nvme_path`` (``shutil.disk_usage``).

    Raises:
        ValueError: ``nvme_path`` is not an existing directory, or the RAM cannot be read.
    """
    if not os.path.isdir(nvme_path):
        raise ValueError(f"--nvme-path {nvme_path!r} is not an existing directory")
    assumed = []
    info = _meminfo()
    available = info.get("MemAvailable", info["MemTotal"])
    if assume_ram is not None:  # sizes the model only; the RAM check still uses what is available
        total = assume_ram
        assumed.append("ram")
    else:
        total = info["MemTotal"]
    if assume_disk_free is not None:
        free = assume_disk_free
        assumed.append("disk")
    else:
        free = shutil.disk_usage(nvme_path).free
    return Machine(total, available, free, os.path.abspath(nvme_path), tuple(assumed))


def _meminfo() -> dict[str, int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            rows = [line.split() for line in f]
    except OSError as exc:
        raise ValueError(f"cannot read /proc/meminfo ({exc}); give --assume-ram BYTES") from None
    return {r[0].rstrip(":"): int(r[1]) * 1024 for r in rows if len(r) >= 2 and r[1].isdigit()}


def size_gpt(min_params: int, seq_len: int) -> GPTConfig:
    """The smallest GPT of this family with at least ``min_params`` parameters: ``d_model`` a multiple
    of 128 (heads of 128), ``n_layer = d_model / 64`` for the width found, then as few layers as reach
    the count (at least 2)."""
    d = 128
    while (
        count_parameters(GPTConfig(n_layer=max(2, d // 64), n_head=d // 128, d_model=d, seq_len=seq_len)) < min_params
    ):
        d += 128
    layers = 2
    while count_parameters(GPTConfig(n_layer=layers, n_head=d // 128, d_model=d, seq_len=seq_len)) < min_params:
        layers += 1
    return GPTConfig(n_layer=layers, n_head=d // 128, d_model=d, seq_len=seq_len)


def plan_run(
    machine: Machine,
    nproc: int = 1,
    states_ratio: float = 2.0,
    seq_len: int = 128,
    micro_batch: int = 1,
    steps: int = 4,
    lr: float | None = None,
    overlap_step: bool = True,
    grad_accum: int = 1,
) -> Plan:
    """Size the model (states >= ``states_ratio`` x RAM) and the disk and RAM it needs (module docstring).

    ``grad_accum`` K > 1 accumulates the reduced gradients in fp32 (zerodp's default
    ``data_types.grad_accum_dtype`` under bf16), so ``gradients.swp`` holds 4 bytes/param instead of 2,
    and each micro-batch after the first reads and writes it once more; the optimizer's swap traffic
    happens once per K micro-batches."""
    target = math.ceil(states_ratio * machine.ram_total / STATE_BYTES)
    model = size_gpt(target, seq_len)
    p = count_parameters(model)
    d = model.d_model
    largest_layer = 4 * d * d + 4 * d  # the MLP's up projection
    k = knobs_for(p, largest_layer, nproc, overlap_step)
    disk = {
        "optimizer states (fp32 master + Adam m, v)": 12 * p,
        "parameter shards (bf16)": 2 * p,
        (
            "reduced gradient partition (bf16, gradients.swp)"
            if grad_accum == 1
            else "reduced gradient partition (fp32 accumulation, gradients.swp)"
        ): (2 if grad_accum == 1 else 4) * p,
        "raw-I/O probe file": k.probe_bytes,
    }
    disk["slack (3%)"] = math.ceil(0.03 * sum(disk.values()))
    ram, phases = ram_accounting(p, model, micro_batch, largest_layer, nproc, k, 2 if grad_accum == 1 else 4)
    lr = default_lr(model.d_model, model.n_layer) if lr is None else lr
    return Plan(
        model, p, nproc, micro_batch, steps, lr, states_ratio, STATE_BYTES * p, disk, ram, k, phases, grad_accum
    )


#: the preset's default learning rate is ``min(MAX_LR, LR_SCALE / (d_model x n_layer))``
MAX_LR = 1e-4
LR_SCALE = 0.16


def default_lr(d_model: int, n_layer: int) -> float:
    """AdamW learning rate for the preset's GPT of ``n_layer`` blocks of width ``d_model``.

    Adam's first updates move every weight by about ``lr`` in the direction of its gradient's sign, so
    one block's output moves by about ``lr x fan-in`` per step and the residual stream by ``n_layer``
    times that; with momentum the second and third steps keep that direction, so a too large ``lr``
    overshoots within the demo's few steps. Measured with ``zerodp train --preset infinity``:
    255M parameters (16 x 1152) fell 5.81 -> 4.25 -> 3.78 -> 3.48 at lr 8.7e-6 but rose back to 5.31 at
    1e-4; 3.2B parameters (37 x 2688) went 5.94 -> 4.75 -> 6.16 -> 6.72 at 3.7e-6 (``0.01 / d_model``).
    ``LR_SCALE`` is 8.7e-6 x 1152 x 16. ``--lr`` overrides it."""
    return min(MAX_LR, LR_SCALE / (d_model * n_layer))


def problems(plan: Plan, machine: Machine) -> list[str]:
    """Why the plan cannot run here (empty: it fits)."""
    out = []
    if plan.disk_total > machine.disk_free:
        out.append(
            f"not enough free disk at {machine.nvme_path}: the plan needs {human_bytes(plan.disk_total)} "
            f"({plan.disk_total:,} bytes), {human_bytes(machine.disk_free)} ({machine.disk_free:,} bytes) "
            "are free; free space there or point --nvme-path at a larger disk"
        )
    if plan.ram_total > machine.ram_available:
        out.append(
            f"not enough RAM: the plan needs {human_bytes(plan.ram_total)} ({plan.ram_total:,} bytes) "
            f"in host memory, {human_bytes(machine.ram_available)} ({machine.ram_available:,} bytes) "
            "are available; lower --states-ratio (model size), --micro-batch or --seq-len (activations), or use "
            "fewer ranks (--nproc)"
        )
    return out


def format_plan(plan: Plan, machine: Machine) -> str:
    m = plan.model
    src = (" (assumed: " + ", ".join(machine.assumed) + ")") if machine.assumed else ""
    lines = [
        f"zerodp train --preset infinity: RAM {human_bytes(machine.ram_total)} (available "
        f"{human_bytes(machine.ram_available)}), free disk at {machine.nvme_path} "
        f"{human_bytes(machine.disk_free)}{src}",
        f"model: GPT n_layer={m.n_layer} d_model={m.d_model} n_head={m.n_head} seq_len={m.seq_len}: "
        f"{plan.params:,} parameters",
        f"model states: {STATE_BYTES} bytes/param x {plan.params:,} = {human_bytes(plan.state_bytes)} = "
        f"{plan.state_bytes / machine.ram_total:.2f} x RAM (target >= {plan.states_ratio:g} x)",
        f"engine: {plan.nproc} rank(s), ZeRO stage 3 built under zerodp.zero.Init, bf16, offload_optimizer nvme "
        f"(sub_group_size {plan.knobs.sub_group_size:,}, buffer_count {plan.knobs.optimizer_buffers}, overlap_step "
        f"{str(plan.knobs.overlap_step).lower()}), offload_param nvme (buffer_count "
        f"{plan.knobs.param_buffer_count} x {human_bytes(plan.knobs.param_buffer_size)}, max_in_cpu "
        f"{human_bytes(plan.knobs.max_in_cpu)}); {plan.steps} steps of {plan.grad_accum} x {plan.micro_batch} x "
        f"{m.seq_len} "
        f"tokens per rank (accumulation x micro-batch x sequence), AdamW lr {plan.lr:.3g}",
        f"disk needed {human_bytes(plan.disk_total)}:",
        *[f"  {k:<58}{human_bytes(v):>12}" for k, v in plan.disk_needed.items()],
        f"RAM needed {human_bytes(plan.ram_total)}:",
        *[f"  {k:<58}{human_bytes(v):>12}" for k, v in plan.ram_needed.items()],
        *[
            f"    {ph + ': ' + k:<56}{human_bytes(v):>12}"
            for ph, rows in plan.ram_phases.items()
            for k, v in rows.items()
        ],
    ]
    return "\n".join(lines)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The preset's flags on ``zerodp train`` (``--nvme-path``, ``--nproc``, ``--steps``, ``--seq-len``
    and ``--micro-batch`` are the train command's own)."""
    group.add_argument(
        "--preset",
        choices=("infinity",),
        help="infinity: the ZeRO-Infinity scale demo, a GPT whose model states are >= 2x this "
        "machine's RAM, stage 3 with optimizer and parameters on NVMe (needs --nvme-path; "
        "see docs/infinity.md)",
    )
    group.add_argument(
        "--dry-run",
        action="store_const",
        const=True,
        help="with --preset: print the sizing plan (model, disk and RAM needed) and exit",
    )
    group.add_argument(
        "--states-ratio",
        metavar="R",
        type=float,
        help="with --preset infinity: model states at least R x RAM (default 2)",
    )
    group.add_argument(
        "--assume-ram",
        metavar="BYTES",
        type=_size,
        help="with --preset infinity: size the model for this much RAM instead of /proc/meminfo's "
        "MemTotal (the RAM check still uses MemAvailable)",
    )
    group.add_argument(
        "--assume-disk-free",
        metavar="BYTES",
        type=_size,
        help="with --preset infinity: size for this much free disk instead of the path's",
    )
    group.add_argument(
        "--no-overlap-step",
        action="store_const",
        const=True,
        help="with --preset infinity: run the optimizer step's sub-group loop inside step() "
        "(offload_optimizer.overlap_step false) instead of during the next forward",
    )


def _size(s: str) -> int:
    from zerodp.checkpoint.sharded_export import parse_size

    try:
        return parse_size(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("max shard size", "size")) from None


#: ``zerodp train`` flags the preset uses; any other flag given with it is refused (it would be ignored)
PRESET_FLAGS = (
    "nvme_path",
    "nproc",
    "steps",
    "seq_len",
    "micro_batch",
    "grad_accum",
    "lr",
    "dry_run",
    "states_ratio",
    "assume_ram",
    "assume_disk_free",
    "no_overlap_step",
)
_NOT_FLAGS = ("command", "handler", "parser", "preset")


#: the default micro-batch keeps the plan's RAM rows (without slack, all ranks) within this share of
#: RAM (issue 31: peak RSS <= 8 GB on a 24 GiB machine; measured peaks were 0.85-0.93 of the rows)
RAM_TARGET_SHARE = 1 / 3


def default_micro_batch(nproc: int, rows_for: Callable[[int], int] | None = None, ram_total: int = 0) -> int:
    """Sequences per rank when ``--micro-batch`` is not given: at most 4 per micro-step over all ranks
    (4 / ``nproc`` per rank, at least 1), so the job's activations and tokens per step do not grow with
    ``--nproc``; then halved while ``rows_for(m)`` (the plan's RAM rows without slack, bytes, for ``m``
    sequences per rank) exceeds :data:`RAM_TARGET_SHARE` of ``ram_total`` (never below 1)."""
    m = max(1, 4 // nproc)
    if rows_for is not None:
        while m > 1 and rows_for(m) > RAM_TARGET_SHARE * ram_total:
            m //= 2
    return m


def ignored_flags(args: argparse.Namespace) -> list[str]:
    """The flags given on the command line (not None) that the preset does not use, as ``--name``."""
    return sorted(
        "--" + k.replace("_", "-")
        for k, v in vars(args).items()
        if v is not None and k not in PRESET_FLAGS and k not in _NOT_FLAGS
    )


def command(args: argparse.Namespace) -> int:
    """``zerodp train --preset infinity``: print the plan; refuse, stop (``--dry-run``) or launch."""
    if args.nvme_path is None:
        print(
            "zerodp train: error: --preset infinity needs --nvme-path DIR (a directory on the disk to use)",
            file=sys.stderr,
        )
        return 2
    ignored = ignored_flags(args)
    if ignored:
        print(
            f"zerodp train: error: --preset infinity sizes its own model and engine; it does not take "
            f"{', '.join(ignored)} (it takes {', '.join(sorted('--' + f.replace('_', '-') for f in PRESET_FLAGS))})",
            file=sys.stderr,
        )
        return 2
    ratio = 2.0 if args.states_ratio is None else args.states_ratio
    if not (math.isfinite(ratio) and ratio > 0):
        print(f"zerodp train: error: --states-ratio must be a positive number, got {ratio}", file=sys.stderr)
        return 2
    try:
        machine = read_machine(args.nvme_path, args.assume_ram, args.assume_disk_free)
    except ValueError as exc:
        print(f"zerodp train: error: {exc}", file=sys.stderr)
        return 2

    def plan_for(micro_batch: int) -> Plan:
        return plan_run(
            machine,
            nproc=args.nproc,
            states_ratio=ratio,
            seq_len=args.seq_len or 128,
            micro_batch=micro_batch,
            steps=4 if args.steps is None else args.steps,
            lr=args.lr,
            overlap_step=not args.no_overlap_step,
            grad_accum=args.grad_accum or 1,
        )

    plan = plan_for(
        args.micro_batch or default_micro_batch(args.nproc, lambda m: plan_for(m).ram_rows, machine.ram_total)
    )
    print(format_plan(plan, machine), flush=True)
    if args.micro_batch is None and plan.micro_batch < default_micro_batch(args.nproc):
        print(
            f"micro-batch {plan.micro_batch} per rank (default): {2 * plan.micro_batch} would need "
            f"{human_bytes(plan_for(2 * plan.micro_batch).ram_rows)} of RAM rows, more than "
            f"{human_bytes(int(RAM_TARGET_SHARE * machine.ram_total))} (a third of RAM); --micro-batch sets it"
        )
    issues = problems(plan, machine)
    for msg in issues:
        print(f"zerodp train: refused: {msg}", file=sys.stderr)
    if issues:
        return 1
    if args.dry_run:
        print("dry run: nothing was built")
        return 0
    worker = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(plan.nproc),
        "-m",
        "zerodp.app.infinity_run",
        "--plan",
        json.dumps(_plan_json(plan)),
        "--nvme-path",
        machine.nvme_path,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.nproc)))
    for key, value in MALLOC_ENV.items():  # the allocator keeps no freed large blocks (module docstring)
        env.setdefault(key, value)
    return subprocess.run(worker, env=env).returncode


def _plan_json(plan: Plan) -> dict:
    return {
        "model": asdict(plan.model),
        "micro_batch": plan.micro_batch,
        "grad_accum": plan.grad_accum,
        "steps": plan.steps,
        "lr": plan.lr,
        "knobs": asdict(plan.knobs),
        "probe_bytes": plan.knobs.probe_bytes,
        "ram_rows_per_rank": plan.ram_rows // plan.nproc,
    }
