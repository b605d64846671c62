"""Worker for tests/test_config_agreement.py: rank 1 passes other settings to ``zerodp.initialize``
(``--case lr``: another learning rate, ``stage``: another ZeRO stage, ``nvme_path``: only a per-rank key
differs, ``same``: nothing differs); writes what initialize raised, per rank, to ``--out``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zerodp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", required=True)
    args = ap.parse_args()
    zerodp.init_distributed()
    rank = dist.get_rank()
    cfg: dict = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2}}
    if args.case == "lr" and rank == 1:
        cfg["optimizer"]["params"]["lr"] = 0.01
    if args.case == "stage" and rank == 1:
        cfg["zero_optimization"]["stage"] = 3
    if args.case == "nvme_path":
        cfg["zero_optimization"]["offload_param"] = {"device": "none", "nvme_path": f"/tmp/rank{rank}"}
    torch.manual_seed(0)
    try:
        zerodp.initialize(nn.Linear(4, 3), cfg)
        result = "ok"
    except zerodp.ConfigError as e:
        result = str(e)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    zerodp.shutdown_distributed()


if __name__ == "__main__":
    main()
