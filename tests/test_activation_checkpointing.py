"""zerodp.checkpointing: DeepSpeed-style activation checkpointing (ZeRO-R partitioned / CPU checkpoints)
under ZeRO stages 0-3 against the single-process model without checkpointing (tests/actckpt_worker.py),
plus single-process checks of RNG replay, the activation memory it saves, and the config section."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from actckpt_worker import kept_by_graph
from distributed import run_worker
from zerodp import checkpointing
from zerodp.config import ConfigError, load_config

WORKER = Path(__file__).with_name("actckpt_worker.py")
STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_worker(2, "0,1,2,3", "blocks,frozen,reuse,partition", worker=WORKER)


def check(results: list[dict], key: str) -> list[dict]:
    out = []
    for r, per_rank in enumerate(results):
        res = per_rank[key]
        assert res["ok"], f"rank {r}:\n{res.get('error')}"
        assert res["compared"] == 8
        assert res["max_err"] < 1e-5, f"rank {r} {key}: parameters differ from the reference by {res['max_err']}"
        out.append(res)
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_checkpointed_blocks_equal_reference(results: list[dict], stage: int) -> None:
    for res in check(results, f"blocks@{stage}"):
        assert len(res["kept"]) == 3 and not any(k["partitioned"] for k in res["kept"])  # no mpu: kept whole


@pytest.mark.parametrize("stage", STAGES)
def test_segment_fed_by_frozen_layer_still_trains(results: list[dict], stage: int) -> None:
    """The segment's input does not require grad (it comes from a frozen layer): its parameters must
    still get gradients (DeepSpeed PR 8130's case), and the frozen layer must not move."""
    for res in check(results, f"frozen@{stage}"):
        assert res["trained_names"] == [
            "blk.bias",
            "blk.weight",
            "blk2.bias",
            "blk2.weight",
            "head.bias",
            "head.weight",
        ]


@pytest.mark.parametrize("stage", STAGES)
def test_weight_reused_in_two_checkpointed_segments(results: list[dict], stage: int) -> None:
    check(results, f"reuse@{stage}")


@pytest.mark.parametrize("stage", STAGES)
def test_partitioned_cpu_checkpoints(results: list[dict], stage: int) -> None:
    """partition_activations + cpu_checkpointing over a 2-rank model-parallel group: each rank keeps
    half of every checkpointed input (measured on the live autograd graph), in CPU memory."""
    for res in check(results, f"partition@{stage}"):
        assert len(res["kept"]) == 3
        for k in res["kept"]:
            assert k["partitioned"] and k["device"] == "cpu"
            assert k["nbytes"] == 4 * ((k["numel"] + 1) // 2)


def saved_bytes(model: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd keeps for backward after ``model(x)``: tensors saved by
    ops (saved_tensors_hooks) plus the inputs kept by zerodp.checkpointing's nodes."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    for k in kept_by_graph(out):
        storages[k.data.untyped_storage().data_ptr()] = k.data.untyped_storage().nbytes()
    return sum(storages.values()), out


class Deep(nn.Module):
    def __init__(self, ckpt: bool, layers: int = 6, width: int = 256) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * width, width))
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + (checkpointing.checkpoint(b, x) if self.ckpt else b(x))
        return x


def test_checkpointing_keeps_less_and_replays_dropout() -> None:
    """Same gradients as without checkpointing (dropout masks replayed from the saved RNG state),
    with far fewer bytes kept for backward."""
    checkpointing.reset()
    torch.manual_seed(0)
    plain = Deep(ckpt=False)
    ckpt = Deep(ckpt=True)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(64, 256, requires_grad=True)
    torch.manual_seed(1)
    plain_bytes, out = saved_bytes(plain, x)
    out.square().mean().backward()
    torch.manual_seed(1)
    ckpt_bytes, out = saved_bytes(ckpt, x)
    out.square().mean().backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), n
    print(
        f"\nkept for backward: {plain_bytes / 2**20:.2f} MiB without checkpointing, "
        f"{ckpt_bytes / 2**20:.2f} MiB with (6 blocks, batch 64 x 256, fp32)"
    )
    assert ckpt_bytes * 8 < plain_bytes, (ckpt_bytes, plain_bytes)


def test_config_section_and_refusals() -> None:
    cfg = load_config(
        {
            "activation_checkpointing": {
                "partition_activations": True,
                "cpu_checkpointing": True,
                "number_checkpoints": 4,
                "profile": True,
            }
        }
    )
    checkpointing.configure(None, deepspeed_config=cfg)
    assert checkpointing.is_configured()
    x = torch.randn(3, 4, requires_grad=True)
    checkpointing.checkpoint(lambda t: t.tanh(), x).sum().backward()
    assert len(checkpointing.timings()["forward"]) == 1 and len(checkpointing.timings()["recompute"]) == 1
    checkpointing.reset()
    assert not checkpointing.is_configured()
    with pytest.raises(ConfigError, match="contiguous_memory_optimization is not implemented"):
        load_config({"activation_checkpointing": {"contiguous_memory_optimization": True}})
    with pytest.raises(NotImplementedError, match="contiguous_memory_optimization is not implemented"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    with pytest.raises(ConfigError, match="unknown key 'activation_checkpointing.partition'"):
        load_config({"activation_checkpointing": {"partition": True}})
