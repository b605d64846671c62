"""Python-level profile (cProfile, rank 0) of 9 training steps after 2 warm-up ones of one bench system on
the small GPT (2 ranks), sorted by SORT (default tottime): where the training thread blocks in
``Work.wait`` and what zerodp's own Python costs. Used for docs/benchmarks/2026-12-01-bench.md ("Stage 3 against DDP:
the breakdown").

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 tools/cprofile_steps.py "zerodp stage 3" [SORT]
"""

import cProfile
import pstats
import sys

import torch.distributed as dist

import zerodp
from zerodp.app.bench import make_batches
from zerodp.app.bench_args import PRESETS
from zerodp.app.bench_systems import SYSTEMS
from zerodp.app.model import GPTConfig

zerodp.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
n_layer, n_head, d_model, seq_len, micro = PRESETS["small"]
cfg = GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=seq_len)
batches = make_batches(cfg, micro, 11, rank, world)
s = SYSTEMS[sys.argv[1]](cfg, 1e-3, False)
for x, y in batches[:2]:
    s.forward_backward(x, y)
    s.step()
pr = cProfile.Profile()
pr.enable()
for x, y in batches[2:]:
    s.forward_backward(x, y)
    s.step()
pr.disable()
if rank == 0:
    st = pstats.Stats(pr)
    st.sort_stats(sys.argv[2] if len(sys.argv) > 2 else "tottime")
    st.print_stats(35)
zerodp.shutdown_distributed()
