"""torch.profiler self-CPU table (rank 0, 5 steps after one) of each named bench system on the small
GPT (2 ranks), e.g. ``"zerodp stage 0,zerodp stage 3"``, ROWS rows; the per-operator differences
between two systems are read from the two tables. Used for docs/benchmarks/2026-12-01-bench.md ("Stage 3 against DDP:
the breakdown").

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 tools/profile_ops.py "zerodp stage 0,zerodp stage 3" 60
"""

import sys

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import zerodp
from zerodp.app.bench import make_batches
from zerodp.app.bench_args import PRESETS
from zerodp.app.bench_systems import SYSTEMS
from zerodp.app.model import GPTConfig


def print_profiles(names: list, cfg: GPTConfig, batches: list, rows: int, rank: int) -> None:
    """For each bench system in ``names``: one step on ``batches[0]``, then a torch.profiler self-CPU
    table of the remaining steps, ``rows`` rows, printed by rank 0 (also used by profile_stage12.py)."""
    for name in names:
        s = SYSTEMS[name](cfg, 1e-3, False)
        s.forward_backward(*batches[0])
        s.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for x, y in batches[1:]:
                s.forward_backward(x, y)
                s.step()
        if rank == 0:
            print(name)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
        del s


if __name__ == "__main__":
    zerodp.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    n_layer, n_head, d_model, seq_len, micro = PRESETS["small"]
    cfg = GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=seq_len)
    print_profiles(sys.argv[1].split(","), cfg, make_batches(cfg, micro, 6, rank, world), int(sys.argv[2]), rank)
    zerodp.shutdown_distributed()
