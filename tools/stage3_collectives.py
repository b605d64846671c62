"""Collectives per training step at stage 3 on the bench's small GPT (2 ranks), counted by patching
``torch.distributed``'s all-gather / reduce-scatter entry points and its coalescing manager: a coalesced
group counts once, as the backend sees it. Printed by rank 0 for 2 steps after 2 warm-up steps.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 tools/stage3_collectives.py
"""

import zerodp
from stage3_harness import count_collectives, counts, small_gpt_engine

count_collectives()
eng, r, step = small_gpt_engine(3)
for _ in range(2):
    step()
counts.clear()
for _ in range(2):
    step()
if r == 0:
    print({k: v / 2 for k, v in sorted(counts.items())}, "per step (single collectives outside groups; groups)")
zerodp.shutdown_distributed()
