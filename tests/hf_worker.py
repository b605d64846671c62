"""HF transformers models (GPT-2 and Llama from small configs, no download) trained under ZeRO stages
0-3 on 2 ranks against the single-process model on the same global batch; the consolidated checkpoint
loads into a fresh HF model with ``load_state_dict(strict=True)``; greedy ``generate()`` on the engine's
module (stage 3: every rank calls it) equals the reference's. Run by tests/test_hf_interop.py."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

import zerodp
from distributed import run_scenarios
from zerodp.checkpoint import consolidate, load_safetensors_weights

ROWS, SEQ, VOCAB, STEPS = 2, 12, 64, 2
# AdamW eps 1e-3: with the default 1e-8, elements whose gradient is at rounding level get updates of
# +-lr from either side of zero, so two correct runs that sum in another order differ by ~lr there.


def hf_config(kind: str) -> Any:
    if kind == "gpt2":
        return GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=32,
    )


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(kind)).float()


def batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(step))


def engine_config(stage: int, persistence_threshold: int | None = None) -> dict:
    zc: dict[str, Any] = {"stage": stage}
    if persistence_threshold is not None:  # 0: partition every parameter, however small
        zc["stage3_param_persistence_threshold"] = persistence_threshold
    return {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "eps": 1e-3}},
        "zero_optimization": zc,
    }


def hf_weights(kind: str, ckpt_dir: Path) -> dict:
    """Stage 3: an unwrapped HF model's ``state_dict()`` and its ``save_pretrained`` safetensors shards
    (with the index JSON; the tied head saved once) load into engines built from other weights."""
    other = build(kind, seed=5)
    want = {k: v.clone() for k, v in other.state_dict().items()}
    engine = zerodp.initialize(build(kind), engine_config(3))
    engine.load_module_state_dict(other.state_dict())
    got = engine.module_state_dict()
    d = ckpt_dir / f"{kind}-pretrained"
    if dist.get_rank() == 0:
        other.save_pretrained(str(d), max_shard_size="40KB", safe_serialization=True)
    dist.barrier()
    weights = load_safetensors_weights(d)
    engine2 = zerodp.initialize(build(kind), engine_config(3))
    engine2.load_module_state_dict(weights)
    got2 = engine2.module_state_dict()
    return {
        "ok_keys": sorted(got) == sorted(want) == sorted(got2),
        "compared": len(want),
        "state_dict_equal": all(torch.equal(got[k], want[k]) for k in want),
        "shards_equal": all(torch.equal(got2[k], want[k]) for k in want),
        "shards": len(list(d.glob("*.safetensors"))),
        "index": (d / "model.safetensors.index.json").is_file(),
        "saved_names": len(weights),
    }


def run(stage: int, kind: str, ckpt_dir: Path, init: bool = False) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = engine_config(stage, 0 if init else None)
    if init:  # partitioned while built; HF's post_init runs on the partitioned parameters
        with zerodp.zero.Init(config):
            model = build(kind)
    else:
        model = build(kind)
    partitioned = sum(zerodp.zero.is_partitioned(p) for p in model.parameters())
    engine = zerodp.initialize(model, config)
    ref = build(kind)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1, eps=1e-3)
    for step in range(STEPS):
        ids = batch(step, ROWS * world)
        mine = ids[rank * ROWS : (rank + 1) * ROWS]
        engine.backward(engine(input_ids=mine, labels=mine).loss)
        engine.step()
        opt.zero_grad()
        ref(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    got, want = engine.module_state_dict(), ref.state_dict()
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    max_err = max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
    d = ckpt_dir / f"{kind}-stage{stage}"
    engine.save_checkpoint(d)
    strict_load_equal = None
    if rank == 0:
        out = consolidate(d, d / "model.safetensors")
        fresh = AutoModelForCausalLM.from_config(hf_config(kind)).float()
        missing = fresh.load_state_dict(load_file(str(out)), strict=True)
        strict_load_equal = (
            not missing.missing_keys
            and not missing.unexpected_keys
            and all(torch.equal(fresh.state_dict()[k], got[k]) for k in want)
        )
    prompt = batch(99, 1)[:, :4]
    engine.module.eval()
    ref.eval()
    with torch.no_grad():
        gen = engine.module.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        ref_gen = ref.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    return {
        "max_err": max_err,
        "compared": len(want),
        "strict_load_equal": strict_load_equal,
        "partitioned_before_initialize": partitioned,
        "generated": gen.tolist(),
        "ref_generated": ref_gen.tolist(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--scenarios", default="gpt2,llama")
    ap.add_argument("--ckpt-dir", required=True)
    args = ap.parse_args()
    zerodp.init_distributed(timeout_s=120)
    jobs = [
        (f"{kind}@{stage}", lambda k=kind, s=stage: run(s, k, Path(args.ckpt_dir)))
        for stage in (int(s) for s in args.stages.split(","))
        for kind in args.scenarios.split(",")
    ]
    for kind in args.scenarios.split(","):
        jobs.append((f"{kind}-init@3", lambda k=kind: run(3, k, Path(args.ckpt_dir) / "init", init=True)))
        jobs.append((f"{kind}-weights@3", lambda k=kind: hf_weights(k, Path(args.ckpt_dir))))
    run_scenarios(args.out, jobs)


if __name__ == "__main__":
    main()
