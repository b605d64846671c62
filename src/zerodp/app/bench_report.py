"""The record ``zerodp bench`` writes (pydantic schema of its JSON file), its stdout table and its
matplotlib charts.

Units: bytes for memory, seconds for step time, Psi-equivalent elements for traffic (see
:mod:`zerodp.app.bench_measure`). Charts (``plot_all``, needs the optional extra ``[bench]``):
``memory_by_category.png`` (model state per rank by category, measured beside the ZeRO paper's
formula, figure 1 of Rajbhandari et al. 2020), ``step_time_ratio.png`` (median ratio of step time to
DDP's in the same round, whiskers from the lowest to the highest round) and ``memory_vs_ranks.png``
(measured model state per rank vs number of ranks for each zerodp stage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from zerodp.runtime.accounting import human_bytes

CATEGORIES = ("parameters", "gradients", "optimizer_states", "master_weights", "buffers")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StepTimes(_Strict):
    """Timed step seconds (forward + backward + optimizer step, between barriers) over all rounds."""

    n: int
    median: float
    q1: float
    q3: float
    min: float
    max: float


class RankMemory(_Strict):
    """One rank's measurement after the last probe step's backward (gradients held, optimizer states
    allocated). ``measured``: bytes of live storage per category; ``unattributed``: other live tensor
    storages Python can see; ``peak_rss``/``rss_before``: resident set size in bytes."""

    rank: int
    measured: dict[str, int]
    unattributed: int
    peak_rss: int
    rss_before: int
    #: ``torch.cuda.max_memory_allocated`` bytes from the system's build to its last probe step
    #: (``--device cuda``); None on the CPU
    peak_device: int | None = None


class FreshRank(_Strict):
    """One rank's process of its own for one system (:mod:`zerodp.app.bench_rss`): resident set size
    at the child's start (after fork) and its high-water mark (``VmHWM``), bytes."""

    rank: int
    rss_start: int
    peak_rss: int


class Traffic(_Strict):
    """Collective traffic per rank per optimizer step, counted at the ``torch.distributed`` calls."""

    elements_per_step: float
    psi_per_step: float
    formula_psi: int | None = None  # 2 (stages 0-2) or 3 (stage 3) per the paper, section 7
    by_op: dict[str, list[int]] = Field(default_factory=dict)  # op -> [calls, elements] per step x steps


class SystemResult(_Strict):
    """Everything measured for one system; ``status`` is ``skipped`` with ``reason`` when it could not run."""

    name: str
    family: str
    stage: int | None = None
    status: Literal["ran", "skipped"]
    reason: str | None = None
    step_time: StepTimes | None = None
    ratio_to_ddp: float | None = None  # median over rounds of (system median / DDP median)
    ratio_per_round: list[float] = Field(default_factory=list)
    losses: list[float] = Field(default_factory=list)  # rank 0, every probe step
    max_loss_diff_vs_ddp: float | None = None  # max |loss - DDP's loss| over the probe steps
    formula: dict[str, float] | None = None  # bytes per rank, paper's table, fp32 AdamW
    memory: list[RankMemory] = Field(default_factory=list)
    traffic: Traffic | None = None  # None: no collective seen at torch.distributed's Python calls
    #                                   (DeepSpeed stage 3 issues its gathers below them)
    fresh_rss: list[FreshRank] = Field(default_factory=list)  # per rank, a process of its own
    fresh_rss_vs_ddp: float | None = None  # highest rank's peak / DDP's highest rank's peak
    fresh_rss_note: str | None = None  # why fresh_rss is empty (not requested, failed: the error)


class SweepPoint(_Strict):
    """Model-state bytes per rank (rank 0, measured total of the categories) at one world size."""

    system: str
    world_size: int
    measured_total: int
    formula_total: float | None = None


class BenchResult(_Strict):
    """The whole JSON file written by ``zerodp bench --out``."""

    command: str
    date_utc: str
    preset: str
    model: dict[str, int | float | bool]
    psi: int
    world_size: int
    backend: str
    device: str = "cpu"  # --device as resolved: "cpu" or "cuda" (cuda:LOCAL_RANK on each rank)
    micro_batch: int
    steps: int
    warmup: int
    rounds: int
    probe_steps: int
    torch_version: str
    deepspeed_version: str | None = None
    cpu_count: int
    load_average_start: list[float]
    load_average_end: list[float]
    systems: list[SystemResult]
    sweep: list[SweepPoint] = Field(default_factory=list)


def format_table(res: BenchResult) -> str:
    """The stdout table: one row per system (skipped ones with their reason). ``RSS MiB`` is the
    highest rank's peak RSS with the system alone in its process (:mod:`zerodp.app.bench_rss`) and its
    ratio to DDP's; without that measurement, the highest rise over the RSS before the system was
    built in the shared process, marked ``*``. On CUDA a last column ``GPU MiB`` is the highest rank's
    peak device memory (``torch.cuda.max_memory_allocated``); on the CPU it is absent."""
    gpu = res.device != "cpu"
    lines = [
        f"GPT {res.psi:,} parameters ({res.preset}), {res.world_size} ranks ({res.backend}, {res.device}), "
        f"micro-batch {res.micro_batch}, {res.steps} timed steps x {res.rounds} rounds, load average "
        f"{res.load_average_start[0]:.1f} -> {res.load_average_end[0]:.1f} on {res.cpu_count} CPUs",
        f"{'system':<34}{'median s':>9}{'IQR s':>8}{'vs DDP':>8}{'range':>13}{'model state':>13}"
        f"{'formula':>11}{'RSS MiB':>14}{'traffic':>14}{'dloss':>9}" + (f"{'GPU MiB':>9}" if gpu else ""),
    ]
    for s in res.systems:
        if s.status == "skipped":
            lines.append(f"{s.name:<34}skipped: {s.reason}")
            continue
        st, m0 = s.step_time, s.memory[0] if s.memory else None
        rng = f"{min(s.ratio_per_round):.2f}-{max(s.ratio_per_round):.2f}" if s.ratio_per_round else "-"
        state = human_bytes(sum(m0.measured.values())) if m0 else "-"
        formula = human_bytes(sum(s.formula.values())) if s.formula else "-"
        if s.fresh_rss:  # a process of its own per system: comparable across systems
            rss = f"{max(m.peak_rss for m in s.fresh_rss) / 2**20:.0f}"
            rss += f" {s.fresh_rss_vs_ddp:.2f}x" if s.fresh_rss_vs_ddp is not None else ""
        else:  # in the shared process: the rise over the RSS before the system was built
            rss = (f"+{max(m.peak_rss - m.rss_before for m in s.memory) / 2**20:.0f}*") if s.memory else "-"
        tr = s.traffic
        traffic = (f"{tr.psi_per_step:.2f}" + (f"/{tr.formula_psi} Psi" if tr.formula_psi else " Psi")) if tr else "-"
        dl = f"{s.max_loss_diff_vs_ddp:.1e}" if s.max_loss_diff_vs_ddp is not None else "-"
        median = f"{st.median:.4f}" if st else "-"  # not timed (--rounds 0): no figure, not a zero
        iqr = f"{st.q3 - st.q1:.4f}" if st else "-"
        ratio = f"{s.ratio_to_ddp:.2f}x" if s.ratio_to_ddp is not None else "-"
        lines.append(
            f"{s.name:<34}{median:>9}{iqr:>8}{ratio:>8}{rng:>13}{state:>13}{formula:>11}{rss:>14}"
            f"{traffic:>14}{dl:>9}" + (f"{_peak_device_mib(s):>9}" if gpu else "")
        )
    lines.append(
        "RSS MiB: peak resident set of the highest rank, each system in a process of its own, and "
        "its ratio to DDP's (* = no such process: rise over the RSS before the system was built "
        "in the shared process)"
    )
    return "\n".join(lines)


def _peak_device_mib(s: SystemResult) -> str:
    """The highest rank's peak device memory of ``s`` in MiB, or ``-`` where it was not measured."""
    peaks = [m.peak_device for m in s.memory if m.peak_device is not None]
    return f"{max(peaks) / 2**20:.0f}" if peaks else "-"


def _tick(name: str) -> str:
    """A system's name on two or three short lines (x tick label)."""
    return name.replace(" stage ", "\nstage ").replace("torch ", "torch\n").replace(" + ", "\n+ ")


def plot_all(res: BenchResult, out_dir: Path) -> list[Path]:
    """Write the three PNG charts into ``out_dir``; returns their paths.

    Raises:
        ImportError: matplotlib is missing (``pip install -e '.[bench]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    ran = [s for s in res.systems if s.status == "ran"]
    paths = []

    # (a) model state per rank by category, measured and formula side by side
    mem = [s for s in ran if s.memory and s.formula is not None]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(mem)), 4.5))
    colors = dict(zip(CATEGORIES, ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3"), strict=True))
    for i, s in enumerate(mem):
        for j, (label, values) in enumerate((("measured", s.memory[0].measured), ("formula", s.formula))):
            assert values is not None  # mem: systems with a formula
            bottom = 0.0
            for c in CATEGORIES:
                v = values.get(c, 0) / 2**20
                ax.bar(
                    i + (j - 0.5) * 0.38,
                    v,
                    0.36,
                    bottom=bottom,
                    color=colors[c],
                    hatch="//" if label == "formula" else None,
                    edgecolor="white",
                    label=c if (i == 0 and j == 0) else None,
                )
                bottom += v
    ax.set_xticks(range(len(mem)), [_tick(s.name) for s in mem], fontsize=7)
    tallest = max(
        (sum(v.values()) for s in mem for v in (s.memory[0].measured, s.formula) if v is not None), default=0.0
    )
    ax.set_ylim(0, 1.35 * tallest / 2**20 or 1.0)  # room for the legend above the tallest bar
    ax.set_ylabel("MiB per rank (rank 0)")
    ax.set_title(
        f"Model state per rank, {res.world_size} ranks, Psi = {res.psi:,} (left measured, right formula, hatched)",
        fontsize=8,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "memory_by_category.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # (b) step-time ratio to DDP with the spread over rounds
    timed = [s for s in ran if s.ratio_to_ddp is not None]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(timed)), 4))
    for i, s in enumerate(timed):
        lo, hi = min(s.ratio_per_round), max(s.ratio_per_round)
        assert s.ratio_to_ddp is not None  # timed
        ax.bar(i, s.ratio_to_ddp, color="#4C72B0" if s.family == "zerodp" else "#999999")
        ax.errorbar(i, s.ratio_to_ddp, yerr=[[s.ratio_to_ddp - lo], [hi - s.ratio_to_ddp]], color="k", capsize=3)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(timed)), [_tick(s.name) for s in timed], fontsize=7)
    ax.set_ylabel("step time / DDP's (same round)")
    ax.set_title(f"Step time vs DDP, median of {res.rounds} rounds (whiskers: lowest-highest round)", fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "step_time_ratio.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # (c) memory per rank vs number of ranks
    fig, ax = plt.subplots(figsize=(6, 4))
    points = res.sweep or [
        SweepPoint(
            system=s.name,
            world_size=res.world_size,
            measured_total=sum(s.memory[0].measured.values()),
            formula_total=sum(s.formula.values()) if s.formula else None,
        )
        for s in mem
    ]
    names = list(dict.fromkeys(p.system for p in points))
    for k, name in enumerate(names):
        ps = sorted((p for p in points if p.system == name), key=lambda p: p.world_size)
        # systems holding the same state (DDP and stage 0) overlap: earlier ones drawn larger and hollow
        (line,) = ax.plot(
            [p.world_size for p in ps],
            [p.measured_total / 2**20 for p in ps],
            "-",
            marker="osD^v<>p"[k % 8],
            markersize=4 + 2 * (len(names) - k),
            markerfacecolor="none" if k < len(names) - 1 else None,
            label=name,
        )
        if all(p.formula_total is not None for p in ps):
            formula = [p.formula_total / 2**20 for p in ps if p.formula_total is not None]
            ax.plot([p.world_size for p in ps], formula, ":", color=line.get_color())
    ax.set_xlabel("ranks")
    ax.set_xticks(sorted({p.world_size for p in points}))
    ax.set_ylabel("model state MiB per rank (dotted: formula)")
    ax.set_title("Measured model state per rank vs number of ranks", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "memory_vs_ranks.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
