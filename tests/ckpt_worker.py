"""Per-rank checkpoint test worker, launched by torchrun (see tests/distributed.py).

Same structure as tests/dist_worker.py: one launch per world size runs several scenarios; results go to
``OUT_DIR/rank{r}.json`` and the pytest side (tests/test_checkpoint.py) asserts on them. Scenarios are
named ``name`` (run at every stage of ``--stages``) or ``name@stage`` or ``name@stage:arg``; results
are keyed ``name/stage{S}`` (``name/stage{S}:arg`` with an argument). Checkpoints live under
``--ckpt-dir``, which the pytest side shares between launches of different world sizes (resharding).

Stage 3 runs with ``stage3_param_persistence_threshold`` 4 (only ``scale`` and ``never_used`` stay
gathered): parameters are then empty placeholders outside forward, so every comparison of parameter
values reads them under ``zerodp.zero.GatheredParameters`` (:func:`full_params`).

Tolerance metric ("err"): max over elements of |a - b| / (ATOL + RTOL |b|); <= 1 means equal within
1e-5 relative (fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

import zerodp
from devices import engine_config
from dist_worker import Zoo, err, rank, world  # this file's folder is on sys.path when run as a script
from zerodp import checkpoint
from zerodp.checkpoint import consolidate, load_full_state_dict
from zerodp.checkpoint import save as checkpoint_save

GLOBAL_ROWS = 12  # global batch of the resharding scenarios: the same at world sizes 2, 3 and 4


@dataclass
class Context:
    ckpt_dir: Path
    arg: str | None


SCENARIOS: dict[str, Callable[[int, Context], dict]] = {}


def scenario(fn: Callable[[int, Context], dict]) -> Callable[[int, Context], dict]:
    SCENARIOS[fn.__name__] = fn
    return fn


# ---- models and helpers shared with tests/dist_worker.py ----------------------------------------------
class TiedLM(nn.Module):
    """Embedding and output head share one weight; a persistent and a non-persistent buffer."""

    def __init__(self, vocab: int = 11, d: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("offset", torch.randn(d))
        self.register_buffer("cache", torch.ones(2), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(self.emb(idx) + self.offset)))


class TiedZoo(Zoo):
    """Zoo plus a layer whose weight is ``branch.weight`` (tied across two modules) and a persistent
    buffer; built with ``fc1.bias`` frozen (see :func:`zoo_engine`)."""

    def __init__(self) -> None:
        super().__init__()
        self.again = nn.Linear(7, 7, bias=False)
        self.again.weight = self.branch.weight
        self.register_buffer("shift", torch.randn(5))

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        h = h + 0.5 * torch.tanh(self.again(h))
        return self.fc2(h) * self.scale + self.shift


def zoo_groups(m: Zoo) -> list[dict]:
    """Two param groups with different lr and weight decay (the same for engine and reference)."""
    return [
        {"params": [m.fc1.weight, m.branch.weight, m.fc2.weight], "weight_decay": 0.1},
        {"params": [m.fc1.bias, m.fc2.bias, m.scale, m.never_used], "weight_decay": 0.0, "lr": 0.01},
    ]


def config(stage: int, micro: int, accum: int = 1, bucket: int = 40, **extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.05}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": 30,
            **({"stage3_param_persistence_threshold": 4} if stage == 3 else {}),
        },
        **extra,
    }


#: config additions of the mixed-precision exact-resume variants (argument flags ``bf16``, ``fp16``):
#: bf16 with a DeepSpeed schedule from the config; fp16 with a dynamic loss scale that halves after 2
#: overflows and doubles after 3 clean steps (so the saved scaler state is neither the initial one nor
#: what a fresh engine reaches by itself), and a torch StepLR passed to initialize().
PRECISION_EXTRA = {
    "bf16": {
        "bf16": {"enabled": True},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"warmup_num_steps": 2, "total_num_steps": 8, "warmup_min_ratio": 0.1, "warmup_type": "linear"},
        },
    },
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 2, "loss_scale_window": 3}},
}


def step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def zoo_engine(
    stage: int,
    micro: int,
    accum: int = 1,
    seed: int = 1234,
    tied: bool = False,
    hidden: int = 7,
    precision: str = "fp32",
    on_test_device: bool = False,
) -> tuple[Zoo, zerodp.Engine]:
    """A Zoo engine (``tied``: a :class:`TiedZoo` with ``fc1.bias`` frozen; ``precision`` ``bf16`` or
    ``fp16``: see :data:`PRECISION_EXTRA`; ``on_test_device``: on ``ZERODP_TEST_DEVICE``, tests/devices.py)."""
    torch.manual_seed(seed)
    model = TiedZoo() if tied else Zoo(hidden=hidden)
    if tied:
        model.fc1.bias.requires_grad_(False)
    cfg = config(
        stage, micro, accum, **PRECISION_EXTRA.get(precision, {}), **(engine_config() if on_test_device else {})
    )
    return model, zerodp.initialize(
        model, cfg, model_parameters=zoo_groups(model), lr_scheduler=step_lr if precision == "fp16" else None
    )


def full_params(model: nn.Module) -> list[torch.Tensor]:
    """Copies of every parameter's full value (gathered at stage 3; collective)."""
    with zerodp.zero.GatheredParameters(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()]


def gathered_report(engine: zerodp.Engine) -> dict:
    """Stage 3: elements gathered now, and those of the persistent unit (which should be all)."""
    if engine.sharding is None:
        return {"live": 0, "persistent": 0}
    return {
        "live": engine.sharding.coordinator.live_elements(),
        "persistent": sum(u.numel for u in engine.sharding.units if u.persistent),
    }


def make_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 13, generator=g), torch.randn(rows, 5, generator=g)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def decay_lr(opt: torch.optim.Optimizer) -> None:
    """A learning-rate scheduler: the checkpoint must carry the decayed lr."""
    for g in opt.param_groups:
        g["lr"] *= 0.9


def engine_step(
    engine: zerodp.Engine, step: int, micro: int, accum: int, noise: bool, inf: bool = False
) -> torch.Tensor:
    """One optimizer step on this rank's share of the global batch; returns the micro-batch losses.
    ``noise`` perturbs the inputs with the default (per-rank) RNG, which checkpoints must restore.
    Inputs are cast to the module's dtype (bf16/fp16 engines) and put on the engine's device (the
    noise is drawn on the CPU, whose RNG state checkpoints restore); ``inf``: the last rank's first
    micro-batch holds an inf (its gradients overflow). The lr is decayed by hand unless the engine has
    a scheduler."""
    n, r = world(), rank()
    x, y = make_batch(step, micro * n * accum)
    dtype = engine.precision.param_dtype
    losses = []
    for j in range(accum):
        lo = (j * n + r) * micro
        xs, ys = x[lo : lo + micro], y[lo : lo + micro]
        if noise:
            xs = xs + 0.01 * torch.randn(xs.shape)
        device = engine.device if engine.device is not None else torch.device("cpu")
        xs, ys = xs.to(device, dtype), ys.to(device)
        if inf and j == 0 and r == n - 1:
            xs[0, 0] = float("inf")
        loss = mse(engine(xs, step % 2 == 0).float(), ys)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    if engine.lr_scheduler is None:
        decay_lr(engine.optimizer)
    return torch.stack(losses)


def global_loss(local: torch.Tensor) -> torch.Tensor:
    total = local.double().sum().reshape(1)
    dist.all_reduce(total)
    return total[0] / (world() * local.numel())


def reference(seed: int = 1234) -> tuple[Zoo, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    ref = Zoo()
    return ref, torch.optim.AdamW(zoo_groups(ref), lr=0.02, weight_decay=0.05)


def ref_step(ref: Zoo, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    """The same step in plain torch on the whole global batch."""
    x, y = make_batch(step, GLOBAL_ROWS)
    opt.zero_grad()
    loss = mse(ref(x, step % 2 == 0), y)
    loss.backward()
    opt.step()
    decay_lr(opt)
    return loss.detach()


def piece_states(engine: zerodp.Engine) -> list[tuple[str, int, int, dict]]:
    """(name, start, end, optimizer state) of this rank's pieces (state keyed by the fp32 master when
    there is one)."""
    return [
        (
            p.slot.name,
            p.lo - p.slot.offset,
            p.hi - p.slot.offset,
            {k: v.clone() for k, v in engine.optimizer.state.get(p.opt_tensor, {}).items()},
        )
        for g in engine.groups
        for p in g.pieces
    ]


def piece_values(engine: zerodp.Engine) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(module-dtype value, fp32 master or None) of this rank's pieces, copied."""
    return [(p.tensor.clone(), None if p.master is None else p.master.clone()) for g in engine.groups for p in g.pieces]


def same_piece_values(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x[0].dtype == y[0].dtype
        and torch.equal(x[0], y[0])
        and (x[1] is None) == (y[1] is None)
        and (x[1] is None or (x[1].dtype == y[1].dtype and torch.equal(x[1], y[1])))
        for x, y in zip(a, b, strict=True)
    )


def gathered_masters(engine: zerodp.Engine) -> dict[str, torch.Tensor]:
    """Full fp32 master value of every trained parameter, assembled by this test from every rank's
    pieces (all_gather_object; independent of zerodp's own assembly)."""
    mine = [
        (p.slot.name, p.lo - p.slot.offset, p.hi - p.slot.offset, p.slot.shape, p.master.detach().cpu().clone())
        for g in engine.groups
        for p in g.pieces
    ]
    everyone: list = [None] * world()
    dist.all_gather_object(everyone, mine)
    out: dict[str, torch.Tensor] = {}
    for pieces in everyone:
        for name, start, end, shape, value in pieces:
            full = out.setdefault(name, torch.full(shape, float("nan")))
            full.view(-1)[start:end] = value
    return out


def same_state_dict(a: dict, b: dict) -> bool:
    """Same keys in order, same dtypes, same values (torch.equal alone ignores dtype)."""
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# ---- scenarios -------------------------------------------------------------------------------------
@scenario
def exact_resume(stage: int, ctx: Context) -> dict:
    """Save after 3 steps, train to 6; a fresh engine loading the checkpoint repeats steps 4-6 exactly.
    Argument: ``+``-separated flags. ``tied``: a :class:`TiedZoo` (tied weight across modules, frozen
    parameter, buffer). ``bf16`` / ``fp16``: mixed precision (see :data:`PRECISION_EXTRA`; fp16: step 1
    overflows on the last rank and is skipped); then the fp32 masters, the scheduler and loss-scaler
    states are compared too, and the checkpoint is consolidated on every rank."""
    n_save, n_total, micro, accum = 3, 6, 2, 2
    flags = set(ctx.arg.split("+")) if ctx.arg else set()
    tied = "tied" in flags
    precision = "bf16" if "bf16" in flags else "fp16" if "fp16" in flags else "fp32"
    d = ctx.ckpt_dir / (f"exact-w{world()}-s{stage}" + "".join(f"-{f}" for f in sorted(flags)))
    model, engine = zoo_engine(stage, micro, accum, tied=tied, precision=precision, on_test_device=True)
    torch.manual_seed(100 + rank())  # per-rank noise streams
    for step in range(n_save):
        engine_step(engine, step, micro, accum, noise=True, inf=precision == "fp16" and step == 1)
    saved_at = engine.save_checkpoint(d, client_state={"step": n_save, "data": [1, 2.5, "x"]})
    rng_at_save = torch.get_rng_state()
    sdv = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    for k, v in sdv.items():
        first.setdefault(id(v), k)
    canon = {k: first[id(v)] for k, v in sdv.items()}  # every name -> first name (tied weights)
    trained = {k for k, v in sdv.items() if isinstance(v, nn.Parameter) and v.requires_grad}
    mixed: dict = {}
    if precision != "fp32":
        at_save = {
            "skipped": engine.skipped_steps,
            "loss_scale": engine.loss_scale,
            "scaler": engine.loss_scaler.state_dict() if engine.loss_scaler else None,
            "scheduler_epoch": engine.lr_scheduler.last_epoch,
        }
        state_dict_at_save, masters_at_save = engine.module_state_dict(), gathered_masters(engine)
        with open(saved_at / "meta.json") as f:
            meta = json.load(f)
        out_file = d / "consolidated" / f"rank{rank()}.safetensors"  # pure: every rank writes its own
        consolidate(d, out_file)
        cons = load_file(str(out_file))
        mixed.update(
            at_save=at_save,
            meta={k: meta.get(k) for k in ("precision", "dtype", "skipped_steps", "loss_scaler")},
            meta_param_dtypes=sorted({r["dtype"] for r in meta["params"]}),
            meta_scheduler_type=(meta.get("lr_scheduler") or {}).get("type"),
            meta_scheduler_epoch=(meta.get("lr_scheduler") or {}).get("state", {}).get("last_epoch"),
            trained=sorted(trained),
            masters=sorted(masters_at_save),
            module_dtypes=sorted({str(v.dtype) for v in model.state_dict().values()}),
            # module_state_dict(): trained parameters are the fp32 masters; the rest keep the module dtype
            state_dict_is_masters=all(
                state_dict_at_save[k].dtype == torch.float32
                and torch.equal(state_dict_at_save[k].cpu(), masters_at_save[canon[k]])
                for k in trained
            ),
            state_dict_rest_dtypes=sorted({str(v.dtype) for k, v in state_dict_at_save.items() if k not in trained}),
            masters_differ_from_module=any(
                not torch.equal(v, v.to(engine.precision.param_dtype).float()) for v in masters_at_save.values()
            ),
            # consolidate(): every floating tensor fp32; trained ones equal the masters
            consolidated_keys_equal=sorted(cons) == sorted(state_dict_at_save),
            consolidated_dtypes=sorted({str(v.dtype) for v in cons.values()}),
            consolidated_is_masters=all(torch.equal(cons[k], masters_at_save[canon[k]]) for k in trained),
            consolidated_equals_state_dict=all(
                torch.equal(cons[k], v.float().cpu()) for k, v in state_dict_at_save.items()
            ),
        )
    losses = [engine_step(engine, step, micro, accum, noise=True) for step in range(n_save, n_total)]
    final, states, values = engine.module_state_dict(), piece_states(engine), piece_values(engine)
    gathered_after_state_dict = gathered_report(engine)
    with torch.random.fork_rng(devices=[]):  # shapes and dtypes of a plain model's state_dict
        plain = {
            k: (list(v.shape), v.dtype if k in trained else engine.precision.param_dtype)
            for k, v in (TiedZoo() if tied else Zoo()).state_dict().items()
        }
    final_params = full_params(model)
    lrs = [g["lr"] for g in engine.optimizer.param_groups]

    model2, engine2 = zoo_engine(stage, micro, accum, seed=999, tied=tied, precision=precision, on_test_device=True)
    torch.manual_seed(5)  # a different RNG state: load must restore the saved one
    path, client_state = engine2.load_checkpoint(d)
    rng_restored = torch.equal(torch.get_rng_state(), rng_at_save)
    steps_after_load = (engine2.global_steps, engine2.micro_steps)
    if precision != "fp32":
        mixed["after_load"] = {
            "skipped": engine2.skipped_steps,
            "loss_scale": engine2.loss_scale,
            "scaler": engine2.loss_scaler.state_dict() if engine2.loss_scaler else None,
            "scheduler_epoch": engine2.lr_scheduler.last_epoch,
        }
        # the module-dtype pieces are the loaded masters rounded (as after an optimizer step)
        mixed["params_cast_from_masters"] = all(
            p.tensor.dtype == engine2.precision.param_dtype and torch.equal(p.tensor, p.master.to(p.tensor.dtype))
            for g in engine2.groups
            for p in g.pieces
        )
        mixed["loaded_state_dict_equal"] = same_state_dict(state_dict_at_save, engine2.module_state_dict())
    losses2 = [engine_step(engine2, step, micro, accum, noise=True) for step in range(n_save, n_total)]
    states2 = piece_states(engine2)
    final2_params = full_params(model2)
    if precision != "fp32":
        mixed["scheduler_equal"] = engine.lr_scheduler.state_dict() == engine2.lr_scheduler.state_dict()
        mixed["scaler_equal"] = (engine.loss_scaler is None and engine2.loss_scaler is None) or (
            engine.loss_scaler.state_dict() == engine2.loss_scaler.state_dict()
        )
        mixed["skipped_end"] = [engine.skipped_steps, engine2.skipped_steps]
    return {
        **mixed,
        "pieces_equal": same_piece_values(values, piece_values(engine2)),
        "param_dtypes": sorted({str(p.dtype) for p in final2_params}),
        "path": str(path),
        "saved_at": str(saved_at),
        "latest": (d / "latest").read_text(),
        "client_state": client_state,
        "rng_restored": rng_restored,
        "steps_after_load": list(steps_after_load),
        "losses_equal": all(torch.equal(a, b) for a, b in zip(losses, losses2, strict=True)),
        "params_equal": same_state_dict(final, engine2.module_state_dict()),
        "model_params_equal": len(final_params) == len(final2_params)
        and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(final_params, final2_params, strict=True)),
        "state_dict_like_plain": {k: (list(v.shape), v.dtype) for k, v in final.items()} == plain,
        "gathered_after_state_dict": gathered_after_state_dict,
        "gathered_end": gathered_report(engine2),
        "states_equal": [s[:3] for s in states] == [s[:3] for s in states2]
        and all(
            a[3].keys() == b[3].keys() and all(torch.equal(a[3][k], b[3][k]) for k in a[3])
            for a, b in zip(states, states2, strict=True)
        ),
        "pieces_without_state": sum(1 for s in states2 if not s[3]),
        "pieces_with_state": sum(1 for s in states2 if s[3]),
        "lrs_equal": lrs == [g["lr"] for g in engine2.optimizer.param_groups],
        "steps": [engine2.global_steps, engine2.micro_steps],
    }


@scenario
def reshard_save(stage: int, ctx: Context) -> dict:
    """Train 3 steps beside the reference and save to ckpt_dir/reshard-w{N}; loaded by reshard_load."""
    n = world()
    micro = GLOBAL_ROWS // n
    model, engine = zoo_engine(stage, micro)
    ref, ref_opt = reference()
    loss_errs = []
    for step in range(3):
        local = engine_step(engine, step, micro, 1, noise=False)
        loss_errs.append(err(global_loss(local), ref_step(ref, ref_opt, step)))
    engine.save_checkpoint(ctx.ckpt_dir / f"reshard-w{n}-s{stage}", client_state={"world": n, "stage": stage})
    param_err = max(err(a, b) for a, b in zip(full_params(model), ref.parameters(), strict=True))
    return {"loss_err": max(loss_errs), "param_err": param_err}


@scenario
def reshard_load(stage: int, ctx: Context) -> dict:
    """Load ckpt_dir/reshard-{arg} (``w<N>-s<S>``: another world size and stage) into a fresh engine,
    check what was loaded against the reference at step 3, then train to step 6 and compare again."""
    n = world()
    micro = GLOBAL_ROWS // n
    src = ctx.ckpt_dir / f"reshard-{ctx.arg}"
    ref, ref_opt = reference()
    for step in range(3):
        ref_step(ref, ref_opt, step)
    model, engine = zoo_engine(stage, micro, seed=4321)
    path, client_state = engine.load_checkpoint(src)
    # exactly what the files hold (bit-identical), and close to the reference
    gathered_after_load = gathered_report(engine)
    exact = same_state_dict(load_full_state_dict(src), engine.module_state_dict())
    load_param_err = max(err(a, b) for a, b in zip(full_params(model), ref.parameters(), strict=True))
    ref_params = dict(ref.named_parameters())
    state_errs, state_presence_ok, step_ok = [0.0], True, True
    for name, start, end, st in piece_states(engine):
        ref_st = ref_opt.state.get(ref_params[name], {})
        state_presence_ok &= bool(st) == bool(ref_st)
        if st:
            step_ok &= float(st["step"]) == float(ref_st["step"])
            for k in ("exp_avg", "exp_avg_sq"):
                state_errs.append(err(st[k], ref_st[k].reshape(-1)[start:end]))
    lrs_equal = [g["lr"] for g in engine.optimizer.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    loaded_steps = engine.global_steps
    loss_errs = []
    for step in range(3, 6):
        local = engine_step(engine, step, micro, 1, noise=False)
        loss_errs.append(err(global_loss(local), ref_step(ref, ref_opt, step)))
    param_err = max(err(a, b) for a, b in zip(full_params(model), ref.parameters(), strict=True))
    return {
        "client_state": client_state,
        "exact": exact,
        "load_param_err": load_param_err,
        "gathered_after_load": gathered_after_load,
        "state_err": max(state_errs),
        "state_presence_ok": state_presence_ok,
        "step_ok": step_ok,
        "lrs_equal": lrs_equal,
        "loaded_steps": loaded_steps,
        "loss_err": max(loss_errs),
        "param_err": param_err,
        "path": str(path),
    }


@scenario
def consolidate_tied(stage: int, ctx: Context) -> dict:
    """Tied weights, a frozen parameter, buffers: consolidate() equals the reference's state_dict."""
    n, micro = world(), 3
    torch.manual_seed(1234)
    model = TiedLM()
    model.mix.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    cfg = config(stage, micro, bucket=50)
    engine = zerodp.initialize(model, cfg)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.02, weight_decay=0.05)
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    for step in range(4):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randint(0, 11, (micro * n, 4), generator=g)
        y = torch.randint(0, 11, (micro * n, 4), generator=g)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(x).reshape(-1, 11), y.reshape(-1)).backward()
        ref_opt.step()
        lo = rank() * micro
        out = engine(x[lo : lo + micro])
        engine.backward(nn.functional.cross_entropy(out.reshape(-1, 11), y[lo : lo + micro].reshape(-1)))
        engine.step()
    d = ctx.ckpt_dir / f"tied-w{n}-s{stage}"
    engine.save_checkpoint(d)
    if rank() == 0:
        consolidate(d, d / "out" / "model.safetensors")
        consolidate(d, d / "out" / "model.pt")
    dist.barrier()
    sd = load_file(str(d / "out" / "model.safetensors"))
    plain = TiedLM()
    plain.load_state_dict(sd)  # strict: every key of the model's state_dict, nothing else
    want = ref.state_dict()
    mine = engine.module_state_dict()
    pt = torch.load(d / "out" / "model.pt", weights_only=True)
    return {
        "gathered_after_state_dict": gathered_report(engine),
        "keys": sorted(sd),
        "want_keys": sorted(want),
        "pt_keys_in_order": list(pt) == list(want),
        "ref_err": max(err(plain.state_dict()[k], want[k]) for k in want),
        "equals_module_state_dict": sorted(sd) == sorted(mine) and all(torch.equal(sd[k], mine[k]) for k in sd),
        "pt_equal": sorted(pt) == sorted(sd) and all(torch.equal(pt[k], sd[k]) for k in sd),
        "tied_equal": torch.equal(sd["head.weight"], sd["emb.weight"]),
        "module_state_dict_keys_in_order": list(mine) == list(model.state_dict()),
        "buffer_equal": torch.equal(sd["offset"], ref.offset),
        "frozen_equal": torch.equal(sd["mix.bias"], ref.mix.bias.detach()),
        "moved": max((want[k].float() - initial[k].float()).abs().max().item() for k in want),
        "output_err": err(plain(torch.arange(8).reshape(2, 4) % 11), ref(torch.arange(8).reshape(2, 4) % 11)),
    }


def model_snapshot(engine: zerodp.Engine, model: nn.Module) -> tuple:
    """Everything a load may change: parameters (read gathered), buffers, optimizer pieces, steps, lrs."""
    return (
        full_params(model),
        [b.clone() for b in model.buffers()],
        piece_states(engine),
        engine.global_steps,
        engine.micro_steps,
        [g["lr"] for g in engine.optimizer.param_groups],
    )


def same_snapshot(a: tuple, b: tuple) -> bool:
    def same(x: list, y: list) -> bool:
        return len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y, strict=True))

    return (
        same(a[0], b[0])
        and same(a[1], b[1])
        and [s[:3] for s in a[2]] == [s[:3] for s in b[2]]
        and all(
            u[3].keys() == v[3].keys() and all(torch.equal(u[3][k], v[3][k]) for k in u[3])
            for u, v in zip(a[2], b[2], strict=True)
        )
        and a[3:] == b[3:]
    )


@scenario
def refuse_mismatch(stage: int, ctx: Context) -> dict:
    """Loads refused on every rank leave a trained engine unchanged (parameters compared gathered):
    a model of another shape, and a matching model given a checkpoint with a truncated rank file.
    Uses world 4's stage-2 checkpoint (ckpt_dir/reshard-w4-s2)."""
    n = world()
    micro = GLOBAL_ROWS // n
    src = ctx.ckpt_dir / "reshard-w4-s2"
    broken = ctx.ckpt_dir / f"broken-w{n}-s{stage}"
    if rank() == 0:
        shutil.copytree(src, broken)
        f = broken / "global_step3" / "rank1.safetensors"
        f.write_bytes(f.read_bytes()[:-16])
    dist.barrier()
    out: dict = {}
    for case, hidden, d in (("shape", 8, src), ("truncated", 7, broken)):
        model, engine = zoo_engine(stage, micro, hidden=hidden, seed=55)
        for step in range(2):
            engine_step(engine, step, micro, 1, noise=False)
        before = model_snapshot(engine, model)
        try:
            engine.load_checkpoint(d)
            error = None
        except checkpoint.CheckpointError as e:
            error = str(e)
        out[case] = {
            "error": error,
            "unchanged": same_snapshot(before, model_snapshot(engine, model)),
            "gathered": gathered_report(engine),
            "trained_steps": before[3],
        }
    return out


@scenario
def crash_safety(stage: int, ctx: Context) -> dict:
    """Rank 1 dies after writing its file, before the rename: ``latest`` and the previous checkpoint
    stay intact and load; the next save (and overwriting an existing tag) works."""
    d = ctx.ckpt_dir / f"crash-w{world()}-s{stage}"
    micro = 2
    model, engine = zoo_engine(stage, micro)
    for step in range(2):
        engine_step(engine, step, micro, 1, noise=False)
    engine.save_checkpoint(d)
    saved = engine.module_state_dict()
    for step in range(2, 4):
        engine_step(engine, step, micro, 1, noise=False)

    original = checkpoint_save._write_rank_file

    def write_then_die(eng, layout, tmp):  # type: ignore[no-untyped-def]
        path = original(eng, layout, tmp)
        if rank() == world() - 1:
            raise RuntimeError(f"simulated crash after writing {path.name}")
        return path

    checkpoint_save._write_rank_file = write_then_die
    try:
        engine.save_checkpoint(d)
        crash_error = None
    except Exception as e:  # every rank must raise
        crash_error = f"{type(e).__name__}: {e}"
    finally:
        checkpoint_save._write_rank_file = original
    latest_after_crash = (d / "latest").read_text()
    listing_after_crash = sorted(os.listdir(d))
    _, fresh = zoo_engine(stage, micro, seed=7)
    path, _ = fresh.load_checkpoint(d)
    previous_loads = same_state_dict(saved, fresh.module_state_dict()) and fresh.global_steps == 2

    engine.save_checkpoint(d)  # the stale .tmp dir is replaced
    latest_after_retry = (d / "latest").read_text()
    engine.save_checkpoint(d, tag="global_step2")  # overwrite an existing checkpoint
    _, fresh2 = zoo_engine(stage, micro, seed=8)
    fresh2.load_checkpoint(d, tag="global_step2")
    overwrite_loads = same_state_dict(engine.module_state_dict(), fresh2.module_state_dict())
    dist.barrier()
    return {
        "crash_error": crash_error,
        "latest_after_crash": latest_after_crash,
        "listing_after_crash": listing_after_crash,
        "loaded": path.name,
        "previous_loads": previous_loads,
        "latest_after_retry": latest_after_retry,
        "latest_final": (d / "latest").read_text(),
        "overwrite_loads": overwrite_loads,
        "listing_final": sorted(os.listdir(d)),
    }


#: the parameters :func:`freeze_midrun` freezes after initialize: partitioned at stage 3 (``fc1.bias``,
#: ``fc2.weight``) and persistent (``scale``)
def midrun_frozen(m: Zoo) -> list[nn.Parameter]:
    return [m.fc1.bias, m.fc2.weight, m.scale]


@scenario
def freeze_midrun(stage: int, ctx: Context) -> dict:
    """Every parameter trains at initialize; after step 1 some are frozen (``requires_grad_(False)``),
    step 2 runs, a checkpoint is saved while they are frozen; step 3 frozen, then unfrozen for steps 4-5.
    A fresh engine (all parameters training, as at initialize) loads the checkpoint, freezes them the
    same way and repeats steps 3-5: losses, parameters, fp32 pieces and optimizer state must equal the
    run without the save/load bit for bit, and the run must match plain PyTorch doing the same.
    Argument ``offload``: ``offload_optimizer.device = "cpu"``; ``nvme``: ``"nvme"`` (swap files under
    the checkpoint directory, sub-groups of 40 elements)."""
    n = world()
    micro = GLOBAL_ROWS // n
    d = ctx.ckpt_dir / (f"freeze-w{n}-s{stage}" + (f"-{ctx.arg}" if ctx.arg else ""))

    def make(seed: int) -> tuple[Zoo, zerodp.Engine]:
        torch.manual_seed(seed)
        model = Zoo()
        cfg = config(stage, micro)
        if ctx.arg == "offload":
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        elif ctx.arg == "nvme":
            swap = ctx.ckpt_dir / "swap"
            swap.mkdir(exist_ok=True)
            cfg["zero_optimization"].update(
                sub_group_size=40, offload_optimizer={"device": "nvme", "nvme_path": str(swap)}
            )
        return model, zerodp.initialize(model, cfg, model_parameters=zoo_groups(model))

    def resident(e: zerodp.Engine) -> contextlib.AbstractContextManager:
        """NVMe: masters and optimizer states read into memory for the block (piece_states reads them)."""
        return e.optimizer_offload.resident(e.optimizer) if ctx.arg == "nvme" else contextlib.nullcontext()

    def set_frozen(m: Zoo, frozen: bool) -> None:
        for p in midrun_frozen(m):
            p.requires_grad_(not frozen)

    ref, ref_opt = reference()
    model, engine = make(1234)
    ref_losses, losses = [], []
    for step in range(3):
        if step == 2:
            set_frozen(model, True)
            set_frozen(ref, True)
        losses.append(global_loss(engine_step(engine, step, micro, 1, noise=False)))
        ref_losses.append(ref_step(ref, ref_opt, step))
    engine.save_checkpoint(d)
    meta = json.loads((d / "global_step3" / "meta.json").read_text())
    records = {r["name"]: [r["trained"], r["requires_grad"]] for r in meta["params"]}

    def rest(m: Zoo, e: zerodp.Engine, r: Zoo | None = None) -> list[torch.Tensor]:
        out = []
        for step in range(3, 6):
            if step == 4:
                set_frozen(m, False)
                if r is not None:
                    set_frozen(r, False)
            out.append(global_loss(engine_step(e, step, micro, 1, noise=False)))
            if r is not None:
                ref_losses.append(ref_step(r, ref_opt, step))
        return out

    losses += rest(model, engine, ref)
    final = engine.module_state_dict()
    with resident(engine):
        states, values = piece_states(engine), piece_values(engine)
    ref_err = max(
        [err(a, b) for a, b in zip(losses, ref_losses, strict=True)]
        + [err(a, b) for a, b in zip(full_params(model), ref.parameters(), strict=True)]
    )

    model2, engine2 = make(999)  # every parameter trains, as in the saving engine at initialize
    engine2.load_checkpoint(d)
    loaded_equal = same_state_dict(load_full_state_dict(d), engine2.module_state_dict())
    set_frozen(model2, True)  # the loop's freeze schedule, re-applied after the load
    losses2 = rest(model2, engine2)
    with resident(engine2):
        states2, values2 = piece_states(engine2), piece_values(engine2)
    params_equal = same_state_dict(final, engine2.module_state_dict())
    engine.close()
    engine2.close()
    return {
        "records": records,
        "ref_err": ref_err,
        "loaded_equal": loaded_equal,
        "losses_equal": all(torch.equal(a, b) for a, b in zip(losses[3:], losses2, strict=True)),
        "params_equal": params_equal,
        "pieces_equal": same_piece_values(values, values2),
        "states_equal": [s[:3] for s in states] == [s[:3] for s in states2]
        and all(
            a[3].keys() == b[3].keys() and all(torch.equal(a[3][k], b[3][k]) for k in a[3])
            for a, b in zip(states, states2, strict=True)
        ),
        "pieces_with_state": sum(1 for s in states2 if s[3]),
    }


def parse_spec(spec: str, stages: list[int]) -> list[tuple[str, str, int, str | None]]:
    """``name`` | ``name@S`` | ``name@S:arg`` -> [(result key, name, stage, arg)]."""
    name, _, rest = spec.partition("@")
    if not rest:
        return [(f"{name}/stage{s}", name, s, None) for s in stages]
    stage, _, arg = rest.partition(":")
    key = f"{name}/stage{stage}" + (f":{arg}" if arg else "")
    return [(key, name, int(stage), arg or None)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="0,1,2")
    ap.add_argument("--scenarios", default="all")
    ap.add_argument("--ckpt-dir", required=True, help="directory shared by every launch of one test session")
    args = ap.parse_args()
    zerodp.init_distributed(timeout_s=120)
    stages = [int(s) for s in args.stages.split(",")]
    specs = list(SCENARIOS) if args.scenarios == "all" else args.scenarios.split(",")
    results: dict[str, dict] = {}
    for spec in specs:
        for key, name, stage, arg in parse_spec(spec, stages):
            t0 = time.perf_counter()
            try:
                results[key] = {"ok": True, **SCENARIOS[name](stage, Context(Path(args.ckpt_dir), arg))}
            except Exception:  # recorded and asserted on by pytest
                results[key] = {"ok": False, "error": traceback.format_exc()}
            results[key]["seconds"] = time.perf_counter() - t0
            dist.barrier()
    with open(os.path.join(args.out, f"rank{rank()}.json"), "w") as f:
        json.dump(results, f)
    zerodp.shutdown_distributed()  # barrier: no rank tears down while another is mid-collective


if __name__ == "__main__":
    main()
