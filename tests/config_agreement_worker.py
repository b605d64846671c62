"""Worker for tests/test_config_agreement.py: rank 1 passes other settings to ``zerodp.initialize``, one
scenario per case (``lr``: another learning rate, ``stage``: another ZeRO stage, ``nvme_path``: only a
per-rank key differs, ``same``: nothing differs), all in one launch; records what initialize raised, per
rank (``"ok"`` when it did not)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from distributed import run_selected, worker_args


def initialize(case: str) -> dict:
    rank = dist.get_rank()
    cfg: dict = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2}}
    if case == "lr" and rank == 1:
        cfg["optimizer"]["params"]["lr"] = 0.01
    if case == "stage" and rank == 1:
        cfg["zero_optimization"]["stage"] = 3
    if case == "nvme_path":
        cfg["zero_optimization"]["offload_param"] = {"device": "none", "nvme_path": f"/tmp/rank{rank}"}
    torch.manual_seed(0)
    try:
        zerodp.initialize(nn.Linear(4, 3), cfg)
        return {"result": "ok"}
    except zerodp.ConfigError as e:
        return {"result": str(e)}


CASES = ("same", "lr", "stage", "nvme_path")
SCENARIOS = {case: (lambda c=case: initialize(c)) for case in CASES}

if __name__ == "__main__":
    run_selected(worker_args(), SCENARIOS)
