"""Global gradient norm (``engine.get_global_grad_norm()``) of the first 3 steps at stages 2 and 3, on
the same seeded 4-layer d_model-128 GPT, data and ``gradient_clipping`` 1.0 (2 ranks); rank 0 prints
both lists (10 decimals). Used for docs/benchmarks/2026-12-01-train-demo.md ("Stage 3"): the fp32 chunk norms follow
each stage's partition layout, so the norms differ in the last digits.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 tools/norm_by_stage.py
"""

import torch
import torch.distributed as dist

import zerodp
from zerodp.app.bench import make_batches
from zerodp.app.bench_systems import loss_of
from zerodp.app.model import GPT, GPTConfig

zerodp.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
cfg = GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=64)
batches = make_batches(cfg, 8, 3, rank, world)
res = {}
for stage in (2, 3):
    torch.manual_seed(0)
    m = GPT(cfg)
    eng = zerodp.initialize(
        m,
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage},
        },
    )
    norms = []
    for x, y in batches:
        eng.backward(loss_of(eng(x)[0], y))
        eng.step()
        norms.append(eng.get_global_grad_norm())
    res[stage] = norms
    eng.close()
if rank == 0:
    print({k: [f"{v:.10f}" for v in n] for k, n in res.items()})
zerodp.shutdown_distributed()
