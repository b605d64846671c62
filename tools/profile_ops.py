"""torch.profiler self-CPU table (rank 0, 5 steps after one) of each named bench system on the small
GPT (2 ranks), e.g. ``"zerodp stage 0,zerodp stage 3"``, ROWS rows; the per-operator differences
between two systems are read from the two tables. Used for docs/bench.md ("Stage 3 against DDP: the
breakdown").

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 tools/profile_ops.py "zerodp stage 0,zerodp stage 3" 60
"""
import sys

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import zerodp
from zerodp.app.bench import PRESETS, _batches
from zerodp.app.bench_systems import SYSTEMS
from zerodp.app.model import GPTConfig

zerodp.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
n_layer, n_head, d_model, seq_len, micro = PRESETS["small"]
cfg = GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=seq_len)
batches = _batches(cfg, micro, 6, rank, world)
for name in sys.argv[1].split(","):
    s = SYSTEMS[name](cfg, 1e-3, False)
    s.forward_backward(*batches[0]); s.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in batches[1:]:
            s.forward_backward(x, y); s.step()
    if rank == 0:
        print(name)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=int(sys.argv[2])))
    del s
zerodp.shutdown_distributed()
