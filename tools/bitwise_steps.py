"""Digest of a short training run, to compare two trees bit for bit (used for the step's fused presence
and norm all-reduce, docs/benchmarks/2026-12-02-host-overhead.md): 6 steps of a 3-Linear model at
stages 1-3, fp32/bf16/fp16, ``gradient_clipping`` 0 and 0.05, the last Linear used on every rank, on
rank 0 only in odd steps, or on no rank at step 2; rank 0 prints per configuration a SHA-256 prefix of
``module_state_dict()`` and ``get_global_grad_norm()`` per step as ``float.hex``.

    PYTHONPATH=<tree>/src OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 tools/bitwise_steps.py > out.txt   # then cmp the two trees' outputs
"""

import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn

import zerodp


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)
        self.extra = nn.Linear(16, 16)

    def forward(self, x, use_extra):
        h = self.b(torch.tanh(self.a(x)))
        return self.extra(h) if use_extra else h


def run(stage, clip, variant, dtype):
    torch.manual_seed(0)
    m = M()
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "device": "cpu",
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    e = zerodp.initialize(m, cfg)
    r = dist.get_rank()
    norms = []
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + r)
        x = torch.randn(8, 16, generator=g)
        # variant "partial": the extra layer used on rank 0 only in odd steps; "none": never on any rank at step 2
        use = {"all": True, "partial": not (step % 2 == 1 and r != 0), "none": step != 2}[variant]
        out = e(x.to(dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]), use)
        e.backward(out.float().square().mean() * 10)
        e.step()
        norms.append(e.get_global_grad_norm())
    h = hashlib.sha256()
    for _name, p in sorted(e.module_state_dict().items()):
        h.update(p.float().numpy().tobytes())
    return h.hexdigest()[:16], [float(n).hex() if n is not None else None for n in norms]


dist.init_process_group("gloo")
for stage in (1, 2, 3):
    for clip in (0.0, 0.05):
        for variant in ("all", "partial", "none"):
            for dtype in ("fp32", "bf16", "fp16"):
                if stage == 3 and variant == "partial":
                    continue
                d, n = run(stage, clip, variant, dtype)
                if dist.get_rank() == 0:
                    print(stage, clip, variant, dtype, d, n, flush=True)
dist.destroy_process_group()
