"""Stage-3 traffic of the bench's small (tied) GPT per step in Psi, and its parameter all-gathers,
for ``stage3_max_reuse_distance`` 0, 1 and 1e9, after the recording step (2 ranks, rank 0 prints).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 tools/stage3_reuse.py
"""

import torch
import torch.distributed as dist

import zerodp
from zerodp.app.bench_systems import loss_of
from zerodp.app.model import GPT, GPTConfig

zerodp.init_distributed()
r = dist.get_rank()
cfg = GPTConfig(n_layer=4, n_head=4, d_model=256, seq_len=128)
x = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(r))
for distance in (0, 1, 1_000_000_000):
    torch.manual_seed(0)
    eng = zerodp.initialize(
        GPT(cfg),
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 1000,
                "stage3_max_reuse_distance": distance,
            },
        },
    )
    losses = []
    for i in range(4):
        if i == 1:
            eng.reset_comm_report()
        loss = loss_of(eng(x[:, :-1])[0], x[:, 1:])
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    rep = eng.comm_report()
    gathers = sum(rec.count for rec in rep.records if rec.op == "all_gather" and rec.purpose == "parameters")
    if r == 0:
        print(
            f"stage3_max_reuse_distance={distance}: {rep.model_traffic_elements / rep.steps / rep.numel:.3f} Psi "
            f"per step, {gathers / rep.steps:.1f} parameter all-gathers (units) per step, "
            f"reuse_hits={eng.sharding.coordinator.reuse_hits}, "
            f"peak gathered {eng.sharding.coordinator.peak_gathered_bytes / 2**20:.1f} MiB, losses {losses}"
        )
zerodp.shutdown_distributed()
