"""A DeepSpeed training script run on zerodp by changing its import:
torchrun --nproc-per-node 2 examples/deepspeed/train.py --deepspeed_config examples/deepspeed/ds_config.json"""
import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import zerodp.deepspeed as deepspeed  # was: import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config", default="examples/deepspeed/ds_config.json")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--save-dir", default="checkpoints")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

deepspeed.init_distributed()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 4))
g = torch.Generator().manual_seed(1)
inputs = torch.randn(512, 16, generator=g)
labels = (inputs[:, :4] + 0.1 * torch.randn(512, 4, generator=g)).argmax(dim=1)
engine, optimizer, loader, scheduler = deepspeed.initialize(
    args=args, model=model, model_parameters=model.parameters(), training_data=TensorDataset(inputs, labels))

for epoch in range(args.epochs):
    loader.sampler.set_epoch(epoch)
    for x, y in loader:  # this rank's micro-batches of train_micro_batch_size_per_gpu samples
        x, y = x.to(engine.device), y.to(engine.device)
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()  # an optimizer step every gradient_accumulation_steps micro-batches
    if engine.global_rank == 0:
        print(f"epoch {epoch} step {engine.global_steps} loss {loss.item():.4f} lr {engine.get_lr()[0]:.4g}")
engine.save_checkpoint(args.save_dir, client_state={"epoch": args.epochs})
