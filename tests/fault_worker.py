"""Per-rank worker for tests/test_faults.py: scenarios built so that a named fault changes the result.

Launched by torchrun like tests/dist_worker.py (whose training loops, models and ``main`` it reuses).
Each scenario targets faults the scenarios in dist_worker.py cannot see:

- Gradient scale. torch's Adam with a small ``eps`` divides the update by the gradient's own size, so a
  gradient off by a uniform factor (a missing ``1/gradient_accumulation_steps``, a missing fp16
  unscale, averaging over the wrong world size) moves parameters almost exactly as the right one.
  :data:`SCALE_ADAM` sets ``eps`` to 1.0, larger than every sqrt(v) here, so the update is about
  ``lr * m`` (momentum SGD): proportional to the gradient's scale. L2 weight decay (Adam, not AdamW)
  adds ``wd * p`` to the gradient, which also weighs the gradient's scale against the parameters'.
- Mixed precision with accumulation and clipping: bf16/fp16 against ``MixedReference`` with its
  ``clip`` argument, comparing the fp32 masters (``module_state_dict()``) by name.
- Broadcast from rank 0: rank r builds its model from seed 1234 + r.
- Storage (stages 0-2): what parameters, gradients and optimizer states really occupy, measured from
  ``untyped_storage()`` and ``.grad`` as seen by a hook that runs after the engine's own.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from dist_worker import (
    STAGE3_DEFAULTS,
    MixedReference,
    Zoo,
    compare_training,
    deepspeed_meaning,
    main,
    make_batch,
    mse,
    rank,
    scenario,
    world,
)
from zerodp.runtime.grad_placeholder import is_hidden_gradient

#: Adam whose update is proportional to the gradient's scale (see the module docstring).
SCALE_ADAM = {"lr": 0.05, "eps": 1.0, "weight_decay": 0.01}


# ---- fp32: gradient accumulation, clipping, rank-0 broadcast -----------------------------------------
@scenario
def accum_scale_sensitive(stage: int) -> dict:
    """3 micro-steps per optimizer step; a gradient 3x too large moves parameters 3x too far."""
    return compare_training(
        stage, opt="Adam", opt_params=SCALE_ADAM, accum=3, micro=2, steps=4, zero={"reduce_bucket_size": 45}
    )


@scenario
def accum_clip_below_norm(stage: int) -> dict:
    """Accumulation with clipping below the gradient norm: the global norm must equal clip_grad_norm_'s
    on the whole model (``min_norm`` shows that clipping really happened)."""
    norms: list[float] = []

    def record(step: int, engine, model, ref) -> dict:
        norms.append(engine.get_global_grad_norm())
        return {"min_norm": min(norms)}

    return compare_training(
        stage,
        opt="Adam",
        opt_params=SCALE_ADAM,
        accum=2,
        micro=2,
        clip=0.05,
        steps=4,
        zero={"reduce_bucket_size": 45},
        between=record,
    )


@scenario
def rank_seeds_differ(stage: int) -> dict:
    """Every rank builds its model from its own seed (and a frozen bias): the engine's broadcast from
    rank 0 is the only thing that makes the ranks train rank 0's model."""

    def freeze(m: nn.Module) -> None:
        m.fc1.bias.requires_grad_(False)

    return compare_training(stage, rank_seed=True, freeze=freeze, zero={"reduce_bucket_size": 50})


# ---- mixed precision: accumulation, clipping, loss scaling --------------------------------------------
def compare_mixed_scaled(
    stage: int, dtype: torch.dtype, *, accum: int = 1, clip: float = 0.0, steps: int = 6, loss_scale_power: int = 10
) -> dict:
    """Train Zoo in ``dtype`` with zerodp and with ``MixedReference`` (fp32 masters, clip) on the same
    global batches, with :data:`SCALE_ADAM`. fp16 uses a dynamic loss scale of 2**loss_scale_power that
    never overflows here. Returns the relative error of the fp32 masters' movement, by name."""
    r, n = rank(), world()
    micro = 2
    precision = (
        {"bf16": {"enabled": True}}
        if dtype == torch.bfloat16
        else {"fp16": {"enabled": True, "initial_scale_power": loss_scale_power, "loss_scale_window": 1000}}
    )
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "optimizer": {"type": "Adam", "params": SCALE_ADAM},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50, **STAGE3_DEFAULTS},
        **precision,
    }
    torch.manual_seed(7)
    base = Zoo()
    ref = MixedReference(copy.deepcopy(base), dtype, *deepspeed_meaning("Adam", SCALE_ADAM))
    names = [k for k, p in ref.model.named_parameters() if p.requires_grad]
    initial = {k: m.detach().clone() for k, m in zip(names, ref.masters, strict=True)}
    model = copy.deepcopy(base)
    engine = zerodp.initialize(model, config)
    scale = 2.0**loss_scale_power if dtype == torch.float16 else 1.0
    norm_errs, clipped = [], []
    for step in range(steps):
        x, y = make_batch(step, micro * n * accum, "zoo")
        x, y = x.to(dtype), y.to(dtype)
        if not ref.step(mse(ref.model(x).float(), y.float()), scale=scale, clip=clip):
            raise AssertionError("the reference overflowed: this scenario expects none")
        for j in range(accum):
            lo = (j * n + r) * micro
            engine.backward(mse(engine(x[lo : lo + micro]).float(), y[lo : lo + micro].float()))
            engine.step()
        if clip > 0:
            norm_errs.append(abs(engine.get_global_grad_norm() - ref.last_norm) / ref.last_norm)
            clipped.append(ref.last_norm > clip)
    mine = engine.module_state_dict()  # trained parameters: the fp32 masters
    if sorted(k for k in mine if k in initial) != sorted(initial):
        raise AssertionError(f"trained parameter names differ: {sorted(mine)} vs {sorted(initial)}")
    want = dict(zip(names, ref.masters, strict=True))
    move_errs = {}
    for k, w in want.items():
        ref_move, my_move = w - initial[k], mine[k] - initial[k]
        denom = ref_move.norm().item()
        move_errs[k] = (my_move - ref_move).norm().item() / denom if denom > 0 else my_move.norm().item()
    out = {
        "move_err": max(move_errs.values()),
        "compared": len(move_errs),
        "steps": engine.global_steps,
        "skipped": engine.skipped_steps,
        "masters_dtype": sorted({str(mine[k].dtype) for k in want}),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "moved": max((want[k] - initial[k]).abs().max().item() for k in want),
    }
    if clip > 0:
        out.update(norm_err=max(norm_errs), all_clipped=all(clipped))
    return out


@scenario
def bf16_accum(stage: int) -> dict:
    """bf16 with 3 micro-steps (fp32 accumulation partition at stages 2-3)."""
    return compare_mixed_scaled(stage, torch.bfloat16, accum=3)


@scenario
def bf16_clip(stage: int) -> dict:
    return compare_mixed_scaled(stage, torch.bfloat16, clip=0.05)


@scenario
def fp16_loss_scale(stage: int) -> dict:
    """fp16, loss scale 1024: gradients must be unscaled before the update."""
    return compare_mixed_scaled(stage, torch.float16)


@scenario
def fp16_accum_clip(stage: int) -> dict:
    return compare_mixed_scaled(stage, torch.float16, accum=2, clip=0.05)


# ---- storage, stages 0-2 -----------------------------------------------------------------------------
def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _disjoint(tensors: list[torch.Tensor]) -> bool:
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    return all(a_hi <= b_lo for (_, a_hi), (b_lo, _) in zip(spans, spans[1:], strict=False))


@scenario
def storage(stage: int) -> dict:
    """Stages 0-2: parameters are views of one flat storage (kept across steps); gradients live in one
    flat storage at stages 0-1 and in their bucket's staging buffer until it is reduced at stage 2; optimizer
    states cover each element once across ranks (all of them on every rank at stage 0)."""
    if stage == 3:
        return {"skipped": True}
    torch.manual_seed(0)
    model = Zoo()
    psi = sum(p.numel() for p in model.parameters())
    n_params = len(list(model.parameters()))
    engine = zerodp.initialize(
        model,
        {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam"},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
        },
    )
    params = list(model.parameters())
    out: dict = {"psi": psi, "n_params": n_params, "world": world()}
    storages = {_storage(p) for p in params}
    out["param_storages"], out["param_storage_bytes"] = len(storages), sum(b for _, b in storages)
    out["params_disjoint"] = _disjoint(params)
    grad_seen: list[tuple[int, int] | None] = []

    def after_engine_hook(p: torch.Tensor) -> None:  # registered after the engine's: runs after it
        grad_seen.append(None if p.grad is None else _storage(p.grad))

    for p in params:
        p.register_post_accumulate_grad_hook(after_engine_hook)
    grads_after_backward: list = []
    out["grads_none_after_step"] = 0
    for step in range(3):
        x, y = make_batch(step, 2 * world(), "zoo")
        lo = rank() * 2
        engine.backward(mse(engine(x[lo : lo + 2]), y[lo : lo + 2]))
        grads_after_backward.append(
            [None if p.grad is None else "hidden" if is_hidden_gradient(p.grad) else _storage(p.grad) for p in params]
        )
        engine.step()
        out["grads_none_after_step"] += sum(p.grad is None for p in params)
    # stage 2: the bytes of each bucket's staging buffer (fp32), and how many buckets there are
    out["bucket_bytes"] = sorted({4 * b.numel for g in engine.groups for b in g.buckets})
    out["n_buckets"] = sum(len(g.buckets) for g in engine.groups)
    out["param_storages_after"] = sorted({_storage(p) for p in params}) == sorted(storages)
    out["hook_calls"] = len(grad_seen)
    out["grad_storages_in_hook"] = sorted({s for s in grad_seen if s is not None})
    out["grads_none_in_hook"] = sum(s is None for s in grad_seen)
    out["grad_storages_after_backward"] = sorted(
        {s for g in grads_after_backward for s in g if s is not None and s != "hidden"}
    )
    out["grads_none_after_backward"] = sum(s is None for g in grads_after_backward for s in g)
    out["grads_hidden_after_backward"] = sum(s == "hidden" for g in grads_after_backward for s in g)
    out["grad_param_overlap"] = any(s in storages for s in out["grad_storages_in_hook"])
    states = [t for st in engine.optimizer.state.values() for k, t in st.items() if k != "step"]
    out["state_tensors"] = len(states)
    out["state_elements"] = sum(t.numel() for t in states)  # exp_avg + exp_avg_sq
    total = torch.tensor([out["state_elements"]], dtype=torch.int64)
    dist.all_reduce(total)
    out["state_elements_all_ranks"] = int(total.item())
    out["state_aliases_params"] = any(_storage(t) in storages for t in states)
    # never_used never gets a gradient, so Adam never creates its state
    out["never_used_elements"] = model.never_used.numel()
    return out


if __name__ == "__main__":
    main()
