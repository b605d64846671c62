"""Peak RSS (``VmHWM``, MiB) of one system after each phase, on the bench's small GPT (2 gloo ranks,
fp32 AdamW, a fresh process per system): after the process group, after building, then after each
forward, backward and optimizer step of 4 steps; each rank prints. ``system``: ``ddp`` or a zerodp
stage; a second argument sets ``reduce_bucket_size`` (zerodp) or ``bucket_cap_mb`` (DDP, MiB).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 tools/rss_phases.py ddp|0|1|2|3
"""

import sys

import torch
import torch.distributed as dist

import zerodp
from zerodp.app.bench_systems import loss_of
from zerodp.app.model import GPT, GPTConfig


def hwm() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return 0.0


system = sys.argv[1]
marks = {"imported": hwm()}
zerodp.init_distributed()
r = dist.get_rank()
marks["process group"] = hwm()
torch.manual_seed(0)
m = GPT(GPTConfig(n_layer=4, n_head=4, d_model=256, seq_len=128))
if system == "ddp":
    from torch.nn.parallel import DistributedDataParallel

    eng = DistributedDataParallel(m, **({"bucket_cap_mb": float(sys.argv[2])} if len(sys.argv) > 2 else {}))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
else:
    eng = zerodp.initialize(
        m,
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": int(system),
                **({"reduce_bucket_size": int(sys.argv[2])} if len(sys.argv) > 2 else {}),
                **({"stage3_param_persistence_threshold": 1000} if system == "3" else {}),
            },
        },
    )
marks["built"] = hwm()
x = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(r))
for i in range(4):
    out = eng(x[:, :-1])
    loss = loss_of(out[0] if isinstance(out, tuple) else out, x[:, 1:])
    marks[f"fwd{i}"] = hwm()
    if system == "ddp":
        loss.backward()
        marks[f"bwd{i}"] = hwm()
        opt.step()
        opt.zero_grad()
    else:
        eng.backward(loss)
        marks[f"bwd{i}"] = hwm()
        eng.step()
    marks[f"step{i}"] = hwm()
print(f"{system} rank {r}:", " ".join(f"{k} {v:.1f}" for k, v in marks.items()), flush=True)
zerodp.shutdown_distributed()
