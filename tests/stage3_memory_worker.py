"""Per-rank worker for tests/test_stage3_memory.py (launched by torchrun, see tests/distributed.py).

Measures, from live storage, how much gathered parameter memory autograd keeps alive between a stage-3
forward and its backward: every tensor saved for backward is captured with
``torch.autograd.graph.saved_tensors_hooks``; the saved tensors that come from a parameter (they share
its gathered storage at save time, or have its full shape or the transposed one: views and casts) are
kept, and after forward the bytes of their distinct storages (``untyped_storage().nbytes()``) are
summed. Views of a partitioned parameter's gathered buffers are saved by zerodp's own hooks, innermost
(see [Note: escaping views] in zerodp.stage3.aliases), as descriptors that never reach an enclosing
hook: those are captured where zerodp creates them, and measured from the buffer they name. Then backward and one
optimizer step run and the parameters are compared with plain PyTorch on the same global batch (so saved views re-filled
by the re-gather are checked to be the right values).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import zerodp
import zerodp.stage3.aliases as aliases
from dist_worker import rank, world
from distributed import run_selected, worker_args

SCENARIOS: dict[str, Callable[[], dict]] = {}


def scenario(fn: Callable[[], dict]) -> Callable[[], dict]:
    SCENARIOS[fn.__name__] = fn
    return fn


_ACTIVE: list[SavedParamTensors] = []
_alias_init = aliases._SavedAlias.__init__


def _observed_alias_init(self, *args, **kwargs) -> None:
    _alias_init(self, *args, **kwargs)
    if _ACTIVE:
        _ACTIVE[-1].total += 1
        _ACTIVE[-1].aliases.append(self)


aliases._SavedAlias.__init__ = _observed_alias_init


def _alias_buffer(a) -> torch.Tensor:
    return a.unit.full if a.key is None else a.unit.casts[a.key]


class SavedParamTensors:
    """saved_tensors_hooks context collecting the saved tensors derived from ``params`` (and the views
    of gathered buffers that zerodp saved as descriptors)."""

    def __init__(self, params: list[nn.Parameter], shapes: list[torch.Size]) -> None:
        self.params = params
        self.shapes = {tuple(s) for s in shapes} | {tuple(reversed(s)) for s in shapes}
        self.saved: list[torch.Tensor] = []
        self.aliases: list = []  # zerodp's descriptors of saved views of gathered buffers
        self.total = 0  # tensors saved, of any kind
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def count(self) -> int:
        return len(self.saved) + len(self.aliases)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.total += 1
        ptrs = {p.untyped_storage().data_ptr() for p in self.params if p.untyped_storage().nbytes() > 0}
        if t.untyped_storage().data_ptr() in ptrs or tuple(t.shape) in self.shapes:
            self.saved.append(t)
        return t

    def __enter__(self) -> SavedParamTensors:
        self.hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)
        self.hooks.__exit__(*exc)

    def live_bytes(self) -> int:
        """Bytes of the distinct storages behind the captured tensors, as they are now."""
        storages = {
            t.untyped_storage()._cdata: t.untyped_storage().nbytes()
            for t in self.saved + [_alias_buffer(a) for a in self.aliases]
        }
        return sum(storages.values())

    def logical_bytes(self) -> int:
        """Bytes the captured tensors would hold if their storages were still allocated."""
        return sum(t.numel() * t.element_size() for t in self.saved) + sum(
            torch.Size(a.size).numel() * a.dtype.itemsize for a in self.aliases
        )


def config(zero: dict, bf16: bool = False, lr: float = 0.01) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": lr}},
        "zero_optimization": {"stage": 3, **zero},
        "bf16": {"enabled": bf16},
    }


def run_case(
    model_fn: Callable[[], nn.Module],
    make_x: Callable[[int], torch.Tensor],
    zero: dict,
    bf16: bool = False,
    iterations: int = 2,
    compare: bool = True,
) -> dict:
    """Train ``iterations`` steps at stage 3 (measuring the last forward) and against plain torch."""
    torch.manual_seed(0)
    ref = model_fn()
    model = model_fn()
    model.load_state_dict(ref.state_dict())
    shapes = [p.shape for p in ref.parameters()]
    engine = zerodp.initialize(model, config(zero, bf16=bf16))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    r, n = rank(), world()
    out: dict = {}
    for it in range(iterations):
        torch.manual_seed(100 + it)
        x = make_x(2 * n)
        if x.is_floating_point():  # inputs that need grad make every op save its weight operand
            x = x.to(torch.bfloat16 if bf16 else torch.float32).requires_grad_()
        xs = x.detach()[2 * r : 2 * r + 2].requires_grad_(x.requires_grad)
        ref_opt.zero_grad()
        for rr in range(n):  # the same per-rank chunks, so rounding matches the ranks' (bf16 casts)
            chunk = x.detach()[2 * rr : 2 * rr + 2]
            chunk = chunk.float().requires_grad_() if chunk.is_floating_point() else chunk
            (ref(chunk).float().pow(2).mean() / n).backward()
        ref_opt.step()
        with SavedParamTensors(list(model.parameters()), shapes) as saved:
            loss = engine(xs).float().pow(2).mean()
        out.update(
            saved_param_tensors=saved.count,
            saved_total=saved.total,
            alive_after_forward=saved.live_bytes(),
            if_not_freed=saved.logical_bytes(),
            report_gathered_after_forward=engine.memory_report().measured["parameters"]
            - sum(u.shard.numel() * u.shard.element_size() for u in engine.sharding.units),
        )
        engine.backward(loss)
        engine.step()
        out["alive_after_backward"] = saved.live_bytes()
        del saved, loss
    units = engine.sharding.units
    elem = units[0].shard.element_size()
    out.update(
        persistent_bytes=sum(u.numel for u in units if u.persistent) * elem,
        max_live_bytes=engine.config.zero_optimization.stage3_max_live_parameters * elem,
        largest_unit_bytes=max(u.numel for u in units) * elem,
        prefetches=engine.sharding.coordinator.prefetches_issued,
        peak_gathered_bytes=engine.memory_report().peak["gathered_parameters"],
    )
    if compare:
        sd = engine.module_state_dict()
        # in units of one Adam step (lr 0.01): values read from a freed or stale buffer would be far off
        out["param_diff_steps"] = (
            max((sd[k].float() - v.float()).abs().max().item() for k, v in ref.state_dict().items()) / 0.01
        )
        out["compared"] = len(sd)
    return out


# ---- the MLP (scaled down: 8 x Linear(256, 256) + Linear(512, 1)) -----------------------------
H = 256


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(H, H), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(H, 1))


def mlp_case(bf16: bool, prefetch: bool) -> dict:
    zero = {
        "stage3_max_live_parameters": int(2.5 * H * H),
        "stage3_param_persistence_threshold": H,
        "stage3_prefetch_bucket_size": H * H + H if prefetch else 0,
    }
    return run_case(mlp, lambda rows: torch.randn(rows, H), zero, bf16=bf16, compare=not bf16)


@scenario
def mlp_fp32_prefetch() -> dict:
    return mlp_case(False, True)


@scenario
def mlp_fp32_no_prefetch() -> dict:
    return mlp_case(False, False)


@scenario
def mlp_bf16_prefetch() -> dict:
    return mlp_case(True, True)


@scenario
def mlp_bf16_no_prefetch() -> dict:
    return mlp_case(True, False)


# ---- one op kind each ----------------------------------------------------------------------------------
D = 24
OP_ZERO = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}


class MatmulT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D + 8, D) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w.t()) @ self.w


class EmbeddingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, D)
        self.head = nn.Linear(D, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


class ConvModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x))


class Bf16CastModel(nn.Module):
    """fp32 parameters, computed in bf16 through explicit casts (saved by matmul as bf16 copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D + 8, D) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.bfloat16) @ self.w.to(torch.bfloat16).t()).float()


class FloatCastNorm(nn.Module):
    """RMSNorm-style: a bf16 model whose norm weight is cast to fp32 (``weight.float()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(D) + 0.5)
        self.proj = nn.Linear(D, D + 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight.float()
        return self.proj(h.to(x.dtype))


@scenario
def op_linear() -> dict:
    return run_case(lambda: nn.Sequential(nn.Linear(D, D + 8), nn.Tanh()), lambda r: torch.randn(r, D), OP_ZERO)


@scenario
def op_matmul_transposed() -> dict:
    return run_case(MatmulT, lambda r: torch.randn(r, 3, D), OP_ZERO)


@scenario
def op_embedding() -> dict:
    return run_case(EmbeddingModel, lambda r: torch.randint(0, 50, (r, 7)), OP_ZERO)


@scenario
def op_conv() -> dict:
    return run_case(ConvModel, lambda r: torch.randn(r, 3, 9, 9), OP_ZERO)


@scenario
def op_layer_norm() -> dict:
    return run_case(lambda: nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 5)), lambda r: torch.randn(r, 6, D), OP_ZERO)


@scenario
def op_bf16_cast() -> dict:
    return run_case(Bf16CastModel, lambda r: torch.randn(r, D), OP_ZERO)


@scenario
def op_float_cast_in_bf16_model() -> dict:
    return run_case(FloatCastNorm, lambda r: torch.randn(r, 5, D), OP_ZERO, bf16=True, compare=False)


# ---- load_module_state_dict after initialize (stages 0-3 x fp32/bf16) ------------------------------------
class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 3)
        self.register_buffer("offset", torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x)))) + self.offset


def one_step(engine, x: torch.Tensor) -> dict[str, torch.Tensor]:
    r = rank()
    xs = x[2 * r : 2 * r + 2].to(engine.precision.param_dtype)
    loss = engine(xs).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return engine.module_state_dict()


@scenario
def load_after_initialize() -> dict:
    out: dict = {}
    for stage in (0, 1, 2, 3):
        for bf16 in (False, True):
            key = f"stage{stage}_{'bf16' if bf16 else 'fp32'}"
            cfg = config({"stage": stage, "stage3_param_persistence_threshold": 16}, bf16=bf16)
            torch.manual_seed(1)
            target = Small()
            with torch.no_grad():
                target.fc1.weight.fill_(0.5)  # a value far from any initialisation
                for t in target.state_dict().values():  # bf16-representable: the bf16 reference engine's
                    t.copy_(t.to(torch.bfloat16))  # masters (its weights cast up) are then the same
            sd = {k: v.clone() for k, v in target.state_dict().items()}
            torch.manual_seed(100)
            x = torch.randn(2 * world(), D)
            # reference: an engine built from the target weights (same stage and precision)
            expected = one_step(zerodp.initialize(_copy(target), cfg), x)
            torch.manual_seed(0)
            engine = zerodp.initialize(Small(), cfg)
            engine.load_module_state_dict(sd)
            loaded = engine.module_state_dict()
            got = one_step(engine, x)
            row = {
                "loaded_exact": all(torch.equal(loaded[k], sd[k].to(loaded[k].dtype)) for k in sd),
                "step_equal": all(torch.equal(got[k], expected[k]) for k in expected),
                "compared": len(expected),
                "fc1_after": got["fc1.weight"].float().mean().item(),
            }
            if not bf16:  # and plain torch, one Adam step on the same per-rank chunks
                ref = _copy(target)
                opt = torch.optim.Adam(ref.parameters(), lr=0.01)
                for rr in range(world()):
                    (ref(x[2 * rr : 2 * rr + 2]).pow(2).mean() / world()).backward()
                opt.step()
                row["torch_diff_steps"] = (
                    max((got[k].float() - v).abs().max().item() for k, v in ref.state_dict().items()) / 0.01
                )
            try:  # the plain torch call: works, or raises naming the engine method
                torch.manual_seed(0)
                plain = zerodp.initialize(Small(), cfg)
                plain.module.load_state_dict(sd)
                row["plain"] = "loaded"
                plain_got = one_step(plain, x)
                row["plain_step_equal"] = all(torch.equal(plain_got[k], expected[k]) for k in expected)
            except RuntimeError as e:
                row["plain"] = "raised" if "load_module_state_dict" in str(e) else f"other error: {e}"
            try:
                engine.load_module_state_dict({k: v for k, v in sd.items() if k != "fc2.bias"})
                row["strict_missing"] = "accepted"
            except RuntimeError as e:
                row["strict_missing"] = "raised" if "fc2.bias" in str(e) else str(e)
            out[key] = row
    return {"cases": out}


def _copy(m: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(m)


if __name__ == "__main__":
    run_selected(worker_args(), SCENARIOS)
