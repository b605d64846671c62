"""``zero.Init(remote_device="cpu"|"nvme", pin_memory=...)`` (zerodp's and the DeepSpeed drop-in's): each
module's shard goes to host memory or the parameter swap file as it is built, so peak memory stays far
below the model's size (VmHWM, tests/init_remote_worker.py), the model trains as the plain engine does,
pinned host buffers are requested where CUDA is available (``torch.cuda.is_available`` patched), and bad
values are refused naming the allowed ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zerodp
import zerodp.deepspeed as deepspeed
from distributed import run_offload_worker

WORKER = Path(__file__).with_name("init_remote_worker.py")


def test_init_to_nvme_keeps_peak_rss_below_model():
    results, leftover = run_offload_worker(1, "3", "rss", WORKER, torchrun=True)  # RSS of a fresh interpreter
    out = results[0]["rss"]
    assert out.pop("ok"), out.get("error")
    assert out["in_file"] >= out["model_bytes"] and out["live"] == 0, out  # every shard is in the file
    assert out["plain_growth"] >= 0.9 * out["model_bytes"], out  # the measurement sees a full model
    assert out["init_growth"] < out["model_bytes"] / 3, out
    assert leftover == []


@pytest.mark.parametrize("world", [1, 2])
def test_init_remote_trains_as_plain_engine(world):
    results, leftover = run_offload_worker(world, "3", "train", WORKER)
    for r, res in enumerate(results):
        out = res["train"]
        assert out.pop("ok"), f"rank {r}:\n{out.get('error')}"
        assert len(set(out.pop("reference_losses"))) == 4  # it trains: every step's loss differs
        assert out == {
            "nvme": {"losses": True, "weights": True, "where": "nvme"},
            "nvme->none": {"losses": True, "weights": True, "where": "none"},
            "cpu": {"losses": True, "weights": True, "where": "cpu"},
        }, out
    assert leftover == []  # Init's swap file removed also where the engine read the shards back


def _cfg(tmp_path: Path, device: str = "none", **extra) -> dict:
    return {
        "device": "cpu",
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": device, "nvme_path": str(tmp_path), **extra},
        },
    }


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"remote_device": "disk"}, ValueError, "allowed values are None, 'none', 'cpu', 'nvme'"),
        ({"remote_device": "cuda"}, ValueError, "allowed values"),
        ({"remote_device": "cpu", "pin_memory": "yes"}, ValueError, "True, False or None"),
    ],
)
def test_bad_remote_device_refused(kwargs, error, match, tmp_path):
    with pytest.raises(error, match=match):
        zerodp.zero.Init(config=_cfg(tmp_path), **kwargs)
    with pytest.raises(error, match=match):
        deepspeed.zero.Init(config_dict_or_path=_cfg(tmp_path), **kwargs)


def test_remote_device_disagreeing_or_without_path_refused(tmp_path):
    with pytest.raises(zerodp.ConfigError, match="disagrees with the config's zero_optimization.offload_param"):
        zerodp.zero.Init(config=_cfg(tmp_path, "cpu"), remote_device="nvme")
    with pytest.raises(zerodp.ConfigError, match="needs zero_optimization.offload_param.nvme_path"):
        zerodp.zero.Init(config={"zero_optimization": {"stage": 3}}, remote_device="nvme")


def test_dropin_takes_remote_device_and_pin_memory(tmp_path):
    with deepspeed.zero.Init(config_dict_or_path=_cfg(tmp_path), remote_device="nvme", pin_memory=True) as init:
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    assert init.remote.device == "nvme" and init.remote.pin_memory
    assert len(init.swapper.shards) == 2 and sum(s.storage_bytes() for s in init.swapper.shards) == 0
    assert zerodp.zero.is_partitioned(model[0].weight) and model[0].weight.ds_numel == 64 * 64
    init.swapper.close()
    with deepspeed.zero.Init(remote_device="cpu", pin_memory=False) as init:  # no config: stage 3 implied
        model = nn.Sequential(nn.Linear(400, 300))
    assert init.remote.device == "cpu" and init.swapper is None and zerodp.zero.is_partitioned(model[0].weight)


def test_remote_cpu_on_a_device_engine_sends_shards_to_pinned_host_homes(tmp_path, monkeypatch):
    """The engine's device treated as an accelerator (``zerodp.runtime.device.is_accelerator``; the
    tensors stay on the CPU, streams are torch.cpu's no-ops): each shard is copied into a host home as
    it is built, page-locked (pin_memory unset: on a device) with CUDA patched in, and its own storage is
    freed; the shard comes back on use with its values."""
    zerodp.init_distributed()  # before CUDA is patched in (it would pick NCCL)
    monkeypatch.setattr("zerodp.runtime.device.is_accelerator", lambda d: True)
    pinned = _record_pinned(monkeypatch)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 4))
    torch.manual_seed(0)
    with zerodp.zero.Init(config=_cfg(tmp_path), remote_device="cpu") as init:
        model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 4))
    assert init.remote.pin_memory is True and init.host_shards is not None
    assert pinned == [32 * 16 + 16, 16 * 4 + 4], pinned  # the two host homes, nothing else pinned
    units = init.units
    assert [u.home.owner for u in units] == [init.host_shards] * 2
    assert all(u.shard.untyped_storage().nbytes() == 0 for u in units)  # only the host copy remains
    with units[0].resident() as shard:
        assert torch.equal(shard[: 32 * 16], reference[0].weight.detach().reshape(-1))
    assert units[0].shard.untyped_storage().nbytes() == 0
    assert init.host_shards.counters.to_device == 1 and init.host_shards.counters.to_host == 0
    assert zerodp.zero.is_partitioned(model[0].weight)


def _record_pinned(monkeypatch) -> list[int]:
    """Patch CUDA in (``is_available``) and ``torch.empty`` to record the sizes of page-locked requests
    (and allocate them unpinned: this machine has no CUDA to pin with)."""
    pinned: list[int] = []
    real_empty = torch.empty

    def empty(*size, pin_memory=False, **kw):
        if pin_memory:
            pinned.append(int(torch.Size(size[0] if len(size) == 1 and not isinstance(size[0], int) else size).numel()))
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", empty)
    return pinned


@pytest.mark.parametrize("pin", [True, False])
def test_pinned_host_shards_requested_with_cuda(pin, tmp_path, monkeypatch):
    pinned = _record_pinned(monkeypatch)
    with zerodp.zero.Init(config=_cfg(tmp_path), remote_device="cpu", pin_memory=pin):
        model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 4))
    shard_sizes = [32 * 16 + 16, 16 * 4 + 4]  # one unit per Linear, world size 1
    assert pinned == (shard_sizes if pin else []), pinned
    assert zerodp.zero.is_partitioned(model[1].weight)
    pinned.clear()
    with zerodp.zero.Init(config=_cfg(tmp_path, "nvme", buffer_size=4096), pin_memory=pin) as init:
        layer = nn.Linear(32, 16)
    # the shard itself goes to the file; the swap buffers it went through are page-locked
    assert (len(pinned) > 0) == pin and len(init.swapper.shards) == 1, pinned
    assert zerodp.zero.is_partitioned(layer.weight)
    init.swapper.close()
