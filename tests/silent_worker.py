"""Per-rank worker for tests/test_silent_wrong.py (issue 10: no silently wrong training), launched by
torchrun through tests/distributed.py. Each scenario runs at each requested stage, in one process group,
and compares zerodp with single-process plain PyTorch on the same global batch, or records the refusal
raised (type, message, and whether the engine's state changed).
"""

from __future__ import annotations

import copy
import sys
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).parent))
import dist_worker  # noqa: E402  (shared helpers and the main loop)
import zerodp  # noqa: E402
import zerodp.checkpoint  # noqa: E402
from dist_worker import STAGE3_DEFAULTS, MixedReference, err, rank, world  # noqa: E402
from zerodp.runtime.grad_placeholder import is_hidden_gradient  # noqa: E402
from zerodp.runtime.guards import RefusedError  # noqa: E402

SCENARIOS = dist_worker.SCENARIOS
SCENARIOS.clear()
scenario = dist_worker.scenario
MICRO = 3


def batch(step: int, d_in: int, d_out: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g)


def config(stage: int, **extra: Any) -> dict:
    zero = {"stage": stage, **STAGE3_DEFAULTS, **extra.pop("zero", {})}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": 0.02}},
        "zero_optimization": zero,
        **extra,
    }


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def local(x: torch.Tensor) -> torch.Tensor:
    return x[rank() * MICRO : (rank() + 1) * MICRO]


def train_both(
    engine,
    model: nn.Module,
    ref: nn.Module,
    ref_opt,
    steps: range,
    d_in: int,
    d_out: int,
    fwd: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda m, x: m(x),
) -> None:
    for step in steps:
        x, y = batch(step, d_in, d_out, MICRO * world())
        ref_opt.zero_grad()
        ((fwd(ref, x) - y) ** 2).mean().backward()
        ref_opt.step()
        engine.backward(((fwd(engine, local(x)) - local(y)) ** 2).mean())
        engine.step()


def state_err(engine, ref: nn.Module) -> float:
    """Max err over every parameter (module_state_dict: full fp32 values, a collective)."""
    full = engine.module_state_dict()
    return max(err(full[k], v) for k, v in ref.state_dict().items())


def refusal(fn: Callable[[], Any]) -> dict:
    try:
        fn()
    except RefusedError as e:
        return {"refused": True, "message": str(e)}
    except Exception as e:  # a crash is not a refusal
        return {"refused": False, "message": f"{type(e).__name__}: {e}"}
    return {"refused": False, "message": ""}


def setup(stage: int, model_fn: Callable[[], nn.Module] = mlp, prepare: Callable | None = None, **cfg: Any):
    torch.manual_seed(11)
    ref = model_fn()
    if prepare is not None:
        prepare(ref)
    model = copy.deepcopy(ref)
    engine = zerodp.initialize(model, config(stage, **cfg))
    ref_opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=0.02)
    return engine, model, ref, ref_opt


# ---- 1: unfreezing after initialize ------------------------------------------------------------------
@scenario
def unfreeze_after_initialize(stage: int) -> dict:
    engine, model, ref, ref_opt = setup(stage, prepare=lambda m: m[0].requires_grad_(False))
    train_both(engine, model, ref, ref_opt, range(2), 8, 2)
    before = engine.module_state_dict()
    model[0].requires_grad_(True)
    x, y = batch(2, 8, 2, MICRO * world())
    out = refusal(lambda: engine.backward(((engine(local(x)) - local(y)) ** 2).mean()))
    after = engine.module_state_dict()
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    model[0].requires_grad_(False)  # back to what initialize saw: training goes on and stays right
    train_both(engine, model, ref, ref_opt, range(3, 5), 8, 2)
    out["param_err"] = state_err(engine, ref)
    return out


# ---- 2: in-place edits between steps -----------------------------------------------------------------
def _edit(m: nn.Module) -> None:
    """Halve two parameters in place; a partitioned one (stage 3) inside GatheredParameters."""
    with torch.no_grad():
        m[2].bias.mul_(0.5)  # 2 elements: persistent (always gathered) at stage 3
        with zerodp.zero.GatheredParameters(
            [m[0].weight], modifier_rank=0, enabled=zerodp.zero.is_partitioned(m[0].weight)
        ):
            m[0].weight.mul_(0.5)


@scenario
def edit_between_steps_fp32(stage: int) -> dict:
    engine, model, ref, ref_opt = setup(stage)
    train_both(engine, model, ref, ref_opt, range(2), 8, 2)
    _edit(model)
    _edit(ref)
    train_both(engine, model, ref, ref_opt, range(2, 4), 8, 2)
    new_bias = torch.tensor([0.3, -0.7])  # re-binding: p.data = new tensor (re-initialising a head)
    model[2].bias.data = new_bias.clone()
    ref[2].bias.data = new_bias.clone()
    train_both(engine, model, ref, ref_opt, range(4, 6), 8, 2)
    out = {"param_err": state_err(engine, ref)}
    if stage == 3:  # an edit or use of a partitioned parameter outside GatheredParameters must raise
        w = model[0].weight
        before = engine.module_state_dict()

        def in_place() -> None:
            with torch.no_grad():
                w.mul_(0.5)

        attempts = {
            "rebind": lambda: setattr(w, "data", torch.zeros(8, 8)),
            "in_place": in_place,
            "data_in_place": lambda: w.data.mul_(2),
            "compute": lambda: w @ torch.ones(8),
            "init": lambda: nn.init.zeros_(w),
            "detach_copy": lambda: w.detach().clone(),
        }
        out["attempts"] = {k: refusal(fn) for k, fn in attempts.items()}
        after = engine.module_state_dict()
        out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
        train_both(engine, model, ref, ref_opt, range(6, 8), 8, 2)  # training goes on, right
        out["param_err_after"] = state_err(engine, ref)
    return out


@scenario
def edit_between_steps_bf16(stage: int) -> dict:
    torch.manual_seed(11)
    base = mlp()
    ref = MixedReference(copy.deepcopy(base), torch.bfloat16, torch.optim.Adam, {"lr": 0.02})
    model = copy.deepcopy(base)
    engine = zerodp.initialize(model, config(stage, bf16={"enabled": True}))
    rel = []
    for step in range(4):
        if step == 2:
            _edit(model)
            _edit(ref.model)
            with torch.no_grad():  # the reference's master follows its edited module value
                for p, m in zip(ref.params, ref.masters, strict=True):
                    m.copy_(p)
        x, y = batch(step, 8, 2, MICRO * world())
        ref.step(((ref.model(x.bfloat16()).float() - y) ** 2).mean())
        engine.backward(((engine(local(x).bfloat16()).float() - local(y)) ** 2).mean())
        engine.step()
    for (_name, p), m in zip(model.named_parameters(), ref.masters, strict=True):
        full = zerodp.zero.safe_get_full_fp32_param(p)
        rel.append(((full - m).abs() / (m.abs() + 1e-2)).max().item())
    return {"master_rel_err": max(rel)}


# ---- 3: full gradients, parameters and optimizer states ----------------------------------------------
@scenario
def accessors(stage: int) -> dict:
    engine, model, ref, ref_opt = setup(
        stage, model_fn=lambda: nn.Sequential(nn.Linear(8, 9), nn.Tanh(), nn.Linear(9, 3))
    )
    names = [n for n, _ in ref.named_parameters()]
    errs: dict[str, float] = {"grad": 0.0, "p_grad": 0.0, "param": 0.0, "exp_avg": 0.0, "norm": 0.0, "set": 0.0}
    compared = hidden = 0
    stale_grad = {"refused": False}
    for step in range(3):
        x, y = batch(step, 8, 3, MICRO * world())
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
        engine.backward(((engine(local(x)) - local(y)) ** 2).mean())
        for _name, p, rp in zip(names, model.parameters(), ref.parameters(), strict=True):
            errs["grad"] = max(errs["grad"], err(zerodp.zero.safe_get_full_grad(p), rp.grad))
            if is_hidden_gradient(p.grad):  # a placeholder that raises on use
                hidden += 1
            elif p.grad is not None:  # p.grad is the true averaged gradient, a placeholder or None
                errs["p_grad"] = max(errs["p_grad"], err(p.grad, rp.grad))
                compared += 1
        ref_opt.step()
        engine.step()
        errs["norm"] = max(errs["norm"], abs(engine.get_global_grad_norm() - ref_norm) / ref_norm)
        for p, rp in zip(model.parameters(), ref.parameters(), strict=True):
            errs["param"] = max(errs["param"], err(zerodp.zero.safe_get_full_fp32_param(p), rp))
            errs["exp_avg"] = max(
                errs["exp_avg"],
                err(zerodp.zero.safe_get_full_optimizer_state(p, "exp_avg"), ref_opt.state[rp]["exp_avg"]),
            )
    try:
        zerodp.zero.safe_get_full_grad(next(model.parameters()))  # after step(): consumed
    except RuntimeError as e:
        stale_grad = {"refused": True, "message": str(e)}
    # surgery: set a parameter and its exp_avg_sq on both, train on, compare everything
    w, rw = model[2].weight, ref[2].weight
    new_w = torch.linspace(-1, 1, rw.numel()).view(rw.shape)
    new_sq = torch.full(rw.shape, 0.01)
    zerodp.zero.safe_set_full_fp32_param(w, new_w)
    zerodp.zero.safe_set_full_optimizer_state(w, new_sq, "exp_avg_sq")
    with torch.no_grad():
        rw.copy_(new_w)
    ref_opt.state[rw]["exp_avg_sq"].copy_(new_sq)
    errs["set"] = err(zerodp.zero.safe_get_full_fp32_param(w), new_w)
    train_both(engine, model, ref, ref_opt, range(3, 5), 8, 3)
    return {
        **{f"{k}_err": v for k, v in errs.items()},
        "param_err": state_err(engine, ref),
        "p_grad_compared": compared,
        "p_grad_hidden": hidden,
        "stale_grad": stale_grad,
    }


@scenario
def p_grad_with_accumulation(stage: int) -> dict:
    """gradient_accumulation_steps 2: after every backward, param.grad is the averaged gradient of the
    whole accumulation (boundary, stage 0) or a placeholder that raises on use; never this rank's
    partial sum, never None (torch.nn.utils.clip_grad_norm_ would skip it silently)."""
    engine, model, ref, ref_opt = setup(stage, gradient_accumulation_steps=2)
    n, r = world(), rank()
    worst, compared, partial_visible, hidden, none = 0.0, 0, 0, 0, 0
    for step in range(2):
        x, y = batch(step, 8, 2, MICRO * n * 2)
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        for j in range(2):
            lo = (j * n + r) * MICRO
            engine.backward(((engine(x[lo : lo + MICRO]) - y[lo : lo + MICRO]) ** 2).mean())
            for p, rp in zip(model.parameters(), ref.parameters(), strict=True):
                hidden += is_hidden_gradient(p.grad)
                none += p.grad is None
                if p.grad is not None and not is_hidden_gradient(p.grad) and p.grad.numel() == rp.numel():
                    if j == 0 and n > 1:
                        partial_visible += 1
                    else:
                        worst = max(worst, err(p.grad, rp.grad))
                        compared += 1
            engine.step()
    return {
        "p_grad_err": worst,
        "p_grad_compared": compared,
        "partial_visible": partial_visible,
        "p_grad_hidden": hidden,
        "p_grad_none": none,
        "n_params": len(list(model.parameters())),
        "param_err": state_err(engine, ref),
    }


@scenario
def two_backward_calls_per_step(stage: int) -> dict:
    """Two engine.backward calls (two losses) before one step: gradients add up, as in torch."""
    engine, model, ref, ref_opt = setup(stage)
    for step in range(3):
        x, y = batch(step, 8, 2, MICRO * world())
        ref_opt.zero_grad()
        out = ref(x)
        ((out - y) ** 2).mean().backward(retain_graph=True)
        (out.abs().mean() * 0.3).backward()
        ref_opt.step()
        out = engine(local(x))
        engine.backward(((out - local(y)) ** 2).mean(), retain_graph=True)
        engine.backward(out.abs().mean() * 0.3)
        engine.step()
    return {"param_err": state_err(engine, ref)}


# ---- 4: add_param_group after initialize ---------------------------------------------------------------
@scenario
def add_param_group_after_initialize(stage: int) -> dict:
    engine, model, ref, ref_opt = setup(stage)
    extra = nn.Parameter(torch.zeros(3))
    groups_before = len(engine.optimizer.param_groups)
    out = refusal(lambda: engine.optimizer.add_param_group({"params": [extra]}))
    out["unchanged"] = len(engine.optimizer.param_groups) == groups_before
    return out


# ---- 5: a parameter accumulated more than once per backward (checkpointed reuse) ---------------------
class Reused(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.inp, self.blk, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(2):
            if self.reentrant is None:
                h = torch.tanh(self.blk(h))
            else:
                h = checkpoint(lambda t: torch.tanh(self.blk(t)), h, use_reentrant=self.reentrant)
        return self.out(h)


def _reuse(stage: int, reentrant: bool) -> dict:
    torch.manual_seed(11)
    ref = Reused(None)  # plain torch, no checkpointing
    model = copy.deepcopy(ref)
    model.reentrant = reentrant
    engine = zerodp.initialize(model, config(stage, zero={"reduce_bucket_size": 40}))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.02)
    train_both(engine, model, ref, ref_opt, range(3), 8, 2)
    # each rank's own copy (stages 0-2 hold every parameter; stage 3 its assembled state): bit-identical
    own = [p.detach() for p in model.parameters()] if stage < 3 else list(engine.module_state_dict().values())
    digest = zlib.crc32(b"".join(t.contiguous().numpy().tobytes() for t in own))
    return {"param_err": state_err(engine, ref), "digest": digest}


@scenario
def checkpoint_reuse_reentrant(stage: int) -> dict:
    return _reuse(stage, True)


@scenario
def checkpoint_reuse_non_reentrant(stage: int) -> dict:
    return _reuse(stage, False)


# ---- 6: sparse gradients -----------------------------------------------------------------------------
@scenario
def sparse_embedding(stage: int) -> dict:
    class Emb(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(20, 8, sparse=True)
            self.head = nn.Linear(8, 2)

    model = Emb()
    data_ptr = model.emb.weight.data_ptr()
    out = refusal(lambda: zerodp.initialize(model, config(stage)))
    out["unchanged"] = model.emb.weight.data_ptr() == data_ptr
    return out


# ---- 7: torch.compile at stage 3 ---------------------------------------------------------------------
@scenario
def compiled_module(stage: int) -> dict:
    if stage != 3:  # stages 0-2 compose with torch.compile: trained as torch trains the same model
        torch.manual_seed(11)
        ref = mlp()
        model = copy.deepcopy(ref)
        engine = zerodp.initialize(torch.compile(model, backend="aot_eager"), config(stage))
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.02)
        train_both(engine, model, ref, ref_opt, range(2), 8, 2)
        full = {k.removeprefix("_orig_mod."): v for k, v in engine.module_state_dict().items()}
        return {"param_err": max(err(full[k], v) for k, v in ref.state_dict().items()), "compiled": True}
    model = mlp()
    out = refusal(lambda: zerodp.initialize(torch.compile(model, backend="aot_eager"), config(stage)))
    sub = mlp()
    sub[0] = torch.compile(sub[0], backend="aot_eager")
    inner = refusal(lambda: zerodp.initialize(sub, config(stage)))
    out["submodule_refused"], out["submodule_message"] = inner["refused"], inner["message"]
    return out


# ---- 8: memory format --------------------------------------------------------------------------------
class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 3, 3, padding=1)  # frozen: kept as it is, checkpointed from model_extra
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 2, 2, 2).contiguous(memory_format=torch.channels_last)
        return self.head(self.conv2(torch.tanh(self.conv(x))).mean((2, 3)))


def _channels_last(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


@scenario
def channels_last(stage: int) -> dict:
    """Item 8: a channels_last conv weight keeps its memory format (values, strides) through initialize,
    training, the accessors and a checkpoint round trip; training matches torch."""
    import tempfile

    torch.manual_seed(11)
    ref = ConvNet().to(memory_format=torch.channels_last)
    ref.conv2.requires_grad_(False)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = zerodp.initialize(model, config(stage))
    out: dict = {"warned": [str(w.message) for w in caught if "contiguous" in str(w.message)]}
    w, rw = model.conv.weight, ref.conv.weight
    out["strides_ref"] = list(rw.stride())
    out["strides_after_init"] = list(w.stride())
    out["frozen_strides"] = [list(model.conv2.weight.stride()), list(ref.conv2.weight.stride())]
    with zerodp.zero.GatheredParameters([w], enabled=zerodp.zero.is_partitioned(w)):
        out["values_after_init"] = err(w, rw)
        out["cl_gathered"] = _channels_last(w)
    seen: list[bool] = []
    handle = model.conv.register_forward_pre_hook(lambda m, a: seen.append(_channels_last(m.weight)))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.02)
    grad_err = 0.0
    for step in range(2):
        x, y = batch(step, 8, 2, MICRO * world())
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        engine.backward(((engine(local(x)) - local(y)) ** 2).mean())
        grad_err = max(grad_err, err(zerodp.zero.safe_get_full_grad(w), rw.grad))
        if stage == 0:  # p.grad is the reduced gradient, in the parameter's memory format
            grad_err = max(grad_err, err(w.grad, rw.grad))
            out["grad_strides"] = list(w.grad.stride())
        ref_opt.step()
        engine.step()
    handle.remove()
    out["cl_in_forward"] = bool(seen) and all(seen)
    out["grad_err"] = grad_err
    out["strides_after_step"] = list(w.stride())
    out["fp32_param_err"] = err(zerodp.zero.safe_get_full_fp32_param(w), rw)
    out["param_err"] = state_err(engine, ref)
    # checkpoint round trip into a fresh engine, and the consolidated state dict
    box = [tempfile.mkdtemp(prefix="zerodp-cl-") if rank() == 0 else None]
    dist.broadcast_object_list(box)
    engine.save_checkpoint(box[0], tag="cl")
    torch.manual_seed(99)
    fresh = ConvNet().to(memory_format=torch.channels_last)
    fresh.conv2.requires_grad_(False)
    engine2 = zerodp.initialize(fresh, config(stage))
    engine2.load_checkpoint(box[0], tag="cl")
    out["ckpt_err"] = state_err(engine2, ref)
    full = zerodp.checkpoint.load_full_state_dict(f"{box[0]}", tag="cl")
    out["consolidated_err"] = max(err(full[k], v) for k, v in ref.state_dict().items())
    return out


# ---- 9: register_external_parameter before initialize ------------------------------------------------
class DeclaresExternal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.side = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 2)
        zerodp.zero.register_external_parameter(self, self.side.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + torch.tanh(h @ self.side.weight.t()))


@scenario
def external_declared_in_init(stage: int) -> dict:
    cfg = config(stage)
    torch.manual_seed(11)
    ref = DeclaresExternal()
    torch.manual_seed(11)
    with zerodp.zero.Init(config=cfg, enabled=stage == 3):
        model = DeclaresExternal()
    engine = zerodp.initialize(model, cfg)
    out: dict = {}
    if engine.sharding is not None:
        needed = engine.sharding.index.by_module.get(id(model), [])
        out["registered"] = any(s.param is model.side.weight for u in needed for s in u.slots)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.02)
    train_both(engine, model, ref, ref_opt, range(3), 8, 2)
    out["param_err"] = state_err(engine, ref)
    return out


# ---- 10: shape-based optimizer groups (nanoGPT's configure_optimizers) after zero.Init ---------------
class NanoBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(self.ln(x))))


class Nano(nn.Module):
    """nanoGPT's shape: embeddings, blocks with LayerNorm and Linear, a tied head, _init_weights."""

    def __init__(self, vocab: int = 11, d: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(4, d)
        self.h = nn.ModuleList(NanoBlock(d) for _ in range(2))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.2)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.h:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def nano_groups(model: nn.Module) -> tuple[list[dict], list[list[str]], int]:
    """nanoGPT's configure_optimizers: weight decay for every parameter with dim >= 2."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    decay = {n: p for n, p in params.items() if p.dim() >= 2}
    no_decay = {n: p for n, p in params.items() if p.dim() < 2}
    groups = [
        {"params": list(decay.values()), "weight_decay": 0.5},
        {"params": list(no_decay.values()), "weight_decay": 0.0},
    ]
    return groups, [list(decay), list(no_decay)], sum(p.numel() for p in params.values())


@scenario
def nanogpt_groups_after_init(stage: int) -> dict:
    cfg = config(stage)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.5}}
    torch.manual_seed(11)
    ref = Nano()
    torch.manual_seed(11)
    with zerodp.zero.Init(config=cfg, enabled=stage == 3):
        model = Nano()
    shapes_ok = all(
        p.shape == rp.shape and p.dim() == rp.dim() for p, rp in zip(model.parameters(), ref.parameters(), strict=True)
    )
    groups, names, numel = nano_groups(model)
    ref_groups, ref_names, ref_numel = nano_groups(ref)
    engine = zerodp.initialize(model, cfg, model_parameters=groups)
    ref_opt = torch.optim.AdamW(ref_groups, lr=0.02)
    out: dict = {"names": names, "ref_names": ref_names, "numel": numel, "ref_numel": ref_numel}
    for step in range(2):
        g = torch.Generator().manual_seed(900 + step)
        idx = torch.randint(0, 11, (MICRO * world(), 4), generator=g)
        tgt = torch.randint(0, 11, (MICRO * world(), 4), generator=g)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(idx).flatten(0, 1), tgt.flatten()).backward()
        ref_opt.step()
        engine.backward(nn.functional.cross_entropy(engine(local(idx)).flatten(0, 1), local(tgt).flatten()))
        engine.step()
    # after training: full metadata, while the partitioned ones hold no storage (read from the storage)
    params = list(model.parameters())
    out["shapes_ok"] = shapes_ok and all(
        p.shape == rp.shape and p.numel() == rp.numel() for p, rp in zip(params, ref.parameters(), strict=True)
    )
    out["storage_free"] = sum(p.untyped_storage().nbytes() == 0 for p in params)
    out["partitioned"] = sum(zerodp.zero.is_partitioned(p) for p in params)
    out["param_err"] = state_err(engine, ref)
    return out


if __name__ == "__main__":
    dist_worker.main()
