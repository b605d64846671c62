"""Per-rank worker for tests/test_escaping_views.py (issue 26 items 3 and 4): tensors that view a
stage-3 parameter's gathered storage and outlive its module's forward, and ``module.state_dict()``
values used outside zerodp (safetensors, numpy, torch.save). Each scenario trains a small token model
whose ``pos`` submodule (a 6x8 table, persistence threshold 0: always partitioned) lets a view of its
table escape in one way, and compares with single-process plain PyTorch on the same global batch;
scenarios run at stages 0-3 and, at stage 3, also with ``offload_param`` (cpu). Launched by torchrun
through tests/distributed.py.
"""

from __future__ import annotations

import copy
import io
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import dist_worker  # noqa: E402  (shared helpers and the main loop)
import zerodp  # noqa: E402
from dist_worker import compare_training, err, rank, token_xent  # noqa: E402

SCENARIOS = dist_worker.SCENARIOS
SCENARIOS.clear()
scenario = dist_worker.scenario
ROWS = 4  # tokens per sequence (dist_worker.make_batch "tokens")


class Table(nn.Module):
    """``weights`` (6 x 8); ``forward(h)`` returns what ``how`` says, built from ``weights[:n]``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.weights = nn.Parameter(torch.randn(6, 8))

    def forward(self, h: torch.Tensor) -> Any:
        n = h.shape[1]
        if self.how == "returned":  # the reported case: a view of the parameter returned
            return self.weights[:n]
        if self.how == "returned_in_tuple":  # two views, in a structure
            return (self.weights[:n], {"t": self.weights[:n].t()})
        if self.how == "parameter":  # the parameter itself
            return self.weights
        if self.how == "saved":  # a view saved by autograd inside the module (mul saves both inputs)
            return h * self.weights[:n]
        if self.how == "stored":  # a view stored on the module, read after the forward
            self.cache = self.weights[:n]
            return h + self.cache
        if self.how == "closure":  # a view captured by a closure, called after the forward
            v = self.weights[1 : n + 1]
            self.read = lambda: v * 1.0
            return h + v
        raise ValueError(self.how)


class TokenModel(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(11, 8)
        self.pos = Table(how)
        self.head = nn.Linear(8, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        out = self.pos(h)
        if self.how in ("returned", "parameter"):
            h = h * out[: x.shape[1]]  # mul saves the (copied) view: read in backward
        elif self.how == "returned_in_tuple":
            h = h + out[0] * out[1]["t"].t()
        else:
            h = out
        return self.head(torch.tanh(h))


def escaped_values(m: Any) -> torch.Tensor:
    """What the escaped view holds after the forward (``m``: the engine or the plain model)."""
    pos = m.module.pos if hasattr(m, "module") else m.pos
    return pos.cache.detach().clone() if pos.how == "stored" else pos.read().detach()


def train(stage: int, how: str, offload: bool = False) -> dict:
    escaped_errs: list[float] = []
    # the escaped view after each forward, engine against plain PyTorch (same global batch per step:
    # the values compared are those of the parameter, identical on every rank)
    refs: dict[int, torch.Tensor] = {}

    def forward(m: Any, x: torch.Tensor, step: int) -> torch.Tensor:
        out = m(x)
        if how in ("stored", "closure"):
            if hasattr(m, "module"):
                escaped_errs.append(err(escaped_values(m), refs[step]))
            else:
                refs[step] = escaped_values(m)
        return out

    zero: dict = {"stage3_param_persistence_threshold": 0}
    if offload and stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compare_training(
            stage, model_fn=lambda: TokenModel(how), kind="tokens", loss=token_xent, forward=forward, zero=zero, steps=4
        )
    escape_warnings = [str(w.message) for w in caught if "outlived the release" in str(w.message)]
    out["escape_warnings"] = escape_warnings
    if escaped_errs:
        out["escaped_err"] = max(escaped_errs)
    return out


for _how in ("returned", "returned_in_tuple", "parameter", "saved", "stored", "closure"):
    for _offload in (False, True):

        def _run(stage: int, how: str = _how, offload: bool = _offload) -> dict:
            if offload and stage != 3:  # offload_param exists at stage 3 only
                return {"skipped": True}
            return train(stage, how, offload)

        _run.__name__ = f"{_how}{'_offload' if _offload else ''}"
        scenario(_run)


# ---- item 4: module.state_dict() at stage 3 ----------------------------------------------------------
#: what users do with a state dict outside zerodp; each must work (stages 0-2) or raise zerodp's error
STATE_DICT_USES = {
    "safetensors.save_file": lambda sd, v: __import__("safetensors.torch").torch.save_file(
        sd, os.path.join(tempfile.mkdtemp(), "m.safetensors")
    ),
    "torch.save": lambda sd, v: torch.save(sd, io.BytesIO()),
    "deepcopy": lambda sd, v: copy.deepcopy(sd),
    "numpy": lambda sd, v: (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy(),  # numpy has no bf16
    "data_ptr": lambda sd, v: v.data_ptr(),
    "untyped_storage": lambda sd, v: v.untyped_storage(),
    "storage": lambda sd, v: v.storage(),
    "dlpack": lambda sd, v: torch.from_dlpack(v),
    "tolist": lambda sd, v: v.tolist(),
    "cpu_clone": lambda sd, v: v.cpu().clone(),
    "to_bf16": lambda sd, v: v.to(torch.bfloat16),
}
#: the same with the parameters themselves (not their state-dict values): safetensors reads a tensor's
#: memory at data_ptr(), which a partitioned parameter answers (0 bytes) for zerodp's own use
PARAM_USES = {
    "safetensors.save_file(named_parameters)": lambda m: __import__("safetensors.torch").torch.save_file(
        dict(m.named_parameters()), os.path.join(tempfile.mkdtemp(), "p.safetensors")
    ),
    "safetensors.save_file(keep_vars)": lambda m: __import__("safetensors.torch").torch.save_file(
        m.state_dict(keep_vars=True), os.path.join(tempfile.mkdtemp(), "k.safetensors")
    ),
}
SAVE_WORDS = ("save_16bit_model", "GatheredParameters", "zerodp consolidate")


def state_dict_uses(stage: int, dtype: str, offload: bool) -> dict:
    """Every use in :data:`STATE_DICT_USES` of ``engine.module.state_dict()`` (and :data:`PARAM_USES` of
    the module's parameters): whether it raised zerodp's
    PartitionedParameterError naming the parameter and :data:`SAVE_WORDS`; then the documented way
    (GatheredParameters around state_dict, safetensors) saves the plain model's values."""
    from safetensors.torch import load_file, save_file

    from zerodp.stage3.sharded_param import PartitionedParameterError

    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    model = copy.deepcopy(ref)
    zc: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload and stage == 3:
        zc["offload_param"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": zc,
        **({"bf16": {"enabled": True}} if dtype == "bf16" else {}),
    }
    engine = zerodp.initialize(model, cfg)
    sd = engine.module.state_dict()
    out: dict = {"uses": {}}
    uses = [(name, lambda use=use: use(sd, sd["0.weight"])) for name, use in STATE_DICT_USES.items()]
    uses += [(name, lambda use=use: use(engine.module)) for name, use in PARAM_USES.items()]
    for name, use in uses:
        try:
            use()
            out["uses"][name] = "ok"
        except PartitionedParameterError as e:
            named = "'0.weight'" in str(e) and all(w in str(e) for w in SAVE_WORDS)
            out["uses"][name] = "refused, naming all" if named else f"refused without the names: {e}"
        except Exception as e:  # noqa: BLE001  (anything else is what the issue reported)
            out["uses"][name] = f"{type(e).__name__}: {e}"
    out["shapes_ok"] = all(
        sd[k].shape == v.shape and sd[k].dtype == engine.module.state_dict()[k].dtype
        for k, v in ref.state_dict().items()
    )
    want = {k: v.to(torch.bfloat16 if dtype == "bf16" else torch.float32) for k, v in ref.state_dict().items()}
    path = os.path.join(tempfile.mkdtemp(), f"rank{rank()}.safetensors")
    with zerodp.zero.GatheredParameters(list(engine.module.parameters())):
        save_file(engine.module.state_dict(), path)
    got = load_file(path)
    out["saved_err"] = (
        max(err(got[k].float(), want[k].float()) for k in want) if sorted(got) == sorted(want) else float("inf")
    )
    return out


for _dtype in ("fp32", "bf16"):
    for _offload in (False, True):

        def _uses(stage: int, dtype: str = _dtype, offload: bool = _offload) -> dict:
            if offload and stage != 3:
                return {"skipped": True}
            return state_dict_uses(stage, dtype, offload)

        _uses.__name__ = f"state_dict_{_dtype}{'_offload' if _offload else ''}"
        scenario(_uses)


if __name__ == "__main__":
    dist_worker.main()
