"""Per-step drift of each ZeRO stage from single-process plain PyTorch on ``zerodp train``'s model and data.

Trains the ``zerodp train`` GPT (same seed, corpus, batches and AdamW settings) at each requested
stage, one engine after the other in one launch, and a plain-PyTorch reference on rank 0 (the whole
global batch, ``torch.optim.AdamW``, ``torch.nn.utils.clip_grad_norm_``). After every optimizer step
it gathers the full fp32 parameters (``zerodp.zero.safe_get_full_fp32_param``) and prints, per stage,
the first step whose parameters depart from the reference by more than ``--threshold`` (relative L2),
the relative L2 distance every ``--every`` steps, the training loss and the global gradient norm.

At the end it prints each run's held-out loss (``zerodp train``'s evaluation). ``--perturb N`` adds N
plain-PyTorch runs whose initial weights are moved by one ulp (``torch.nextafter`` towards +inf; run 1
every element, run k > 1 a random half): how far they end from the unperturbed reference shows how
much a last-bit difference grows on this model and data. ``--perturb-stage`` does the same to the first
of ``--stages`` (and prints its distance to the unperturbed run of that stage).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 tools/stage_drift.py \
        --steps 60 --clip 1.0 --stages 0,1,2,3 --perturb 4

Used for docs/benchmarks/2026-12-02-stage-drift.md.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist

import zerodp
from zerodp.app import data
from zerodp.app.model import GPT, GPTConfig
from zerodp.app.train import DEFAULTS, evaluate


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=DEFAULTS.micro_batch)
    p.add_argument("--threshold", type=float, default=1e-6)
    p.add_argument("--every", type=int, default=5)
    p.add_argument(
        "--perturb",
        type=int,
        default=0,
        metavar="N",
        help="N plain-PyTorch runs from initial weights moved by one ulp: run 1 moves every element, "
        "run k > 1 a random half of them (seed k)",
    )
    p.add_argument(
        "--perturb-stage",
        action="store_true",
        help="also run the first of --stages from initial weights +1 ulp (every element)",
    )
    p.add_argument("--eval-batches", type=int, default=DEFAULTS.eval_batches)
    p.add_argument(
        "--bucket", type=int, default=DEFAULTS.stage2_reduce_bucket_size, help="stage 1/2 reduce_bucket_size"
    )
    return p.parse_args()


def engine_config(stage: int, a: argparse.Namespace) -> dict:
    zero: dict = {"stage": stage}
    if stage in (1, 2):
        zero["reduce_bucket_size"] = a.bucket
    if stage == 3:
        zero.update(
            stage3_param_persistence_threshold=DEFAULTS.stage3_param_persistence_threshold,
            stage3_prefetch_bucket_size=DEFAULTS.stage3_prefetch_bucket_size,
            stage3_max_live_parameters=DEFAULTS.stage3_max_live_parameters,
        )
    return {
        "train_micro_batch_size_per_gpu": a.micro_batch,
        "gradient_accumulation_steps": a.grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": DEFAULTS.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "zero_optimization": zero,
        "gradient_clipping": a.clip,
        "seed": DEFAULTS.seed,
    }


def flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def nudge(model: torch.nn.Module, run: int) -> None:
    """Move the initial weights by one ulp towards +inf: every element (run 1) or a random half (seed run)."""
    gen = torch.Generator().manual_seed(run)
    with torch.no_grad():
        for p in model.parameters():
            up = torch.nextafter(p, torch.full_like(p, math.inf))
            p.copy_(up if run == 1 else torch.where(torch.rand(p.shape, generator=gen) < 0.5, up, p))


def run_stage(
    stage: int, a: argparse.Namespace, cfg: GPTConfig, batches: data.GlobalBatches, heldout: list, perturb: bool = False
) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(DEFAULTS.seed)
    model = GPT(cfg)
    if perturb:
        nudge(model, 1)
    eng = zerodp.initialize(model, engine_config(stage, a))
    params = list(model.parameters())
    losses, norms, snaps = [], [], []
    for step in range(a.steps):
        total = 0.0
        for m in range(a.grad_accum):
            x, y = data.rank_slice(batches.batch(step * a.grad_accum + m), rank, world)
            _, loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            total += loss.item() / a.grad_accum
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t) / world)
        norms.append(eng.get_global_grad_norm())
        full = flat([zerodp.zero.safe_get_full_fp32_param(p) for p in params])
        snaps.append(full if rank == 0 else None)
    held = evaluate(eng, heldout)
    eng.close()
    return losses, norms, snaps, held


def run_reference(
    a: argparse.Namespace, cfg: GPTConfig, batches: data.GlobalBatches, heldout: list, perturb: int = 0
) -> tuple:
    torch.manual_seed(DEFAULTS.seed)
    model = GPT(cfg)
    if perturb:
        nudge(model, perturb)
    opt = torch.optim.AdamW(model.parameters(), lr=DEFAULTS.lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses, norms, snaps = [], [], []
    for step in range(a.steps):
        total = 0.0
        for m in range(a.grad_accum):
            x, y = batches.batch(step * a.grad_accum + m)
            _, loss = model(x, y)
            (loss / a.grad_accum).backward()
            total += loss.item() / a.grad_accum
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip if a.clip > 0 else math.inf)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        norms.append(float(norm))
        snaps.append(flat(list(model.parameters())))
    model.eval()
    with torch.no_grad():
        held = sum(float(model(x, y)[1]) for x, y in heldout) / len(heldout)
    return losses, norms, snaps, held


def report(name: str, run: tuple, ref: tuple, a: argparse.Namespace, other: tuple | None = None) -> None:
    """Print ``run`` against the reference (and the distance to ``other``, a (name, run) pair)."""
    losses, norms, snaps, held = run
    rl, rn, rs, rheld = ref
    dists = [float((s - r).norm() / r.norm()) for s, r in zip(snaps, rs, strict=True)]
    odists = [float((s - o).norm() / o.norm()) for s, o in zip(snaps, other[1][2], strict=True)] if other else dists
    first = next((i + 1 for i, d in enumerate(dists) if d > a.threshold), None)
    print(
        f"== {name}: first step with relative L2 parameter distance > {a.threshold:g}: {first}; "
        f"held-out loss {held:.6f} (reference {rheld:.6f})"
    )
    vs = f"dist_to_{other[0]}" if other else ""
    print(f"  step  dist_to_ref  {vs:14s} loss          ref_loss      grad_norm     ref_norm")
    for i in range(a.steps):
        if i < 3 or (i + 1) % a.every == 0 or (first is not None and abs(i + 1 - first) <= 1):
            o = f"{odists[i]:.3e}" if other else ""
            print(
                f"  {i + 1:4d}  {dists[i]:.3e}    {o:14s} {losses[i]:.8f}    {rl[i]:.8f}    "
                f"{norms[i]:.8f}    {rn[i]:.8f}"
            )


def main() -> None:
    a = parse()
    zerodp.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(
        n_layer=DEFAULTS.n_layer, n_head=DEFAULTS.n_head, d_model=DEFAULTS.d_model, seq_len=DEFAULTS.seq_len
    )
    train_tokens, heldout_tokens = data.split(data.encode(data.load_text(None, data.min_corpus_bytes(cfg.seq_len))))
    batches = data.GlobalBatches(train_tokens, cfg.seq_len, a.micro_batch, world, seed=DEFAULTS.seed)
    heldout = data.heldout_batches(heldout_tokens, cfg.seq_len, a.micro_batch * world, a.eval_batches)
    ref = run_reference(a, cfg, batches, heldout) if rank == 0 else None
    if rank == 0:
        print(
            f"world {world}, clip {a.clip}, grad_accum {a.grad_accum}, micro {a.micro_batch}, {a.steps} steps",
            flush=True,
        )
        for k in range(1, a.perturb + 1):
            which = "every element" if k == 1 else f"a random half (seed {k})"
            report(
                f"plain PyTorch, initial weights +1 ulp on {which}",
                run_reference(a, cfg, batches, heldout, perturb=k),
                ref,
                a,
            )
    dist.barrier()
    first = None
    for stage in (int(s) for s in a.stages.split(",")):
        run = run_stage(stage, a, cfg, batches, heldout)
        if rank == 0:
            report(f"stage {stage}", run, ref, a, first)
            first = first or (f"stage{stage}", run)
    if a.perturb_stage:
        stage = int(a.stages.split(",")[0])
        run = run_stage(stage, a, cfg, batches, heldout, perturb=True)
        if rank == 0:
            report(f"stage {stage}, initial weights +1 ulp on every element", run, ref, a, first)
    zerodp.shutdown_distributed()


if __name__ == "__main__":
    main()
