"""Train the default ``zerodp train`` GPT at ZeRO stages 0-3 on one device and compare every step's loss
with plain PyTorch on the same device (same initial weights, same batches, AdamW, gradient clipping
1.0 as ``zerodp train``). Written for tools/gpu_check.sh (``--device cuda``); runs on the CPU too.

    python tools/gpu_train_compare.py --device cuda --steps 50 --out compare.json

Writes one JSON object: per stage the max relative loss difference over the steps, the first and last
losses, seconds, and (on CUDA) ``torch.cuda.max_memory_allocated`` bytes; ``pass`` when every stage's
max relative difference is at most ``--rtol``. Exit status 0 when all pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import zerodp
from zerodp.app import data
from zerodp.app.model import GPT
from zerodp.app.train import DEFAULTS, resolve_settings

#: the optimizer settings that must agree between the two sides
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def hyperparameters(opt: torch.optim.Optimizer) -> dict:
    """The first parameter group's :data:`HYPERPARAMETERS` (betas as a list, for JSON)."""
    group = opt.param_groups[0]
    return {k: list(group[k]) if isinstance(group[k], tuple) else group[k] for k in HYPERPARAMETERS if k in group}


def plain_losses(
    model: torch.nn.Module, batches: list, lr: float, clip: float, betas: tuple[float, float], weight_decay: float
) -> tuple[list[float], dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
    out = []
    for x, y in batches:
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        out.append(loss.item())
    return out, hyperparameters(opt)


def zerodp_losses(model: torch.nn.Module, config: dict, batches: list) -> tuple[list[float], str, dict]:
    engine = zerodp.initialize(model, config)
    out = []
    for x, y in batches:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out, str(engine.device), hyperparameters(engine.optimizer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument(
        "--rtol", type=float, default=1e-3, help="largest relative loss difference accepted at any step (default 1e-3)"
    )
    ap.add_argument("--n-layer", type=int, default=None, help="smaller model (tests on the CPU)")
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_train_compare: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    zerodp.init_distributed()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    flags = argparse.Namespace(
        n_layer=args.n_layer, d_model=args.d_model, seq_len=args.seq_len, micro_batch=args.micro_batch
    )
    settings = resolve_settings(flags)
    mcfg = settings.model
    micro = settings.engine_config.train_micro_batch_size_per_gpu
    tokens = data.encode(data.load_text(None, min_bytes=data.min_corpus_bytes(mcfg.seq_len)))
    train_tokens, _ = data.split(tokens)
    glob = data.GlobalBatches(train_tokens, mcfg.seq_len, micro, 1, seed=DEFAULTS.seed)
    batches = [tuple(t.to(device) for t in glob.batch(i)) for i in range(args.steps)]
    lr, clip = DEFAULTS.lr, DEFAULTS.gradient_clipping
    # AdamW's settings as ``zerodp train`` sets them, given to both sides (zerodp's config AdamW without
    # ``weight_decay`` gets DeepSpeed's 0, torch's AdamW 0.01: the first GPU run compared those)
    opt_params = settings.engine_config.optimizer.params
    betas = (float(opt_params.betas[0]), float(opt_params.betas[1])) if opt_params.betas else (0.9, 0.999)
    weight_decay = float(opt_params.weight_decay or 0.0)

    torch.manual_seed(DEFAULTS.seed)
    initial = GPT(mcfg).state_dict()
    ref_model = GPT(mcfg)
    ref_model.load_state_dict(initial)
    ref, ref_hyper = plain_losses(ref_model.to(device), batches, lr, clip, betas, weight_decay)
    result: dict = {
        "device": str(device),
        "steps": args.steps,
        "rtol": args.rtol,
        "model": mcfg.__dict__,
        "micro_batch": micro,
        "reference_first_last": [ref[0], ref[-1]],
        "reference_losses": ref,
        "reference_hyperparameters": ref_hyper,
        "stages": {},
    }
    ok = True
    for stage in (int(s) for s in args.stages.split(",")):
        zc = {"stage": stage}
        if stage == 3:
            zc.update(stage3_param_persistence_threshold=DEFAULTS.stage3_param_persistence_threshold)
        config = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_clipping": clip,
            "device": args.device,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": lr, "betas": list(betas), "weight_decay": weight_decay},
            },
            "zero_optimization": zc,
        }
        model = GPT(mcfg)
        model.load_state_dict(initial)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        try:
            losses, engine_device, hyper = zerodp_losses(model, config, batches)
        except Exception as exc:  # recorded; the other stages still run
            result["stages"][str(stage)] = {"pass": False, "error": f"{type(exc).__name__}: {exc}"}
            ok = False
            continue
        rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref, strict=True))
        entry = {
            # the same optimizer settings on both sides, or the comparison measures the settings
            "pass": rel <= args.rtol and hyper == ref_hyper,
            "hyperparameters": hyper,
            "max_rel_loss_diff": rel,
            "first_last": [losses[0], losses[-1]],
            "losses": losses,
            "seconds": time.perf_counter() - t0,
            "engine_device": engine_device,
        }
        if device.type == "cuda":
            entry["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        result["stages"][str(stage)] = entry
        ok = ok and entry["pass"] and engine_device == str(device)
        print(
            f"stage {stage}: max relative loss difference {rel:.3g} over {args.steps} steps on {engine_device}",
            flush=True,
        )
    result["pass"] = ok
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    zerodp.shutdown_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
