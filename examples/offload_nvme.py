"""ZeRO-Infinity: stage 3 with parameters and optimizer states swapped to NVMe files:
torchrun --nproc-per-node 2 examples/offload_nvme.py --nvme-path /mnt/nvme (an existing directory)"""
import argparse

import torch
from torch import nn

import zerodp

parser = argparse.ArgumentParser()
parser.add_argument("--nvme-path", required=True)
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

config = {
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 1000,
        "offload_param": {"device": "nvme", "nvme_path": args.nvme_path},
        "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_path},
    },
}
zerodp.init_distributed()
torch.manual_seed(0)
with zerodp.zero.Init(config=config):  # each layer's shard goes to the swap file as soon as it is built
    model = nn.Sequential(nn.Linear(32, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 1))
engine = zerodp.initialize(model, config)

micro = config["train_micro_batch_size_per_gpu"]
w_true = torch.randn(32, generator=torch.Generator().manual_seed(1)).to(engine.device)
for step in range(args.steps):
    x = torch.randn(micro * engine.world_size, 32, generator=torch.Generator().manual_seed(step))
    x = x[engine.rank * micro:(engine.rank + 1) * micro].to(engine.device)
    loss = nn.functional.mse_loss(engine(x).squeeze(-1), torch.tanh(x @ w_true / 4))
    engine.backward(loss)
    engine.step()
    if engine.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
        print(f"step {step} loss {loss.item():.4f}", flush=True)

for rank in range(engine.world_size):  # one rank at a time, so that the reports do not interleave
    if rank == engine.rank:
        print(engine.offload_report().format(), flush=True)  # host and NVMe bytes, measured vs formula
    torch.distributed.barrier()
engine.close()  # removes this rank's swap files
zerodp.shutdown_distributed()
