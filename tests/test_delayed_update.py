"""``offload_optimizer.delayed_update`` (zerodp.offload.delayed, ZeRO-Offload section 4.3): the engine
follows the one-step stale trajectory of a plain-PyTorch reference that applies each step's gradients
after the next step's backward (tests/delayed_update_worker.py), at stages 1-3 and world sizes 1-2, with
clipping, an LR scheduler, accumulation and an in-place edit; the trajectory differs from the undelayed
one; the config is refused where the delay is not implemented."""

from __future__ import annotations

from pathlib import Path

import pytest

import zerodp
from devices import skip_beyond_devices
from distributed import run_worker
from zerodp.config import load_config

WORKER = Path(__file__).with_name("delayed_update_worker.py")

PLAN = [(1, "1,2,3", "plain,clip_sched_accum"), (2, "1,2,3", "plain,clip_sched_accum,edit")]


@pytest.mark.parametrize("world,stages,scenarios", PLAN)
def test_delayed_update_follows_stale_reference(world, stages, scenarios):
    skip_beyond_devices(world)  # ZERODP_TEST_DEVICE (tests/devices.py): engine, batches and reference there
    results = run_worker(world, stages, scenarios, worker=WORKER)
    checked = 0
    for r, res in enumerate(results):
        for name, out in res.items():
            assert out.pop("ok"), f"rank {r} {name}:\n{out.get('error')}"
            expect_stages = {"1", "2"} if name == "edit" else {"1", "2", "3"}
            assert set(out) == expect_stages, out
            for stage, o in out.items():
                assert o["kind"] == "DelayedHostOffload" and o["launched"] == 6, (name, stage, o)
                assert o["stale"], (name, stage, o)  # equal to the delayed reference
                assert o["fresh_gap"] > 1e-3, (name, stage, o)  # and not to the undelayed one
                if name == "clip_sched_accum":
                    assert o["clipped"], o
                checked += 1
    assert checked == world * (8 if "edit" in scenarios else 6)  # 3 stages per scenario, edit at 1-2


def _zc(**oo) -> dict:
    return {"zero_optimization": {"stage": 2, "offload_optimizer": oo}}


@pytest.mark.parametrize(
    "cfg, match",
    [
        (_zc(device="none", delayed_update=True), "delayed_update needs offload_optimizer.device 'cpu'"),
        (_zc(device="nvme", nvme_path="/tmp", delayed_update=True), "got device 'nvme'"),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "cpu", "delayed_update": True},
                    "offload_param": {"device": "cpu"},
                }
            },
            "with offload_param .* not implemented",
        ),
        (_zc(device="cpu", delayed_update="yes"), "boolean"),
    ],
)
def test_delayed_update_refused_where_unsupported(cfg, match):
    with pytest.raises(zerodp.ConfigError, match=match):
        load_config(cfg)
