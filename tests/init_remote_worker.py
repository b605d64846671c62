"""Worker of tests/test_init_remote.py: ``zero.Init(remote_device=...)`` sends each module's shard to the
parameter swap file (or host memory) as it is built.

- ``rss`` (one rank): the resident-set high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs``) grows by less than a third of the model's bytes while the model is built
  under ``Init(remote_device="nvme")``, and by at least 90% of them when it is built plainly.
- ``train``: the model built under ``Init(remote_device=...)`` ("nvme" with the config's
  ``offload_param`` nvme, "nvme" with a config that does not offload parameters, "cpu") trains with
  the same losses and final weights (bitwise, fp32) as the plain stage-3 engine without offload.
"""

from __future__ import annotations

import ctypes
import gc

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from distributed import run_selected, worker_args

WIDTH, LAYERS, STEPS, MICRO = 1024, 24, 4, 2
NVME = ""
_libc = ctypes.CDLL("libc.so.6")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def reset_hwm() -> int:
    """Free what can be freed, reset the high-water mark to the current RSS; returns it."""
    gc.collect()
    _libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmHWM")


def model_fn(width: int = WIDTH, layers: int = LAYERS) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def config(offload: str, extra: dict | None = None) -> dict:
    zc: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload != "none":
        zc["offload_param"] = {"device": offload, "nvme_path": NVME, "buffer_count": 2, "buffer_size": 1 << 20}
    else:
        zc["offload_param"] = {"device": "none", "nvme_path": NVME}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": zc,
    }
    cfg.update(extra or {})
    return cfg


def rss() -> dict:
    numel = WIDTH * WIDTH * LAYERS + WIDTH * LAYERS
    model_bytes = 4 * numel
    cfg = config("nvme")
    torch.manual_seed(0)
    before = reset_hwm()
    with zerodp.zero.Init(config=cfg, remote_device="nvme") as init:
        model = model_fn()
    init_growth = _status("VmHWM") - before
    in_file = sum(s.nbytes for s in init.swapper.shards)
    live = sum(s.storage_bytes() for s in init.swapper.shards)
    init.swapper.close()
    del model, init
    torch.manual_seed(0)
    before = reset_hwm()
    plain = model_fn()
    plain_growth = _status("VmHWM") - before
    del plain
    return {
        "model_bytes": model_bytes,
        "init_growth": init_growth,
        "plain_growth": plain_growth,
        "in_file": in_file,
        "live": live,
    }


def _train(engine, width: int) -> list[float]:
    r, n = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(MICRO * n, width, generator=g)
        loss = engine(x[r * MICRO : (r + 1) * MICRO]).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train() -> dict:
    width, layers = 64, 4
    out = {}

    def run(cfg: dict, remote: str | None) -> tuple:
        torch.manual_seed(1234)
        if remote is None:
            model = model_fn(width, layers)
        else:
            with zerodp.zero.Init(config=cfg, remote_device=remote):
                model = model_fn(width, layers)
        engine = zerodp.initialize(model, cfg)
        po = engine.param_offload
        where = "none" if po is None else po.device
        losses = _train(engine, width)
        state = engine.module_state_dict()
        engine.close()
        return losses, state, where

    ref_losses, ref_state, _ = run(config("none"), None)
    for name, cfg, remote in [
        ("nvme", config("nvme"), "nvme"),
        ("nvme->none", config("none"), "nvme"),
        ("cpu", config("cpu"), "cpu"),
    ]:
        losses, state, where = run(cfg, remote)
        out[name] = {
            "losses": losses == ref_losses,
            "where": where,
            "weights": sorted(state) == sorted(ref_state)
            and all(torch.equal(state[k], ref_state[k]) for k in ref_state),
        }
    out["reference_losses"] = ref_losses
    return out


def main() -> None:
    global NVME
    args = worker_args("--nvme", "--ckpt")
    NVME = args.nvme
    run_selected(args, {"rss": rss, "train": train})


if __name__ == "__main__":
    main()
