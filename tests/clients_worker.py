"""Patterns of public DeepSpeed clients (DeepSpeedExamples, DeepSpeed-Chat, transformers), written here
and run against ``zerodp.deepspeed`` on 2 gloo ranks (launched by tests/test_clients.py).

Each scenario writes what it saw into ``OUT/rank{r}.json``; the test asserts on it.
"""

from __future__ import annotations

import os
import random
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerodp.deepspeed as deepspeed  # was: import deepspeed
from zerodp.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # was: from deepspeed...
from distributed import run_selected, worker_args


def stage3_config(**extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}, **extra}


class Tower(nn.Module):
    """Several parameters of equal shapes, so a mis-paired gather would not fail on sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _all(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gathered_order() -> dict:
    """transformers' from_pretrained passes GatheredParameters a list built from a set (order differs per
    rank): each rank passes the parameters in its own order, duplicates included, rank 0 edits."""
    rank = dist.get_rank()
    cfg = stage3_config()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = Tower()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    statuses_outside = {n: p.ds_status.name for n, p in model.named_parameters()}
    order = list(range(len(params)))
    random.Random(rank + 1).shuffle(order)  # a different order on each rank
    mine = [params[i] for i in order] + [params[order[0]]]  # and a duplicate
    expected = {}
    with deepspeed.zero.GatheredParameters(mine, modifier_rank=0):
        inside = {n: p.ds_status.name for n, p in model.named_parameters()}
        with torch.no_grad():
            for i, (n, p) in enumerate(model.named_parameters()):
                expected[n] = p.detach().clone() * 0 + (i + 1 if rank == 0 else -100.0)
                p.copy_(expected[n])
    with deepspeed.zero.GatheredParameters(list(set(model.parameters()))):  # set order: differs per rank
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
    ok = all(torch.equal(after[n], expected[n] if rank == 0 else expected[n] * 0 + i + 1)
             for i, n in enumerate(names))
    # a rank passing other parameters is refused by name, not mis-paired
    refused = ""
    try:
        with deepspeed.zero.GatheredParameters(params[:2] if rank == 0 else params[2:4]):
            pass
    except ValueError as e:
        refused = str(e)
    sd = engine.state_dict()
    return {"ds_ids": [int(p.ds_id) for p in params], "all_ds_ids": _all([int(p.ds_id) for p in params]),
            "outside": statuses_outside, "inside": inside, "edits_ok": ok, "refused": refused,
            "state_dict_ok": all(torch.equal(sd[n], after[n]) for n in names)}


def save_dir_mismatch() -> dict:
    """HelloDeepSpeed names its run folder from each rank's own clock: the ranks pass different save_dirs."""
    rank = dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    model = nn.Linear(4, 2)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    base = tempfile.mkdtemp(prefix=f"zerodp-clients-r{rank}-")
    out = {}
    for key, kwargs in (("dir", {"save_dir": os.path.join(base, f"run-{rank}")}),
                        ("tag", {"save_dir": _all(base)[0], "tag": f"step{rank}"})):
        try:
            engine.save_checkpoint(**kwargs)
            out[key] = ""
        except Exception as e:  # CheckpointError
            out[key] = f"{type(e).__name__}: {e}"
    same = _all(base)[0]
    engine.save_checkpoint(same, tag="t")  # the same arguments still save
    out["same_ok"] = os.path.isdir(os.path.join(same, "t"))
    return out


SCENARIOS = {"gathered_order": gathered_order, "save_dir_mismatch": save_dir_mismatch}

if __name__ == "__main__":
    run_selected(worker_args(), SCENARIOS)
