"""Step time of config variants of zerodp against DDP on the bench's GPT (2 ranks), interleaved over
rounds (reversed every other round), median wall time per step between barriers and median process
CPU time (all threads) per step; rank 0 prints each variant's medians, their ratios to DDP's, and the
quartiles over rounds of the ratio of a round's median to DDP's median in the same round. Used for
docs/benchmarks/2026-12-01-bench.md ("Stage 3 against DDP: the breakdown").

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 python -m torch.distributed.run --standalone \
        --nproc-per-node 2 tools/bench_variants.py PRESET VARIANTS ROUNDS

VARIANTS is a comma list of ``DDP`` and ``s<stage>:<what>``, ``what`` one of ``0`` (the bench's
config), ``noguard`` (``collective_guard.enabled`` false), ``nogathers`` (``check_gathers`` false),
``nobwdtags`` (the guard with the backward agreement's tags removed after the engine is built: an
experiment, not a configuration), ``nowatch`` (data waits not polled for tags while that variant
runs: an experiment) or a number (``reduce_bucket_size`` in elements), e.g. ``DDP,s3:0,s3:nogathers,s3:noguard``.
"""

import statistics
import sys
import time

import torch.distributed as dist

import zerodp
from zerodp.app.bench import make_batches
from zerodp.app.bench_args import PRESETS
from zerodp.app.bench_systems import SYSTEMS
from zerodp.app.model import GPTConfig
from zerodp.runtime import comm

zerodp.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
n_layer, n_head, d_model, seq_len, micro = PRESETS[sys.argv[1]]
cfg = GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=seq_len)
batches = make_batches(cfg, micro, 6, rank, world)
orig = zerodp.initialize
variants = sys.argv[2].split(",")  # e.g. DDP,s2:0,s2:800000


def build(v):
    if v == "DDP":
        return SYSTEMS["DDP"](cfg, 1e-3, False)
    st, rb = v[1:].split(":")

    def init(m, c):
        if rb == "noguard":
            c["collective_guard"] = {"enabled": False}
        elif rb == "nogathers":
            c["collective_guard"] = {"check_gathers": False}
        elif rb in ("nobwdtags", "nowatch"):
            pass
        elif int(rb):
            c["zero_optimization"]["reduce_bucket_size"] = int(rb)
        engine = orig(m, c)
        if rb == "nobwdtags":  # the guard without the backward agreement's tags (an experiment)
            engine.backward_tags = None
            engine.collective_guard.backward_gather = lambda position: None
            engine.reducer.launch_check = None
        from zerodp.runtime import comm

        comm._watched = _plain_waits if rb == "nowatch" else _WATCHED  # until the next build
        return engine

    zerodp.initialize = init
    try:
        return SYSTEMS[f"zerodp stage {st}"](cfg, 1e-3, False)
    finally:
        zerodp.initialize = orig


_WATCHED = comm._watched


def _plain_waits(work, async_op):
    """``nowatch``: the guard's tags are posted, but data waits are plain ``wait()`` (not polled)."""
    if async_op or work is None:
        return work
    work.wait()
    return None


wall = {v: [] for v in variants}
cpu = {v: [] for v in variants}
per_round = {v: [] for v in variants}  # each round's median wall time per step
for rnd in range(int(sys.argv[3])):
    for v in variants if rnd % 2 == 0 else variants[::-1]:
        s = build(v)
        mine = []
        for i, (x, y) in enumerate(batches):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            s.forward_backward(x, y)
            s.step()
            c1 = time.process_time()
            dist.barrier()
            if i > 0:
                mine.append(time.perf_counter() - t0)
                cpu[v].append(c1 - c0)
        wall[v] += mine
        per_round[v].append(statistics.median(mine))
        del s
if rank == 0:
    b, bc = statistics.median(wall["DDP"]), statistics.median(cpu["DDP"])
    for v in variants:
        w, c = statistics.median(wall[v]), statistics.median(cpu[v])
        # the ratio to DDP's median in the same round: its quartiles over rounds
        q = (
            statistics.quantiles([a / d for a, d in zip(per_round[v], per_round["DDP"], strict=True)], n=4)
            if len(per_round[v]) > 1
            else [w / b] * 3
        )
        print(
            f"{v:>14} wall {w:.4f} s {w / b:.3f}x (per-round ratio quartiles {q[0]:.3f} / {q[1]:.3f} / "
            f"{q[2]:.3f})   process CPU {c:.4f} s {c / bc:.3f}x"
        )
zerodp.shutdown_distributed()
