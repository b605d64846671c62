"""A Hugging Face transformers model at ZeRO stage 3, built partitioned under zero.Init:
torchrun --nproc-per-node 2 examples/hf_model.py (needs `pip install transformers`)"""
import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import zerodp

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}
zerodp.init_distributed()
torch.manual_seed(0)
with zerodp.zero.Init(config=config):  # HF's post_init() runs on the full tensors, then they are partitioned
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
engine = zerodp.initialize(model, config)

text = torch.arange(4096) * 7 % 128  # a periodic token sequence the model can learn
micro = config["train_micro_batch_size_per_gpu"]
for step in range(args.steps):
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, text.numel() - 33, (micro * engine.world_size,), generator=g)
    ids = torch.stack([text[s:s + 32] for s in starts])[engine.rank * micro:(engine.rank + 1) * micro]
    ids = ids.to(engine.device)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    if engine.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
        print(f"step {step} loss {loss.item():.4f}")

engine.eval()
prompt = text[:8].unsqueeze(0).to(engine.device)
out = engine.module.generate(prompt, max_new_tokens=8, do_sample=False)  # every rank calls it
if engine.rank == 0:
    print("generated", out[0, 8:].tolist(), "expected", text[8:16].tolist())
zerodp.shutdown_distributed()
