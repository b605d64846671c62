"""Per-rank worker for tests/test_escaping_views.py (issue 26 item 3): tensors that view a stage-3
parameter's gathered storage and outlive its module's forward. Each scenario trains a small token model
whose ``pos`` submodule (a 6x8 table, persistence threshold 0: always partitioned) lets a view of its
table escape in one way, and compares with single-process plain PyTorch on the same global batch;
scenarios run at stages 0-3 and, at stage 3, also with ``offload_param`` (cpu). Launched by torchrun
through tests/distributed.py.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import dist_worker  # noqa: E402  (shared helpers and the main loop)
from dist_worker import compare_training, err, token_xent  # noqa: E402

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
        out = compare_training(stage, model_fn=lambda: TokenModel(how), kind="tokens", loss=token_xent,
                               forward=forward, zero=zero, steps=4)
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


if __name__ == "__main__":
    dist_worker.main()
