"""Train one's own model with ZeRO: torchrun --nproc-per-node 2 examples/train_own_model.py --stage 3"""
import argparse

import torch
from torch import nn

import zerodp

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
parser.add_argument("--steps", type=int, default=100)
args = parser.parse_args()

config = {
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 1000},
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
        self.head = nn.Linear(256, 1)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


zerodp.init_distributed()  # the process group from torchrun's environment (gloo; NCCL for CUDA tensors)
torch.manual_seed(0)
with zerodp.zero.Init(config=config, enabled=args.stage == 3):  # stage 3: partitioned while built
    model = Net()
engine = zerodp.initialize(model, config)

micro = config["train_micro_batch_size_per_gpu"]
w_true = torch.randn(32, generator=torch.Generator().manual_seed(1)).to(engine.device)
for step in range(args.steps):
    # one global batch per step, the same on every rank; each rank trains on its own rows of it
    x = torch.randn(micro * engine.world_size, 32, generator=torch.Generator().manual_seed(step))
    x = x[engine.rank * micro:(engine.rank + 1) * micro].to(engine.device)  # where the model is
    loss = nn.functional.mse_loss(engine(x), torch.tanh(x @ w_true / 4))
    engine.backward(loss)  # averages the gradients over the ranks (reduce-scatter at stages 2-3)
    engine.step()
    if engine.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
        print(f"step {step} loss {loss.item():.4f}")

if engine.rank == 0:
    print(engine.memory_report().format())  # this rank's model states: measured vs the ZeRO formula
zerodp.shutdown_distributed()
