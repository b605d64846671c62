"""Per-rank worker for tests/test_tiling.py (launched by torchrun, see tests/distributed.py).

Scenarios (stage 3 only):
- ``train`` / ``train_offload``: a model of two TiledLinear layers (sizes not divisible by the splits)
  trains 3 Adam steps at stage 3 (optionally with ``offload_optimizer`` cpu), against the same model in
  plain PyTorch on the same global batch; also the peak gathered bytes (live storage) vs the layer.
- ``copy_under_engine``: ``copy_params_from`` on an engine-owned TiledLinear, each rank passing a
  different ``nn.Linear``: every rank must end with rank 0's weights.
- ``init_build``: a TiledLinear larger than ``stage3_max_live_parameters`` built under ``zero.Init``;
  the peak live heap during construction (glibc, see tests/heap_probe.py) vs the weight's bytes, and
  the same for a plain ``nn.Linear`` under the same probe; the values equal those built without Init.
- ``init_copy``: under Init, ``copy_params_from`` from a partitioned ``nn.Linear``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from distributed import run_selected, worker_args
from heap_probe import HeapPeak
from zerodp.zero import TiledLinear

ROWS = 6  # global batch rows (divisible by 1, 2, 3)
LR = 0.01


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = TiledLinear(23, 37, in_splits=3, out_splits=5)
        self.b = TiledLinear(37, 7, bias=False, in_splits=4, out_splits=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def config(max_live: int, offload: bool = False, nvme: str = "") -> dict:
    zero: dict = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": max_live,
        "stage3_prefetch_bucket_size": 0,
    }
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if nvme:  # every tile's shard in an NVMe swap file between uses
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2, "buffer_size": 4096}
    return {
        "train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(),
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "zero_optimization": zero,
    }


def _tile_bytes(m: TiledLinear) -> int:
    return max(sum(p.numel() for p in t.parameters()) for row in m.linears for t in row) * 4


def train(offload: bool = False, offload_param: bool = False) -> dict:
    torch.manual_seed(0)
    ref = Net()
    model = Net()
    model.load_state_dict(ref.state_dict())
    tile = max(_tile_bytes(ref.a), _tile_bytes(ref.b)) // 4
    nvme = ""
    if offload_param:
        import tempfile

        nvme = tempfile.mkdtemp(prefix=f"tiled-r{dist.get_rank()}-")
    engine = zerodp.initialize(model, config(max_live=tile, offload=offload, nvme=nvme))
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    r, n = dist.get_rank(), dist.get_world_size()
    per = ROWS // n
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(ROWS, 23, generator=g), torch.randn(ROWS, 7, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        # an input that needs grad: the tiles of the first layer are then released after their backward
        # (a first layer whose input needs no grad stays gathered until the end of backward, see docs)
        xs = x[r * per : (r + 1) * per].requires_grad_()
        loss = torch.nn.functional.mse_loss(engine(xs), y[r * per : (r + 1) * per])
        engine.backward(loss)
        engine.step()
    sd = engine.module_state_dict()
    diffs = {k: (sd[k] - v).abs().max().item() for k, v in ref.state_dict().items()}
    out = {
        "compared": len(diffs),
        "max_diff_steps": max(diffs.values()) / LR,
        "moved_steps": max((v - Net().state_dict()[k]).abs().max().item() for k, v in sd.items()) / LR,
        "peak_gathered_bytes": engine.memory_report().peak["gathered_parameters"],
        "largest_tile_bytes": max(_tile_bytes(ref.a), _tile_bytes(ref.b)),
        "layer_a_bytes": sum(p.numel() for p in ref.a.parameters()) * 4,
        "units": len(engine.sharding.units),
    }
    if nvme:
        import shutil

        engine.close()
        shutil.rmtree(nvme)
    return out


def copy_under_engine() -> dict:
    torch.manual_seed(0)
    engine = zerodp.initialize(Net(), config(max_live=10_000))
    torch.manual_seed(50 + dist.get_rank())  # a different source on each rank
    src = nn.Linear(23, 37)
    rank0 = src.weight.detach().clone()
    dist.broadcast(rank0, src=0)
    rank0_bias = src.bias.detach().clone()
    dist.broadcast(rank0_bias, src=0)
    engine.module.a.copy_params_from(src)
    sd = engine.module_state_dict()
    a = engine.module.a
    weight = torch.cat(
        [torch.cat([sd[f"a.linears.{o}.{i}.weight"] for i in range(a.in_splits)], dim=1) for o in range(a.out_splits)],
        dim=0,
    )
    bias = torch.cat([sd[f"a.linears.{o}.{a.in_splits - 1}.bias"] for o in range(a.out_splits)])
    return {
        "weight_equal_rank0": torch.equal(weight, rank0),
        "bias_equal_rank0": torch.equal(bias, rank0_bias),
        "own_differs": not torch.equal(src.weight.detach(), rank0) or dist.get_rank() == 0,
        "compared": weight.numel() + bias.numel(),
    }


IN, OUT, SPLIT_IN, SPLIT_OUT = 1024, 2048, 4, 8  # 8 MiB fp32 weight, 32 tiles of 256 KiB


def init_build() -> dict:
    cfg = config(max_live=100_000)  # 400 KB: far below the 8 MiB weight
    torch.manual_seed(3)
    with HeapPeak() as plain_probe:
        plain = TiledLinear(IN, OUT, in_splits=SPLIT_IN, out_splits=SPLIT_OUT)
    expected = {k: v.clone() for k, v in plain.state_dict().items()}
    del plain
    with HeapPeak() as linear_probe:  # the probe sees a whole weight when one is allocated
        lin = nn.Linear(IN, OUT)
    del lin
    torch.manual_seed(3)
    with zerodp.zero.Init(config=cfg):
        with HeapPeak() as init_probe:
            tiled = TiledLinear(IN, OUT, in_splits=SPLIT_IN, out_splits=SPLIT_OUT)
    # bytes of parameter storage alive now, each storage once (a partitioned parameter keeps its full
    # shape while its storage holds 0 bytes)
    held = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in tiled.parameters()}.values())
    engine = zerodp.initialize(tiled, cfg)
    got = engine.module_state_dict()
    shards = {u.shard.untyped_storage().data_ptr(): u.shard.untyped_storage().nbytes() for u in engine.sharding.units}
    tile_bytes = (IN // SPLIT_IN * OUT // SPLIT_OUT + OUT // SPLIT_OUT) * 4
    return {
        "weight_bytes": IN * OUT * 4,
        "tile_bytes": tile_bytes,
        "shard_bytes": sum(shards.values()),
        "init_peak": init_probe.peak,
        "plain_tiled_peak": plain_probe.peak,
        "linear_peak": linear_probe.peak,
        "samples": init_probe.samples,
        "held_after_init": held,
        "compared": len(expected),
        "equal": all(torch.equal(got[k], v) for k, v in expected.items()),
    }


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(23, 37)
        self.tiled = TiledLinear(23, 37, in_splits=2, out_splits=3)


def init_copy() -> dict:
    cfg = config(max_live=10_000)
    torch.manual_seed(4)
    with zerodp.zero.Init(config=cfg):
        pair = Pair()
        partitioned = zerodp.zero.is_partitioned(pair.lin.weight)
        pair.tiled.copy_params_from(pair.lin)
    engine = zerodp.initialize(pair, cfg)
    sd = engine.module_state_dict()
    t = pair.tiled
    weight = torch.cat(
        [
            torch.cat([sd[f"tiled.linears.{o}.{i}.weight"] for i in range(t.in_splits)], dim=1)
            for o in range(t.out_splits)
        ],
        dim=0,
    )
    bias = torch.cat([sd[f"tiled.linears.{o}.{t.in_splits - 1}.bias"] for o in range(t.out_splits)])
    return {
        "source_partitioned": partitioned,
        "weight_equal": torch.equal(weight, sd["lin.weight"]),
        "bias_equal": torch.equal(bias, sd["lin.bias"]),
        "compared": weight.numel(),
    }


SCENARIOS = {
    "train": train,
    "train_offload": lambda: train(offload=True),
    "train_offload_param": lambda: train(offload=True, offload_param=True),
    "copy_under_engine": copy_under_engine,
    "init_build": init_build,
    "init_copy": init_copy,
}


if __name__ == "__main__":
    run_selected(worker_args(), SCENARIOS)
