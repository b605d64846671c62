"""Per-rank worker for tests/test_grad_accumulation.py (issue 26, items 1 and 6), launched by torchrun
through tests/distributed.py at world sizes 1 and 3. Every scenario runs at every requested stage; the
expected values are computed here from plain PyTorch on one process.

- ``recipe_bf16`` / ``recipe_fp16``: deepspeedai/DeepSpeed#1800's smallest input. ``Linear(4, 1,
  bias=False)`` in bf16 (fp16), loss ``out.sum()``, ``gradient_accumulation_steps`` 8, SGD lr 1,
  micro-step inputs 1.0 then seven of 2^-9 (fp16: 2^-12, a quarter of its rounding step at the sum;
  loss scale 2^8).
  Micro-step t's rows are on rank t % N, scaled by N (every other rank holds zeros), so the global
  mean per micro-step is the issue's input and each rank's share is exact in 16 bits at any N. The
  reference: each rank's 16-bit micro-gradient from plain torch, averaged and accumulated in fp32
  (what a user of torch with fp32 gradient accumulation gets), then SGD on the fp32 master.
  Variants: ``data_types.grad_accum_dtype`` unset / "fp32" / the 16-bit dtype, without offload and
  with ``offload_optimizer`` cpu and nvme (stages 1-3) and ``offload_param`` cpu (stage 3).
- ``token_weighted``: a tiny LM whose loss is normalised by the token count of the whole accumulation
  window across ranks, passed to ``backward(loss, scale_wrt_gas=False)`` of the DeepSpeed-API engine,
  against one plain-PyTorch backward over the whole window (fp32, SGD with momentum); with and without
  cpu optimizer offload. Also: ``backward(loss / gas, scale_wrt_gas=False)`` equals
  ``backward(loss)`` bitwise in bf16.

Engines, inputs and references run on the test device (``ZERODP_TEST_DEVICE``, tests/devices.py).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import zerodp  # noqa: E402
from devices import engine_config, rank_device  # noqa: E402
from dist_worker import err  # noqa: E402
from distributed import run_scenarios, worker_args  # noqa: E402
from zerodp import deepspeed  # noqa: E402

GAS = 8
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: a micro-step input lost when added in 16 bits to the first one (a quarter rounding step of 1/8)
SMALL = {"bf16": 2.0**-9, "fp16": 2.0**-12}


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def recipe_rows(t: int, r: int, n: int, precision: str) -> torch.Tensor:
    """Rank ``r``'s (1, 4) input at micro-step ``t`` of ``n`` ranks (see the module docstring)."""
    value = (1.0 if t == 0 else SMALL[precision]) * n if t % n == r else 0.0
    return torch.full((1, 4), value, dtype=LOW[precision], device=rank_device())


def recipe_reference(w0: torch.Tensor, precision: str, scale: float, accumulate: torch.dtype) -> torch.Tensor:
    """Plain torch, one process: the fp32 master after one SGD (lr 1) step of the recipe, with the
    16-bit micro-gradients (loss multiplied by ``scale``, the fp16 loss scale) averaged over ranks
    and accumulated in ``accumulate``."""
    model = nn.Linear(4, 1, bias=False).to(w0.device, LOW[precision])
    with torch.no_grad():
        model.weight.copy_(w0)
    acc = torch.zeros_like(w0, dtype=accumulate)
    for t in range(GAS):
        micro = torch.zeros_like(w0, dtype=torch.float32)
        for r in range(world()):
            model.weight.grad = None
            (model(recipe_rows(t, r, world(), precision)).sum() / GAS * scale).backward()
            micro += model.weight.grad.float()
        acc += (micro / world()).to(accumulate)
    return w0.float() - acc.float() / scale


def recipe_variants(stage: int) -> list[tuple[str, str | None, dict]]:
    """(name, data_types.grad_accum_dtype, zero_optimization extras) to run at ``stage``."""
    out: list[tuple[str, str | None, dict]] = [("default", None, {}), ("fp32", "fp32", {}), ("low", "low", {})]
    if stage >= 1:
        out += [
            ("cpu", None, {"offload_optimizer": {"device": "cpu"}}),
            ("cpu_low", "low", {"offload_optimizer": {"device": "cpu"}}),
            ("nvme", None, {"offload_optimizer": {"device": "nvme", "nvme_path": "NVME"}}),
        ]
    if stage == 3:
        out.append(("param_cpu", None, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}))
    return out


def recipe(stage: int, precision: str) -> dict:
    out: dict[str, Any] = {}
    for name, accum, zero in recipe_variants(stage):
        nvme = tempfile.mkdtemp(prefix=f"accum_nvme_r{rank()}_")
        if "offload_optimizer" in zero and zero["offload_optimizer"]["device"] == "nvme":
            zero = {**zero, "offload_optimizer": {**zero["offload_optimizer"], "nvme_path": nvme}}
        cfg: dict = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": GAS,
            # fp16: a loss scale of 2^8 (2^16 would overflow the 16-bit loss's own gradient)
            precision: {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})},
            "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
            "zero_optimization": {"stage": stage, **zero},
            **engine_config(),
        }
        if accum is not None:
            cfg["data_types"] = {"grad_accum_dtype": precision if accum == "low" else accum}
        torch.manual_seed(3)
        model = nn.Linear(4, 1, bias=False)
        w0 = model.weight.detach().to(rank_device(), LOW[precision]).clone()
        engine = zerodp.initialize(model, cfg)
        scale = engine.loss_scale
        for t in range(GAS):
            engine.backward(engine(recipe_rows(t, rank(), world(), precision)).sum())
            engine.step()
        moved = engine.module_state_dict()["weight"].to(w0.device)
        mem = engine.memory_report()
        ref32 = recipe_reference(w0, precision, scale, torch.float32)
        ref_low = recipe_reference(w0, precision, scale, LOW[precision])
        out[name] = {
            "equal_fp32_ref": bool(torch.equal(moved, ref32)),
            "equal_low_ref": bool(torch.equal(moved, ref_low)),
            "refs_differ": not bool(torch.equal(ref32, ref_low)),
            "moved": (w0.float() - moved)[0].tolist(),
            "ref_moved": (w0.float() - ref32)[0].tolist(),
            "grad_measured": mem.measured["gradients"],
            "grad_formula": mem.formula["gradients"],
            "numel": mem.numel,
            "steps": engine.global_steps - engine.skipped_steps,
        }
        engine.close()
        shutil.rmtree(nvme, ignore_errors=True)
    return out


def recipe_bf16(stage: int) -> dict:
    return recipe(stage, "bf16")


def recipe_fp16(stage: int) -> dict:
    return recipe(stage, "fp16")


# ---- item 6: backward(loss, scale_wrt_gas=False) with a token-weighted loss --------------------------
VOCAB, DIM, SEQ, MICRO, TOKEN_GAS, STEPS = 11, 6, 5, 2, 3, 2


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(idx)))


def token_batch(step: int, micro: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``r``'s micro-batch ``micro`` of optimizer step ``step``: tokens, targets and a 0/1 mask
    whose count varies by rank and micro-step (padding)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + r)
    idx = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    mask = (torch.rand(MICRO, SEQ, generator=g) < 0.3 + 0.2 * ((micro + r) % 3)).float()
    mask[0, 0] = 1.0  # every micro-batch has a token
    dev = rank_device()
    return idx.to(dev), tgt.to(dev), mask.to(dev)


def token_losses(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    per_token = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(), reduction="none")
    return (per_token * mask.flatten()).sum()


def token_weighted(stage: int) -> dict:
    out: dict[str, Any] = {}
    for name, zero in (("none", {}), ("cpu", {"offload_optimizer": {"device": "cpu"}})):
        if stage == 0 and zero:
            continue
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": TOKEN_GAS,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 4, **zero},
            **engine_config(),
        }
        torch.manual_seed(7)
        ref = TinyLM().to(rank_device())
        torch.manual_seed(7)
        model = TinyLM()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
        for step in range(STEPS):
            window = [token_batch(step, m, r) for m in range(TOKEN_GAS) for r in range(world())]
            total = sum(mask.sum() for _, _, mask in window)  # tokens of the window on every rank
            ref_opt.zero_grad()
            (sum(token_losses(ref, *b) for b in window) / total).backward()
            ref_opt.step()
            for m in range(TOKEN_GAS):
                # each rank's share, times N: the engine averages over ranks
                loss = token_losses(engine, *token_batch(step, m, rank())) / total * world()
                engine.backward(loss, scale_wrt_gas=False)
                engine.step()
        full = engine.module_state_dict()
        out[name] = {
            "param_err": max(err(full[k], v) for k, v in ref.state_dict().items()),
            "steps": engine.global_steps,
        }
        engine.close()
    out["bf16_scaled_by_hand_equal"] = scaled_by_hand_equal(stage)
    return out


def scaled_by_hand_equal(stage: int) -> bool:
    """bf16: ``backward(loss / gas, scale_wrt_gas=False)`` trains bitwise like ``backward(loss)``."""
    results = []
    for by_hand in (False, True):
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": TOKEN_GAS,
            "bf16": {"enabled": True},
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 4},
            **engine_config(),
        }
        torch.manual_seed(7)
        model = TinyLM()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        for m in range(TOKEN_GAS):
            loss = token_losses(engine, *token_batch(0, m, rank()))
            if by_hand:
                engine.backward(loss / TOKEN_GAS, scale_wrt_gas=False)
            else:
                engine.backward(loss)
            engine.step()
        results.append(engine.module_state_dict())
    return all(torch.equal(v, results[1][k]) for k, v in results[0].items())


SCENARIOS = {"recipe_bf16": recipe_bf16, "recipe_fp16": recipe_fp16, "token_weighted": token_weighted}

if __name__ == "__main__":
    args = worker_args()
    names = list(SCENARIOS) if args.scenarios == "all" else args.scenarios.split(",")
    stages = [int(s) for s in args.stages.split(",")]
    run_scenarios(args.out, [(f"{n}/stage{s}", lambda n=n, s=s: SCENARIOS[n](s)) for s in stages for n in names])
