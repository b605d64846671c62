"""Count the parameter-shard reads of each phase when the NVMe optimizer step overlaps the next forward
(a development tool; issue 31 item 4). One process, gloo, stage 3 with both offloads on NVMe,
``overlap_step`` on, 12 units of Linear(1024, 1024) (2.1 MB of bf16 shard each), four steps.

    python tools/shard_reread_probe.py NVME_DIR MAX_IN_CPU_BYTES

Prints per step and phase (forward with the step's loop, backward, ``step()``) the swapper's counters:
bytes read, demand reads, reads ahead, blank pins (no read), bytes written. With a read-ahead budget
(``offload_param.max_in_cpu``) that holds every shard, the loop's updated shards are kept and the
forward reads none of them; with a budget of two shards the forward reads back shards the loop has
just cast and written.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import zerodp


def main(base: str, max_in_cpu: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    path = tempfile.mkdtemp(dir=base)
    nvme = {"device": "nvme", "nvme_path": path}
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 300_000,
            "stage3_param_persistence_threshold": 1000,
            "offload_optimizer": {**nvme, "buffer_count": 8, "overlap_step": True},
            "offload_param": {**nvme, "buffer_count": 5, "buffer_size": 2_200_000, "max_in_cpu": max_in_cpu},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2},
    }
    try:
        with zerodp.zero.Init(cfg):
            model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.Tanh()) for _ in range(12)])
        engine = zerodp.initialize(model, cfg)
        c = engine.param_offload.swapper.counters

        def snap() -> tuple[int, ...]:
            return (c.bytes_read, c.demand_reads, c.reads_ahead, c.blank_acquires, c.bytes_written)

        x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(0)).bfloat16()
        print("per phase: bytes read, demand reads, reads ahead, blank pins, bytes written")
        for step in range(4):
            marks = [snap()]
            loss = engine(x).float().square().mean()
            marks.append(snap())
            engine.backward(loss)
            marks.append(snap())
            engine.step()
            marks.append(snap())
            parts = [tuple(b - a for a, b in zip(u, v, strict=True)) for u, v in zip(marks, marks[1:], strict=False)]
            print(f"step {step}: forward {parts[0]}, backward {parts[1]}, step() {parts[2]}")
        engine.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], int(float(sys.argv[2])))
