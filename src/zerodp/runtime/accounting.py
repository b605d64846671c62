"""Model-state memory and communication formulas of the ZeRO paper, and the reports that compare them
with what an engine actually holds and sends.

Source: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC20), section 5 (memory, figure 1: K = 12 for mixed-precision Adam) and section 7 (communication).
With Psi trainable parameters, N_d data-parallel ranks, ``p``/``g`` bytes per parameter/gradient
element and ``K`` optimizer-state bytes per element (fp32 master weights included):

=========  ==============================  =============================  ==================
stage      parameters                      gradients                      optimizer states
=========  ==============================  =============================  ==================
0 (DP)     p Psi                           g Psi                          K Psi
1 (P_os)   p Psi                           g Psi                          K Psi / N_d
2 (+g)     p Psi                           g Psi / N_d                    K Psi / N_d
3 (+p)     p Psi / N_d                     g Psi / N_d                    K Psi / N_d
=========  ==============================  =============================  ==================

Mixed precision (p = g = 2, K = 12) gives 16 Psi, 4 Psi + 12 Psi/N_d, 2 Psi + 14 Psi/N_d, 16 Psi/N_d:
for Psi = 7.5e9 and N_d = 64, 120 / 31.4 / 16.6 / 1.9 GB. Traffic per rank per optimizer step is 2 Psi
elements for stages 0-2 and 3 Psi for stage 3 without accumulation. With K micro-steps per optimizer step,
stages 0-1 still reduce once per step (2 Psi), while stage 2 reduce-scatters every micro-step and
all-gathers once ((K + 1) Psi) and stage 3 gathers for each forward and backward and reduce-scatters
every micro-step (3K Psi) (:func:`comm_elements_per_step`).

With gradient accumulation under bf16/fp16, zerodp accumulates gradients in an fp32 buffer by default
(:mod:`zerodp.runtime.precision`): g = 4, e.g. 18 Psi at stage 0 and 4 Psi + 14 Psi/N_d at stage 2.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "data parallel", 1: "ZeRO-1 (P_os)", 2: "ZeRO-2 (P_os+g)", 3: "ZeRO-3 (P_os+g+p)"}
CATEGORIES = ("parameters", "gradients", "optimizer_states", "master_weights", "comm_buffers")


@dataclass(frozen=True)
class BytesPerElement:
    """Model-state bytes per trainable element. ``optimizer`` is K and includes fp32 master weights
    when they are a separate copy (``master``), so the paper's K = 12 is ``optimizer=8, master=4``."""

    param: int
    grad: int
    optimizer: int  # Adam moments: 8 for fp32 exp_avg + exp_avg_sq
    master: int  # separate fp32 master copy: 4 in mixed precision, 0 when params are already fp32

    @property
    def k(self) -> int:
        return self.optimizer + self.master


MIXED_PRECISION_ADAM = BytesPerElement(param=2, grad=2, optimizer=8, master=4)
FP32_ADAM = BytesPerElement(param=4, grad=4, optimizer=8, master=0)


def model_state_bytes(stage: int, numel: int, world_size: int, b: BytesPerElement) -> dict[str, float]:
    """Paper formula (table above) for one rank: bytes by category for ``numel`` trainable elements.

    Raises:
        ValueError: stage not in 0..3 or world_size < 1.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    return {
        "parameters": b.param * numel / (n if stage >= 3 else 1),
        "gradients": b.grad * numel / (n if stage >= 2 else 1),
        "optimizer_states": b.optimizer * numel / (n if stage >= 1 else 1),
        "master_weights": b.master * numel / (n if stage >= 1 else 1),
        "comm_buffers": 0.0,
    }


def comm_elements_per_step(stage: int, numel: int, grad_accum: int = 1) -> int:
    """Per-rank traffic per optimizer step in elements (paper section 7) with ``grad_accum`` (K)
    micro-steps per optimizer step, as the engine issues it: 2 Psi at stages 0-1 (one reduction per
    step), (K + 1) Psi at stage 2 (a reduce-scatter per micro-step, one all-gather), 3K Psi at stage 3
    (forward and backward gathers and a reduce-scatter per micro-step). Raises ValueError: bad stage or K."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage}")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    return {0: 2, 1: 2, 2: grad_accum + 1, 3: 3 * grad_accum}[stage] * numel


def human_bytes(n: float) -> str:
    """Decimal units, as the paper's table (1 GB = 1e9 bytes)."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}" if unit in ("GB", "TB", "PB") else f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def estimate_table(numel: int, world_size: int, b: BytesPerElement = MIXED_PRECISION_ADAM, grad_accum: int = 1) -> str:
    """Text table of per-rank model-state bytes and traffic per optimizer step (of ``grad_accum``
    micro-steps, :func:`comm_elements_per_step`) for stages 0-3."""
    rows = [
        f"Psi = {numel:,} trainable parameters, N_d = {world_size}, "
        f"bytes/element: param {b.param}, grad {b.grad}, K = {b.k}; "
        f"{grad_accum} micro-step(s) per optimizer step"
    ]
    rows.append(f"{'stage':<22}{'per-rank model states':>24}  {'traffic per optimizer step, per rank':>38}")
    for stage in STAGES:
        total = sum(model_state_bytes(stage, numel, world_size, b).values())
        psi = comm_elements_per_step(stage, 1, grad_accum)
        # stages 0-1 reduce the gradient buffer at its dtype (b.grad: fp32 with fp32 accumulation), then
        # stage 1 all-gathers parameters; stages 2-3 reduce-scatter every micro-step in the module dtype
        traffic = {0: 2 * b.grad, 1: b.grad + b.param}.get(stage, psi * b.param) * numel
        rows.append(f"{STAGE_NAMES[stage]:<22}{human_bytes(total):>24}  {f'{psi} Psi = ' + human_bytes(traffic):>38}")
    return "\n".join(rows)


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of model state this rank holds, measured from the engine's tensors, beside the formula.

    ``measured`` and ``formula`` map each of :data:`CATEGORIES` to bytes. ``numel`` is Psi (trainable
    elements, without padding); padding to a multiple of ``world_size`` shows up as measured bytes
    slightly above the formula. ``peak`` holds high-water marks in bytes (e.g. ``gradients`` for the
    stage-2 gradient buckets in flight plus the owned partition).
    """

    stage: int
    rank: int
    world_size: int
    numel: int
    frozen_numel: int
    measured: dict[str, int]
    formula: dict[str, float]
    peak: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.measured.values())

    @property
    def formula_total(self) -> float:
        return sum(self.formula.values())

    def format(self) -> str:
        lines = [
            f"rank {self.rank}/{self.world_size}  stage {self.stage}  Psi = {self.numel:,}"
            + (f" (+{self.frozen_numel:,} frozen)" if self.frozen_numel else "")
        ]
        lines.append(f"  {'category':<18}{'measured':>14}{'formula':>14}")
        for c in CATEGORIES:
            lines.append(f"  {c:<18}{human_bytes(self.measured[c]):>14}{human_bytes(self.formula[c]):>14}")
        lines.append(f"  {'total':<18}{human_bytes(self.total):>14}{human_bytes(self.formula_total):>14}")
        for c, v in self.peak.items():
            lines.append(f"  peak {c:<13}{human_bytes(v):>14}")
        return "\n".join(lines)


@dataclass(frozen=True)
class CommReport:
    """Collectives issued since the last reset; ``expected_elements_per_step`` is the formula's
    (:func:`comm_elements_per_step` with ``grad_accum`` micro-steps per optimizer step)."""

    stage: int
    numel: int
    steps: int
    records: list  # list[comm.CommRecord]
    traffic_elements: int  # Psi-equivalent elements over all records (all-reduce counted twice)
    model_traffic_elements: int  # the same, gradient and parameter collectives only
    grad_accum: int = 1  # micro-steps per optimizer step

    @property
    def expected_elements_per_step(self) -> int:
        return comm_elements_per_step(self.stage, self.numel, self.grad_accum)

    @property
    def elements_per_step(self) -> float:
        return self.model_traffic_elements / self.steps if self.steps else 0.0

    def format(self) -> str:
        lines = [f"  {'op':<16}{'purpose':<18}{'count':>7}{'elements':>14}{'bytes':>12}"]
        for r in self.records:
            lines.append(f"  {r.op:<16}{r.purpose:<18}{r.count:>7}{r.elements:>14,}{human_bytes(r.bytes):>12}")
        if self.steps:
            ratio = self.elements_per_step / self.numel if self.numel else 0.0
            want = self.expected_elements_per_step // max(self.numel, 1)
            lines.append(
                f"  per step: {self.elements_per_step:,.0f} elements = {ratio:.3f} Psi "
                f"(formula {want} Psi = {self.expected_elements_per_step:,})"
            )
        return "\n".join(lines)


class ReportedEngine(Protocol):
    """What :func:`memory_report` reads off an engine (a Protocol: no import of the engine module)."""

    rank: int
    world_size: int
    groups: list  # list[zerodp.runtime.partition.FlatGroup]
    frozen: list  # parameters outside the flat groups
    reducer: Any  # zerodp.runtime.reducer.GradientReducer
    optimizer: torch.optim.Optimizer
    optimizer_offload: Any  # zerodp.offload.build.OptimizerOffload

    @property  # read-only: the engine's is a Literal[0, 1, 2, 3]
    def stage(self) -> int: ...

    param_offload: Any  # zerodp.offload.param_offload.ParamOffloadStrategy
    sharding: Any | None  # zerodp.stage3.sharding.Stage3
    precision: Any  # zerodp.runtime.precision.PrecisionPolicy


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def trainable_numel(groups: Iterable[Any]) -> int:
    """Psi: trainable elements of the flat groups' slots, without padding."""
    return sum(s.numel for g in groups for s in g.slots if s.group_index >= 0 and s.param.requires_grad)


def _measured(engine: ReportedEngine, frozen_bytes: int) -> dict[str, int]:
    """Bytes per category of :data:`CATEGORIES` held by ``engine``'s tensors."""
    held = engine.reducer.held_bytes()
    return {
        # stage 3: shards, from their live storage (0 bytes while offload_param has one swapped out)
        "parameters": sum(
            g.buffer.untyped_storage().nbytes() if engine.stage == 3 else _nbytes(g.buffer) for g in engine.groups
        )
        + frozen_bytes,
        "gradients": held["gradients"],
        "optimizer_states": sum(
            _nbytes(t) for st in engine.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)
        ),
        # fp32 training: none, the optimizer updates views of the parameters
        "master_weights": sum(_nbytes(p.master) for g in engine.groups for p in g.pieces if p.master is not None),
        "comm_buffers": held["comm_buffers"],
    }


def memory_report(engine: ReportedEngine) -> MemoryReport:
    """Bytes of model state held by this rank, measured from ``engine``'s tensors, beside the paper's
    formula for its stage (:func:`model_state_bytes`) as the optimizer and parameter offloads change
    it (masters and moments on the host or on NVMe), with frozen parameters added to both."""
    numel = trainable_numel(engine.groups)
    frozen_bytes = sum(p.numel() * p.element_size() for p in engine.frozen)
    measured = _measured(engine, frozen_bytes)
    formula = model_state_bytes(engine.stage, numel, engine.world_size, engine.precision.bytes_per_element)
    engine.optimizer_offload.adjust_formula(formula, numel / engine.world_size)
    if engine.param_offload.device == "nvme":
        formula["parameters"] = 0.0  # shards on NVMe between uses (persistent ones stay: measured)
    formula["parameters"] += frozen_bytes
    peak = {"gradients+buffers": engine.reducer.peak_grad_bytes}
    if engine.sharding is not None:
        measured["parameters"] += engine.sharding.held_bytes()["gathered"]
        # read from the live storages of the gathered buffers, not from the coordinator's counts
        peak["gathered_parameters"] = engine.sharding.coordinator.peak_gathered_bytes
        # idle + lent slabs of the gather pool (see zerodp.stage3.pool), largest seen
        peak["gather_pool"] = engine.sharding.pool.peak_bytes
    frozen_numel = sum(
        s.numel for g in engine.groups for s in g.slots if not (s.group_index >= 0 and s.param.requires_grad)
    ) + sum(p.numel() for p in engine.frozen)
    return MemoryReport(
        stage=engine.stage,
        rank=engine.rank,
        world_size=engine.world_size,
        numel=numel,
        frozen_numel=frozen_numel,
        measured=measured,
        formula=formula,
        peak=peak,
    )


def comm_report(stage: int, numel: int, ledger: Any, grad_accum: int = 1) -> CommReport:
    """Every collective recorded in ``ledger`` (a :class:`zerodp.runtime.comm.CommLedger`) since its
    last reset, with the gradient and parameter traffic the paper's formula counts (``grad_accum``
    micro-steps per optimizer step)."""
    model = ledger.traffic_elements("gradients") + ledger.traffic_elements("parameters")
    return CommReport(
        stage=stage,
        numel=numel,
        steps=ledger.steps,
        records=ledger.records(),
        traffic_elements=ledger.traffic_elements(),
        model_traffic_elements=model,
        grad_accum=grad_accum,
    )
