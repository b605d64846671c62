"""The per-rank worker of ``zerodp train --preset infinity`` (see :mod:`zerodp.app.infinity` for the
plan); run as ``python -m torch.distributed.run ... -m zerodp.app.infinity_run --plan JSON --nvme-path DIR``.

Measured, never taken from the engine's own bookkeeping:

- raw disk bandwidth: rank 0 writes then reads ``probe_bytes`` sequentially with direct I/O in the NVMe
  directory (:func:`zerodp.app.bench_offload.raw_direct_io`) before the model exists;
- bytes this process read and wrote per step: ``read_bytes``/``write_bytes`` of ``/proc/self/io``;
- disk busy time per step: ``io_ticks`` of the device holding the NVMe directory (``/proc/diskstats``;
  the whole disk, other processes included);
- I/O wait: wall time this rank's training thread spends in :meth:`zerodp.offload.aio.IOHandle.wait`
  (the only place the swappers block on a transfer), so compute = step time - wait and the share of I/O
  hidden behind compute = 1 - wait / busy;
- peak RSS per rank: ``getrusage(RUSAGE_SELF).ru_maxrss``; RSS after ``zero.Init`` and after
  ``initialize`` from ``/proc/self/statm``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

import zerodp
from zerodp.app import data
from zerodp.app.disk_rate import DiskRateSampler, diskstats, summary
from zerodp.app.infinity_phases import PHASES, phase_lines, steady_lines, step_over_max, swap_counts, swap_lines
from zerodp.app.model import GPT, GPTConfig
from zerodp.offload import aio
from zerodp.runtime.accounting import human_bytes

#: the swappers' direct-I/O settings, also those of the raw probe: two threads per pool keep a read
#: and a write in flight at once, the optimizer step's mix (one thread moves that mix markedly slower
#: than the disk allows: docs/benchmarks/2026-12-02-infinity-3x.md, tools/disk_mix_probe.py)
PRESET_AIO = {"block_size": 1_048_576, "queue_depth": 8, "thread_count": 2}


def engine_config(plan: dict, nvme_path: str, world: int) -> dict:
    k = plan["knobs"]
    return {
        "train_micro_batch_size_per_gpu": plan["micro_batch"],
        "gradient_accumulation_steps": plan.get("grad_accum", 1),
        "optimizer": {"type": "AdamW", "params": {"lr": plan["lr"], "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "device": "cpu",  # offload trains on the CPU (offload on a GPU is not implemented)
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": k["sub_group_size"],
            "stage3_param_persistence_threshold": k.get("persistence_threshold", 100_000),
            "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_max_live_parameters": k.get("max_live_parameters", 200_000_000),
            "reduce_bucket_size": k.get("reduce_bucket_size", 50_000_000),
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme_path,
                "buffer_count": k["optimizer_buffers"],
                "overlap_step": k.get("overlap_step", False),
            },
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme_path,
                "buffer_count": k["param_buffer_count"],
                "buffer_size": k["param_buffer_size"],
                "max_in_cpu": k["max_in_cpu"],
            },
        },
        "aio": dict(PRESET_AIO),
    }


# ---- measurements ---------------------------------------------------------------------------------


def proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) of this process from /proc/self/io (storage I/O, all threads)."""
    with open("/proc/self/io", encoding="ascii") as f:
        rows = dict(line.split(": ") for line in f.read().splitlines())
    return int(rows["read_bytes"]), int(rows["write_bytes"])


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def disk_device(path: str) -> str | None:
    """The /proc/diskstats name of the block device holding ``path``, or None (not a block device)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    try:
        with open("/proc/diskstats", encoding="ascii") as f:
            for line in f:
                parts = line.split()
                if int(parts[0]) == major and int(parts[1]) == minor:
                    return parts[2]
    except OSError:
        return None
    return None


def disk_busy_ms(device: str | None) -> int | None:
    if device is None:
        return None
    row = diskstats(device)
    return None if row is None else int(row[12])  # io_ticks: milliseconds the device had I/O in flight


class IOWaitClock:
    """Wall seconds the training thread spends in ``IOHandle.wait`` (wrapped while active)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.thread = threading.get_ident()

    @contextlib.contextmanager
    def active(self) -> Iterator[IOWaitClock]:
        original = aio.IOHandle.wait
        clock = self

        def timed_wait(handle: aio.IOHandle) -> int:
            if threading.get_ident() != clock.thread:
                return original(handle)
            t0 = time.perf_counter()
            try:
                return original(handle)
            finally:
                clock.seconds += time.perf_counter() - t0

        aio.IOHandle.wait = timed_wait  # type: ignore[method-assign,assignment]  # timing patch, restored below
        try:
            yield self
        finally:
            aio.IOHandle.wait = original  # type: ignore[method-assign]


@dataclass
class StepRecord:
    step: int
    loss: float
    seconds: float
    read: int
    written: int
    busy_s: float | None
    wait_s: float
    tokens: int = 0  # tokens of all ranks in this step (accumulation x micro-batch x sequence x ranks)
    hwm_growth: tuple[int, int, int] = (0, 0, 0)  # bytes the peak RSS grew by in forward, backward, step()
    #: per phase (forward, backward, step()): (wall s, I/O wait s of this rank, disk busy s or -1)
    phases: tuple[tuple[float, float, float], ...] = ()
    #: the disk's rate (bytes/s, every process) in each full sampling window of the step
    disk_windows: tuple[float, ...] = ()
    #: per phase: this rank's swap bytes (:func:`zerodp.app.infinity_phases.swap_counts`)
    swap_bytes: tuple[tuple[int, ...], ...] = ()


class PhaseMeter:
    """Wall time, I/O wait (``clock``) and disk busy time (``io_ticks``) per phase of one step, summed
    over its micro-batches, with the peak-RSS growth of each phase and, given ``swap`` (byte counters,
    :func:`zerodp.app.infinity_phases.swap_counts`), the swap bytes of each."""

    def __init__(
        self, clock: IOWaitClock, device: str | None, swap: Callable[[], tuple[int, ...]] | None = None
    ) -> None:
        self.clock, self.device, self.swap = clock, device, swap
        self.sums = [[0.0, 0.0, 0.0] for _ in PHASES]
        self.growth = [0, 0, 0]
        self._mark = self._now()
        self._swap_mark = swap() if swap is not None else ()
        self.swap_bytes = [[0] * len(self._swap_mark) for _ in PHASES]

    def _now(self) -> tuple[float, float, int | None, int]:
        return time.perf_counter(), self.clock.seconds, disk_busy_ms(self.device), peak_rss_bytes()

    def start(self) -> None:
        self._mark = self._now()
        self._swap_mark = self.swap() if self.swap is not None else ()

    def end(self, phase: int) -> None:
        """Add the time since :meth:`start` (or the previous :meth:`end`) to ``phase``."""
        now, was = self._now(), self._mark
        row = self.sums[phase]
        row[0] += now[0] - was[0]
        row[1] += now[1] - was[1]
        if now[2] is None or was[2] is None or row[2] < 0:
            row[2] = -1.0  # no io_ticks for this disk: unknown
        else:
            row[2] += (now[2] - was[2]) / 1e3
        self.growth[phase] += now[3] - was[3]
        self._mark = now
        if self.swap is not None:
            counts = self.swap()
            done = self.swap_bytes[phase]
            self.swap_bytes[phase] = [d + c - m for d, c, m in zip(done, counts, self._swap_mark, strict=True)]
            self._swap_mark = counts

    def phases(self) -> tuple[tuple[float, float, float], ...]:
        return tuple((t, w, b) for t, w, b in self.sums)


def _raw_bandwidth(nvme_path: str, nbytes: int) -> tuple[float, float]:
    from zerodp.app.bench_offload import raw_direct_io
    from zerodp.offload.config import AioConfig

    w, r = raw_direct_io(nvme_path, nbytes, AioConfig.model_validate(PRESET_AIO), repeats=1)
    return nbytes / w, nbytes / r


def run_worker(plan: dict, nvme_path: str) -> None:
    zerodp.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    raw = torch.zeros(2, dtype=torch.float64)
    if rank == 0:  # before anything else touches the disk
        raw[:] = torch.tensor(_raw_bandwidth(nvme_path, plan["probe_bytes"]), dtype=torch.float64)
    dist.broadcast(raw, 0)
    raw_write, raw_read = float(raw[0]), float(raw[1])

    mcfg = GPTConfig.from_dict(plan["model"])
    cfg = engine_config(plan, nvme_path, world)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with zerodp.zero.Init(config=cfg):
        model = GPT(mcfg)
    rss_init = rss_bytes()
    engine = zerodp.initialize(model, cfg)
    build_s = time.perf_counter() - t0
    rss_engine, peak_build = rss_bytes(), peak_rss_bytes()

    text = data.load_text(None, min_bytes=data.min_corpus_bytes(mcfg.seq_len))
    train_tokens, _ = data.split(data.encode(text))
    batches = data.GlobalBatches(train_tokens, mcfg.seq_len, plan["micro_batch"], world, seed=0)
    device = disk_device(nvme_path)
    clock = IOWaitClock()
    records: list[StepRecord] = []
    engine.train()
    accum = plan.get("grad_accum", 1)
    tokens = accum * plan["micro_batch"] * mcfg.seq_len * world
    with clock.active(), DiskRateSampler(device) as sampler:
        for step in range(plan["steps"]):
            io0, busy0, wait0, t = proc_io(), disk_busy_ms(device), clock.seconds, time.perf_counter()
            m0 = time.monotonic()
            # where time, I/O wait, disk busy time and the peak RSS go: forward, backward, step() (with
            # overlap_step the previous step's sub-group loop runs inside the forward)
            meter = PhaseMeter(clock, device, lambda: swap_counts(engine))
            for micro in range(accum):  # DeepSpeed's protocol: the optimizer steps at the K-th engine.step()
                x, y = data.rank_slice(batches.batch(step * accum + micro), rank, world)
                meter.start()
                _, loss = engine(x, y)
                meter.end(0)
                engine.backward(loss)
                meter.end(1)
                engine.step()
                if micro + 1 == accum and step + 1 == plan["steps"]:
                    engine.optimizer_offload.settle()  # overlap_step: the last loop has no next forward to run in
                meter.end(2)
            seconds = time.perf_counter() - t
            io1, busy1 = proc_io(), disk_busy_ms(device)
            busy = None if busy0 is None or busy1 is None else (busy1 - busy0) / 1e3
            records.append(
                StepRecord(
                    step + 1,
                    float(loss.item()),
                    seconds,
                    io1[0] - io0[0],
                    io1[1] - io0[1],
                    busy,
                    clock.seconds - wait0,
                    tokens,
                    (meter.growth[0], meter.growth[1], meter.growth[2]),
                    meter.phases(),
                    tuple(sampler.windows(m0, time.monotonic())),
                    tuple(tuple(b) for b in meter.swap_bytes),
                )
            )
            if rank == 0:
                print(
                    f"step {step + 1}: loss {records[-1].loss:.4f}, {seconds:.1f} s, {tokens / seconds:,.1f} tokens/s",
                    flush=True,
                )
    engine.close()  # swap files removed: the probe file fits again
    dist.barrier()
    end = torch.zeros(2, dtype=torch.float64)
    if rank == 0:  # the same probe after the run: has the disk itself slowed down?
        end[:] = torch.tensor(_raw_bandwidth(nvme_path, plan["probe_bytes"]), dtype=torch.float64)
    raw_end = (float(end[0]), float(end[1]))
    mine = {
        "rank": rank,
        "peak_rss": peak_rss_bytes(),
        "peak_rss_build": peak_build,
        "rss_after_init": rss_init,
        "rss_after_initialize": rss_engine,
        "records": [r.__dict__ for r in records],
    }
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        print(report(every, plan, raw_write, raw_read, build_s, device, raw_end), flush=True)
    zerodp.shutdown_distributed()


#: a step whose disk throughput is below this share of the raw figure measured at the start is reported
SLOW_DISK_SHARE = 0.5


def disk_throughput(
    read: int, written: int, busy_s: float | None, seconds: float, raw_read: float, raw_write: float
) -> tuple[float, float, str]:
    """(achieved, raw, over) in bytes/s for one step: ``achieved`` = bytes moved (``/proc/self/io`` of
    every rank) / seconds the disk was busy (``io_ticks``; without it the step's wall time, a lower
    bound on the rate: ``over`` says which); ``raw`` = the same bytes / the seconds the raw
    sequential direct-I/O figures of the start of the run need for them (reads at ``raw_read``,
    writes at ``raw_write``)."""
    moved = read + written
    ideal = read / raw_read + written / raw_write
    over, t = ("disk busy", busy_s) if busy_s else ("step time", seconds)
    return (moved / t if t > 0 else 0.0), (moved / ideal if ideal > 0 else 0.0), over


def slow_disk_warning(step: int, achieved: float, raw: float, over: str, share: float = SLOW_DISK_SHARE) -> str | None:
    """The line that flags a step whose disk throughput fell below ``share`` of the short raw probe's
    (None when ``achieved >= share x raw``, or nothing was moved). It does not say whose the time is: a
    virtual disk can stall under sustained writes, and the swappers' request pattern can fall short;
    ``tools/disk_mix_probe.py --sustained`` measures the disk alone."""
    if raw <= 0 or achieved >= share * raw:
        return None
    return (
        f"step {step}: disk throughput fell: {achieved / 1e6:,.0f} MB/s (bytes moved / {over}) vs "
        f"{raw / 1e6:,.0f} MB/s at the start of the run (the short raw probe, same read/write mix); a "
        "virtual disk can stall under sustained writes (tools/disk_mix_probe.py --sustained measures the "
        "disk alone, without zerodp)"
    )


def plan_match(every: list[dict], plan: dict) -> list[str]:
    """The line comparing each rank's measured peak RSS with the plan's RAM rows per rank (slack not
    counted; issue 31 item 2: within 10%), or none when the plan does not carry them."""
    rows = plan.get("ram_rows_per_rank")
    if not rows:
        return []
    return [
        f"per rank: peak RSS / the plan's RAM rows ({rows / 1e9:.2f} GB per rank, slack not counted): "
        + ", ".join(f"rank {r['rank']} {r['peak_rss'] / 1e9:.2f} GB = {r['peak_rss'] / rows:.2f}" for r in every)
    ]


def end_probe_lines(raw_write: float, raw_read: float, raw_end: tuple[float, float] | None) -> list[str]:
    """The raw figures measured again after the run (swap files removed), as shares of the start's,
    and a warning when either is below :data:`SLOW_DISK_SHARE` of it (the disk itself slowed down)."""
    if raw_end is None or min(raw_end) <= 0:
        return []
    w, r = raw_end[0] / raw_write, raw_end[1] / raw_read
    lines = [
        f"raw sequential direct I/O after the run (same probe): write {raw_end[0] / 1e6:,.0f} MB/s ({w:.2f} of "
        f"the start), read {raw_end[1] / 1e6:,.0f} MB/s ({r:.2f} of the start)"
    ]
    if min(w, r) < SLOW_DISK_SHARE:
        lines.append(
            "WARNING the disk itself is slower after the run than at its start (the same probe, nothing "
            "else of this job running): the steps' I/O ran against a disk slower than the raw figure"
        )
    return lines


def report(
    every: list[dict],
    plan: dict,
    raw_write: float,
    raw_read: float,
    build_s: float,
    device: str | None,
    raw_end: tuple[float, float] | None = None,
) -> str:
    m = plan["model"]
    lines = [
        "-" * 100,
        f"raw sequential direct I/O on this disk ({human_bytes(plan['probe_bytes'])}): write "
        f"{raw_write / 1e6:,.0f} MB/s, read {raw_read / 1e6:,.0f} MB/s",
        *end_probe_lines(raw_write, raw_read, raw_end),
        f"built under zero.Init + initialize in {build_s:.1f} s (GPT {m['n_layer']} x d_model {m['d_model']})",
        "per rank: peak RSS of the run (getrusage) | peak RSS up to the end of initialize | RSS after "
        "zero.Init | RSS after initialize",
    ]
    for r in every:
        lines.append(
            f"  rank {r['rank']}: {human_bytes(r['peak_rss'])} | {human_bytes(r['peak_rss_build'])} | "
            f"{human_bytes(r['rss_after_init'])} | {human_bytes(r['rss_after_initialize'])}"
        )
    lines += plan_match(every, plan)
    lines.append(f"per step (rank 0; I/O of all ranks summed; disk busy = io_ticks of {device or 'n/a'}):")
    lines.append(
        f"  {'step':>4} {'loss':>8} {'time s':>8} {'read':>10} {'written':>10} {'busy s':>8} "
        f"{'wait s':>8} {'I/O/raw':>8} {'hidden':>7} {'step/max(c,io)':>15} {'MB/s':>7} {'raw MB/s':>9} "
        f"{'tokens/s':>9}"
    )
    slow, windows = [], []
    for i, rec in enumerate(every[0]["records"]):
        read = sum(r["records"][i]["read"] for r in every)
        written = sum(r["records"][i]["written"] for r in every)
        wait = max(r["records"][i]["wait_s"] for r in every)
        t, busy = rec["seconds"], rec["busy_s"]
        ideal = read / raw_read + written / raw_write  # seconds the raw disk needs for this traffic
        if busy:
            eff, hidden = f"{ideal / busy:.2f}", f"{max(0.0, 1 - wait / busy):.0%}"
            ratio = f"{step_over_max(t, wait, busy):.2f}"
        else:
            eff = hidden = ratio = "n/a"
        achieved, raw, over = disk_throughput(read, written, busy, t, raw_read, raw_write)
        lines.append(
            f"  {rec['step']:>4} {rec['loss']:>8.4f} {t:>8.1f} {human_bytes(read):>10} "
            f"{human_bytes(written):>10} {busy if busy is not None else float('nan'):>8.1f} {wait:>8.1f} "
            f"{eff:>8} {hidden:>7} {ratio:>15} {achieved / 1e6:>7,.0f} {raw / 1e6:>9,.0f} "
            f"{rec.get('tokens', 0) / t if t > 0 else 0.0:>9,.1f}"
        )
        slow += [w] if (w := slow_disk_warning(rec["step"], achieved, raw, over)) else []
        if rec.get("disk_windows") is not None:
            windows.append(f"  step {rec['step']}: {summary(list(rec['disk_windows']), raw)}")
    lines.append(
        "  I/O/raw: (read / raw read + written / raw write) / busy; hidden: 1 - wait / busy; "
        "compute c = time - wait; MB/s: (read + written) / busy; raw MB/s: the same bytes at the raw "
        "figures above; tokens/s: tokens of all ranks in the step (accumulation x micro-batch x "
        "sequence x ranks) / step time"
    )
    lines += steady_lines(every)
    lines += phase_lines(every)
    lines += swap_lines(every)
    if windows:
        lines.append(
            "disk rate per 5 s window (/proc/diskstats, every process; min / median / max, and windows below "
            "half of the raw MB/s above):"
        )
        lines += windows
    lines.append(
        "peak RSS growth per step and phase (rank: forward / backward / step(); the peak was reached in "
        "the last phase that grew):"
    )
    for r in every:
        lines.append(
            f"  rank {r['rank']}: "
            + ", ".join(
                f"step {rec['step']} " + " / ".join(human_bytes(b) for b in rec.get("hwm_growth", (0, 0, 0)))
                for rec in r["records"]
            )
        )
    lines += ["WARNING " + w for w in slow]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", required=True, help="JSON written by zerodp.app.infinity")
    ap.add_argument("--nvme-path", required=True)
    args = ap.parse_args()
    run_worker(json.loads(args.plan), args.nvme_path)


if __name__ == "__main__":
    main()
