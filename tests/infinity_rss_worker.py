"""Peak RSS of ZeRO-Infinity on one rank (tests/test_infinity_rss.py): an MLP of ``--layers`` x
Linear(WIDTH, WIDTH) built under ``zerodp.zero.Init`` at stage 3, bf16, ``offload_param`` and
``offload_optimizer`` on NVMe, every pool and buffer configured at a fixed size (``sub_group_size``,
``buffer_size``, ``max_in_cpu``, the stage-3 live window and the reduce bucket: a layer or a few),
``STEPS`` steps with clipping. Writes the process's peak resident set (``VmHWM`` of
``/proc/self/status``: the kernel's figure, not the engine's), the peak of each phase of each step
(forward, backward, ``step()``: ``VmHWM`` reset by writing 5 to ``/proc/self/clear_refs`` before it) and
the parameter count as JSON. The phase peaks show a transient that another phase's higher peak would
hide from the overall one (the first step's backward held every unit's gradient staging once).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import zerodp

WIDTH, STEPS = 1024, 3


def read_status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def config(nvme: str) -> dict:
    layer = WIDTH * WIDTH + WIDTH
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 1 << 18,
            "reduce_bucket_size": layer,
            "stage3_max_live_parameters": 2 * layer,
            "stage3_prefetch_bucket_size": layer,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4},
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme,
                "buffer_count": 4,
                "buffer_size": 1 << 22,
                "max_in_cpu": 1 << 23,
            },
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--nvme", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    zerodp.init_distributed()
    cfg = config(args.nvme)
    torch.manual_seed(0)
    with zerodp.zero.Init(config=cfg):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(args.layers)])
    phases = {"init": (read_status("VmHWM"), read_status("VmRSS"))}
    engine = zerodp.initialize(model, cfg)
    phases["initialize"] = (read_status("VmHWM"), read_status("VmRSS"))
    numel = engine.numel
    losses = []
    peak = read_status("VmHWM")
    phase_peaks = {}

    def phase(name: str, fn):
        nonlocal peak
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # VmHWM := VmRSS now
        out = fn()
        phase_peaks[name] = read_status("VmHWM")
        peak = max(peak, phase_peaks[name])
        return out

    for step in range(STEPS):
        x = torch.randn(4, WIDTH, dtype=torch.bfloat16)
        loss = phase(f"forward{step + 1}", lambda x=x: engine(x).float().pow(2).mean())
        phase(f"backward{step + 1}", lambda loss=loss: engine.backward(loss))
        phase(f"step{step + 1}", engine.step)
        losses.append(loss.item())
        phases[f"step{len(losses)}"] = (read_status("VmHWM"), read_status("VmRSS"))
    spilled = getattr(engine.reducer, "spill", None) is not None
    engine.close()
    with open(args.out, "w", encoding="ascii") as f:
        json.dump(
            {
                "numel": numel,
                "peak": peak,
                "losses": losses,
                "spilled": spilled,
                "phases": phases,
                "phase_peaks": phase_peaks,
            },
            f,
        )
    zerodp.shutdown_distributed()


if __name__ == "__main__":
    main()
