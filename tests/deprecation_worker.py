"""Worker for tests/test_deprecations.py: a stage-3 engine on this rank's test device (tests/devices.py)
trains two steps, gathers a parameter (``zerodp.zero.GatheredParameters``), saves and loads a
checkpoint and calls the DeepSpeed comm facade's all-gather and reduce-scatter, recording every
FutureWarning raised on the way (``--out/rank{r}.json``: {"future": [...], "probe": [...]}). ``probe``
holds what the same recorder caught from one call of torch's deprecated ``all_gather_into_tensor``:
the recorder works when that is not empty."""

import json
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zerodp
import zerodp.deepspeed.comm as ds_comm
from devices import engine_config, rank_device
from distributed import worker_args


def record(fn) -> list[str]:
    """The FutureWarnings ``fn()`` raises (each "file:line: message")."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        fn()
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, FutureWarning)]


def stage3_run() -> None:
    torch.manual_seed(0)
    device, world = rank_device(), dist.get_world_size()
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    engine = zerodp.initialize(
        model,
        {
            "train_micro_batch_size_per_gpu": 2,
            **engine_config(),
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        },
    )
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8, device=device)).square().mean())
        engine.step()
    with zerodp.zero.GatheredParameters([model[0].weight]):
        assert model[0].weight.numel() == 128
    with tempfile.TemporaryDirectory() as mine:
        shared = [mine]
        dist.broadcast_object_list(shared)  # rank 0's directory for every rank
        engine.save_checkpoint(shared[0], tag="t")
        engine.load_checkpoint(shared[0], tag="t")
        dist.barrier()
    out = torch.empty(world * 3, device=device)
    ds_comm.all_gather_into_tensor(out, torch.ones(3, device=device))
    ds_comm.reduce_scatter_tensor(torch.empty(3, device=device), out)


a = worker_args()
res = {
    "future": record(stage3_run),
    "probe": record(
        lambda: dist.all_gather_into_tensor(
            torch.empty(dist.get_world_size(), device=rank_device()), torch.ones(1, device=rank_device())
        )
    ),
}
Path(a.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(res))
dist.barrier()
zerodp.shutdown_distributed()
