"""The per-phase parts of ``zerodp train --preset infinity``'s report (:mod:`zerodp.app.infinity_run`):
each step against its per-phase bound, and the swap bytes of each phase by file, so that bytes a phase
moves beyond the minimal schedule (a parameter shard read twice in one step) are seen where they
happen (issue 31 item 4).
"""

from __future__ import annotations

from typing import Any

from zerodp.runtime.accounting import human_bytes

PHASES = ("forward", "backward", "step()")

#: what :func:`swap_counts` counts, in its order
SWAP_FILES = ("params.swp", "gradients.swp", "optimizer.swp")


def swap_counts(engine: Any) -> tuple[int, ...]:
    """Bytes this rank has read and written so far, per swap file: ``params.swp`` (the parameter
    swapper's counters), ``gradients.swp`` (the gradient swap's) and ``optimizer.swp`` (the optimizer
    offload's I/O pool, less the gradient swap's transfers, which go through it); as (read, written)
    pairs in :data:`SWAP_FILES` order, 0 for a file the engine does not have."""
    sw = getattr(engine.param_offload, "swapper", None)
    spill = getattr(engine.optimizer_offload, "spill", None)
    io = getattr(engine.optimizer_offload, "io", None)
    pr, pw = (sw.counters.bytes_read, sw.counters.bytes_written) if sw is not None else (0, 0)
    gr, gw = (spill.bytes_read, spill.bytes_written) if spill is not None else (0, 0)
    orr, ow = (io.bytes_read - gr, io.bytes_written - gw) if io is not None else (0, 0)
    return pr, pw, gr, gw, orr, ow


def step_over_max(seconds: float, wait: float, busy: float) -> float:
    """step / max(c, io): c = ``seconds`` - ``wait`` (compute), io = ``busy`` (disk busy seconds)."""
    return seconds / max(seconds - wait, busy)


def phase_bound(phases: list[list[float]] | tuple[tuple[float, float, float], ...]) -> float | None:
    """Seconds: the sum over phases of max(compute, disk busy), compute = wall - I/O wait (rank 0), disk
    busy from ``io_ticks``. The shortest the step could be with each phase's compute and disk time fully
    overlapped and the phases in their order (the sub-group loop cannot start before the backward ends:
    the ``gradient_clipping`` norm needs every gradient). None without ``io_ticks``."""
    if not phases or any(b < 0 for _, _, b in phases):
        return None
    return sum(max(t - w, b) for t, w, b in phases)


def phase_lines(every: list[dict]) -> list[str]:
    """Per step and phase (rank 0): wall s, I/O wait s and disk idle s (wall - disk busy: time in which
    no transfer of any rank was in flight, compute not overlapped with I/O), and the step against its
    per-phase bound (:func:`phase_bound`)."""
    recs = every[0]["records"]
    if not recs or not recs[0].get("phases"):
        return []
    lines = [
        "per step and phase (rank 0; wall s / I/O wait s / disk idle s = wall - disk busy; per-phase bound = "
        "sum over phases of max(wall - wait, disk busy), the phases in sequence):"
    ]
    for rec in recs:
        cells = []
        for name, (t, w, b) in zip(PHASES, rec["phases"], strict=True):
            idle = f"{max(0.0, t - b):.1f}" if b >= 0 else "n/a"
            cells.append(f"{name} {t:.1f} / {w:.1f} / {idle}")
        bound = phase_bound(rec["phases"])
        tail = f"; per-phase bound {bound:.1f} s, step / bound {rec['seconds'] / bound:.2f}" if bound else ""
        lines.append(f"  step {rec['step']}: " + ", ".join(cells) + tail)
    return lines


def swap_lines(every: list[dict]) -> list[str]:
    """Per step and phase (rank 0): read / written bytes of each swap file (:func:`swap_counts`)."""
    recs = every[0]["records"]
    if not recs or not recs[0].get("swap_bytes") or not all(recs[0]["swap_bytes"]):
        return []
    lines = [f"swap bytes per step and phase (rank 0; read / written: {', '.join(SWAP_FILES)}):"]
    for rec in recs:
        cells = []
        for name, counts in zip(PHASES, rec["swap_bytes"], strict=True):
            pairs = [f"{human_bytes(counts[k])} / {human_bytes(counts[k + 1])}" for k in range(0, len(counts), 2)]
            cells.append(f"{name} " + ", ".join(pairs))
        lines.append(f"  step {rec['step']}: " + "; ".join(cells))
    return lines


def steady_lines(every: list[dict]) -> list[str]:
    """One line on the steady steps, 3 to N-1 of N: step 1 has no loop to overlap, step 2's forward
    carries the first loop (which reads every parameter shard and checks it for in-place edits: no
    shard holds a previous step's cast yet), and step N's ``step()`` runs the last loop with no
    forward to hide it. Gives the range of step/max(c, io) (c = time - I/O wait, the largest over
    ranks; io = disk busy) and of step / per-phase bound over those steps, or says there is none."""
    recs = every[0]["records"]
    steady = recs[2:-1]
    if not steady:
        return [f"steady state: none among {len(recs)} steps (steps 3 to N-1 are; --steps 4 or more)"]
    ratios, bounds = [], []
    for i, rec in enumerate(steady, start=2):
        wait = max(r["records"][i]["wait_s"] for r in every)
        t, busy = rec["seconds"], rec["busy_s"]
        if busy:
            ratios.append(step_over_max(t, wait, busy))
        if (b := phase_bound(rec.get("phases") or [])) is not None:
            bounds.append(t / b)

    def span(xs: list[float]) -> str:
        return "n/a" if not xs else f"{min(xs):.2f}" if len(xs) == 1 else f"{min(xs):.2f}-{max(xs):.2f}"

    return [
        f"steady state (steps 3 to {len(recs) - 1}): step/max(c, io) {span(ratios)}, step / per-phase bound "
        f"{span(bounds)}; step 2's forward carries the first loop (every shard read and checked), step "
        f"{len(recs)}'s step() the last"
    ]


__all__ = [
    "PHASES",
    "SWAP_FILES",
    "phase_bound",
    "phase_lines",
    "steady_lines",
    "step_over_max",
    "swap_counts",
    "swap_lines",
]
