"""Save checkpoints and resume from the latest one:
torchrun --nproc-per-node 2 examples/resume.py --steps 100 --save-at 50               # saves at step 50
torchrun --nproc-per-node 2 examples/resume.py --steps 100 --resume                   # continues at 50"""
import argparse
import hashlib

import torch
from torch import nn

import zerodp

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--save-at", type=int, nargs="*", default=[], help="steps after which to save")
parser.add_argument("--save-dir", default="checkpoints")
parser.add_argument("--resume", action="store_true", help="load the latest checkpoint of --save-dir first")
parser.add_argument("--stage", type=int, default=3)
args = parser.parse_args()

config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 10}},
          "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 100}}
zerodp.init_distributed()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
engine = zerodp.initialize(model, config)
start = 0
if args.resume:  # parameters, optimizer states, scheduler and RNG states; any stage or world size
    path, client_state = engine.load_checkpoint(args.save_dir)
    start = client_state["next_step"]
    if engine.rank == 0:
        print(f"resumed from {path} at step {start}")

micro = config["train_micro_batch_size_per_gpu"]
for step in range(start, args.steps):
    x = torch.randn(micro * engine.world_size, 16, generator=torch.Generator().manual_seed(step))
    x = x[engine.rank * micro:(engine.rank + 1) * micro].to(engine.device)
    loss = nn.functional.mse_loss(engine(x), x.flip(-1))
    engine.backward(loss)
    engine.step()
    if step + 1 in args.save_at:  # every rank calls it: a collective
        engine.save_checkpoint(args.save_dir, client_state={"next_step": step + 1})

state = engine.module_state_dict()  # full fp32 weights on every rank (a collective)
digest = hashlib.sha256(b"".join(v.cpu().numpy().tobytes() for _, v in sorted(state.items()))).hexdigest()
if engine.rank == 0:
    print(f"step {args.steps} loss {loss.item():.6f} weights sha256 {digest[:16]}")
zerodp.shutdown_distributed()
