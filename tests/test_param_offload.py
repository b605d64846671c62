"""ZeRO-Infinity parameter offload (``zero_optimization.offload_param``, zerodp.offload.param_swap):
stage 3 with shards in host memory or NVMe swap files equals stage 3 without offload bitwise (fp32) on
the stage-3 scenarios at world sizes 1-3, checkpoints cross between placements, reads run ahead of
the modules along the trace, ``zero.Init`` sends shards straight to the swap file, swapped-out shards
hold no memory, and the error paths name the path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import zerodp
from distributed import run_offload_worker
from swap_checks import assert_nvme_path_errors, assert_swap_removed_after_exception, full_disk_error
from zerodp.offload.nvme import OffloadError

WORKER = Path(__file__).with_name("param_offload_worker.py")

# (world size, scenarios): the stage-3 scenarios (tied weights, a module reused, an external parameter
# used directly and registered, a module skipped on some steps, frozen parameters), the optimizer
# offload combinations, edits under GatheredParameters and the fp32 accessors, checkpoints, read-ahead
# order and zero.Init, spread over world sizes 1-3.
PLAN = [
    (1, "reused,prefetch,init,overlap,beyond"),
    (2, "tied,external,edit,ckpt,mixed"),
    (3, "skipped,frozen,combos,init_equal"),
]
EQUALITY = {"tied", "reused", "external", "skipped", "frozen", "edit", "init_equal"}


@pytest.mark.parametrize("world,scenarios", PLAN)
def test_param_offload_equals_stage3(world, scenarios):
    results, leftover = run_offload_worker(world, "3", scenarios, WORKER)
    compared = 0
    for r, res in enumerate(results):
        for key, out in res.items():
            assert out.pop("ok"), f"rank {r} {key}:\n{out['error']}"
            if key in EQUALITY:
                assert out["equal"] == {"cpu": True, "nvme": True}, f"rank {r} {key}: {out}"
                assert out["compared"] >= 4
                nv = out["nvme"]
                assert nv["shards"] >= 2 and nv["live_shard_bytes"] == 0, nv  # really freed between uses
                # two 4096-byte buffers carry every shard read: each is reused many times per step
                assert nv["pool"] == 2 and nv["chunk_reads"] >= 4 * nv["pool"] * out["steps"], nv
                assert nv["reads_ahead"] > 0, nv
                if key == "init_equal":
                    assert nv["multi_chunk"], nv  # shards larger than one buffer are read in chunks
            elif key == "combos":
                assert out["equal"] == {"cpu": True, "nvme": True}, out
            elif key == "mixed":
                for prec, m in out.items():
                    assert m["equal"], (prec, m)
                    assert m["skipped"] == 0 and min(m["norms"]) > 0.05, m  # clipping active every step
                    # no fp32 copy per piece, a scratch of one sub-group; the reduced partition is in
                    # the gradient swap file (the reducer holds none), read through two buffers
                    assert m["grad_buffer_max"] == 0 and 0 < m["grad_host"] - m["grad_reads"] < 4 * m["owned"], m
                    # (fp16 keeps it in memory: the overflow check reads every gradient)
                    assert (m["grad_reads"] > 0 and m["reducer_grads"] == 0) == (prec == "bf16"), (prec, m)
                    # shards resident during the step: about two sub-groups', not all of them
                    # rank 1 holds each unit's weight tail and its bias: the bias is a sub-group of its own
                    assert m["subgroups"] >= 4 and m["spans"] == (r == 1), m
                    assert len(m["peaks"]) == 3 * m["subgroups"] and 0 < max(m["peaks"]) <= m["bound"] < m["total"], m
                    assert m["live_after"] == 0, m
            elif key == "overlap":
                assert out["equal"] == {"nvme": True, "overlap": True}, out
                # every step returned with sub-groups still to update (not all updated in step());
                # those its next use (a GatheredParameters read, an eval forward, the next forward,
                # the checkpoint read) needed were updated first, the losses show it
                # (the sub-groups of the always-gathered biases were updated inside step())
                for pending, in_step, total, _ in out["deferred"]:
                    assert pending and 0 < in_step < total and total >= 4, out["deferred"]
                # the eval forward after step 2 used every unit: the loop had ended by its end
                assert out["deferred"][2][3] is True, out["deferred"]
            elif key == "ckpt":
                assert out == {"nvme->none": True, "none->nvme": True, "continued": True, "live_shard_bytes": 0}, out
            elif key == "prefetch":
                # the read of module k+2 or later was submitted before module k's forward returned
                assert any(later - k >= 2 for k, later in out["ahead"]), out["events"]
            elif key == "beyond":
                # most shards of the forward were read ahead; only those the first fetch gathers at
                # once are read on demand (reads counted inside the gather window: 20 on demand, 4 ahead)
                assert out["demand"] < out["ahead"], out
            elif key == "init":
                assert out["init_shards"] == 6 and out["init_live_bytes"] == 0, out
                assert out["held_by_children"] == 0 and out["adopted"], out
                assert out["largest_shard"] > out["pool_bytes"], out  # a layer larger than the whole pool
            compared += 1
    assert compared == world * len(scenarios.split(","))
    assert leftover == []  # swap files and directories removed by engine.close()


def _engine(nvme: str, **offload) -> zerodp.Engine:
    torch.manual_seed(0)
    cfg = {
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 4,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 1, "buffer_size": 4096, **offload},
        }
    }
    return zerodp.initialize(nn.Sequential(nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 3)), cfg)


def _step(engine: zerodp.Engine) -> None:
    engine.backward(engine(torch.ones(2, 40)).square().mean())
    engine.step()


def test_missing_and_unwritable_path(tmp_path):
    assert_nvme_path_errors(_engine, tmp_path, "offload_param.nvme_path")


def test_full_disk_names_bytes(tmp_path, monkeypatch):
    assert "params.swp" in full_disk_error(_engine, tmp_path, monkeypatch, "zerodp.offload.param_swap")


def test_shards_freed_between_uses_and_deleted_swap_file(tmp_path):
    engine = _engine(str(tmp_path))
    units = [u for u in engine.sharding.units if not u.persistent]
    _step(engine)
    assert len(units) == 2
    assert all(u.shard.untyped_storage().nbytes() == 0 for u in units)  # live storage, not bookkeeping
    persistent = sum(u.shard.untyped_storage().nbytes() for u in engine.sharding.units if u.persistent)
    gathered = engine.sharding.held_bytes()["gathered"]  # the persistent unit's full buffer
    assert engine.memory_report().measured["parameters"] == persistent + gathered and persistent > 0
    with engine.shards_resident():
        assert all(u.shard.untyped_storage().nbytes() == u.shard.numel() * 4 for u in units)
    assert all(u.shard.untyped_storage().nbytes() == 0 for u in units)
    path = engine.param_offload.swapper.file.path
    os.remove(path)
    engine.backward(engine(torch.ones(2, 40)).square().mean())
    with pytest.raises(OffloadError, match=f"parameter swap file {path} was deleted"):
        engine.step()
    engine.close()
    assert list(tmp_path.iterdir()) == []


def test_swap_files_removed_on_exception(tmp_path):
    assert_swap_removed_after_exception(
        {
            "stage": 3,
            "stage3_param_persistence_threshold": 4,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        tmp_path,
        "params.swp",
    )


def test_offload_param_config():
    with pytest.raises(zerodp.ConfigError, match="'zero_optimization.offload_param' .*needs zero_optimization.stage 3"):
        zerodp.load_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/x"}}})
    with pytest.raises(zerodp.ConfigError, match="device 'nvme' needs nvme_path"):
        zerodp.load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    with pytest.raises(zerodp.ConfigError, match="'zero_optimization.offload_param.buffer_size'"):
        zerodp.load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_size": 1.5}}})
    cfg = zerodp.load_config(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_param": {
                    "device": "nvme",
                    "nvme_path": "/x",
                    "pin_memory": True,
                    "buffer_count": 5,
                    "buffer_size": 1e8,
                    "max_in_cpu": 1e9,
                },
            }
        }
    )
    po = cfg.zero_optimization.offload_param
    assert (po.buffer_size, po.max_in_cpu, po.buffer_count, po.prefetch_depth) == (10**8, 10**9, 5, 3)
    # overlap_step: a boolean, and only with the NVMe optimizer offload at stage 3 and offload_param
    # none or nvme (the message names both devices, the stage and why)
    nv = {"device": "nvme", "nvme_path": "/x"}
    with pytest.raises(zerodp.ConfigError, match="'zero_optimization.offload_optimizer.overlap_step'.*boolean"):
        zerodp.load_config({"zero_optimization": {"stage": 3, "offload_optimizer": {**nv, "overlap_step": "maybe"}}})
    for stage, opt, par, why in (
        (3, "cpu", "nvme", "only the NVMe offload's step is a sub-group loop"),
        (3, "cpu", "none", "updates the whole partition inside step"),
        (3, "nvme", "cpu", "host home has no use hook"),
        (2, "nvme", "none", "at stages 1-2 step.. all-gathers"),
        (1, "nvme", "none", "no per-use hook"),
    ):
        with pytest.raises(
            zerodp.ConfigError,
            match=f"overlap_step' needs .*got offload_optimizer '{opt}', offload_param '{par}' "
            f"at stage {stage}: .*{why}",
        ):
            zerodp.load_config(
                {
                    "zero_optimization": {
                        "stage": stage,
                        "offload_optimizer": {**(nv if opt == "nvme" else {"device": opt}), "overlap_step": True},
                        "offload_param": nv if par == "nvme" else {"device": par},
                    }
                }
            )
    for par in ("nvme", "none"):
        ok = zerodp.load_config(
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {**nv, "overlap_step": True},
                    "offload_param": nv if par == "nvme" else {"device": par},
                }
            }
        )
        assert ok.zero_optimization.offload_optimizer.overlap_step is True


@pytest.mark.parametrize("param_device", ["nvme", "none"])
def test_overlap_step_dropin_zero_grad_after_step(tmp_path, param_device):
    """DeepSpeed's loop (HF Trainer's too) calls ``engine.zero_grad()`` right after ``engine.step()``.
    With ``overlap_step`` most sub-groups are updated during the next forward from the reduced
    gradients, which ``zero_grad`` must not clear before then: the run equals overlap off bitwise
    (parameters on NVMe, or not offloaded)."""
    import zerodp.deepspeed as ds

    runs, pending = {}, []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 20,
                "sub_group_size": 60,
                "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2, "buffer_size": 4096}
                if param_device == "nvme"
                else {"device": "none"},
                "offload_optimizer": {
                    "device": "nvme",
                    "nvme_path": str(tmp_path),
                    "cpu_adam": "same",
                    "overlap_step": overlap,
                },
            },
        }
        engine, _, _, _ = ds.initialize(model=model, config=cfg)
        losses = []
        for step in range(3):
            loss = engine(torch.randn(2, 16, generator=torch.Generator().manual_seed(step))).square().mean()
            engine.backward(loss)
            engine.step()
            pending.append(overlap and engine.engine.optimizer_offload.pending is not None)
            engine.zero_grad()
            losses.append(loss.item())
        runs[overlap] = (losses, engine.engine.module_state_dict())
        engine.engine.close()
    assert any(pending)  # the overlapped steps did return with sub-groups left to update
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].keys() == runs[False][1].keys()
    assert all(torch.equal(runs[True][1][k], runs[False][1][k]) for k in runs[False][1])
    assert list(tmp_path.iterdir()) == []


def test_load_module_state_dict_with_nvme_optimizer_offload(tmp_path):
    """``engine.load_module_state_dict`` with the masters in the NVMe swap file (placeholders between
    steps) reaches them, also right after an ``overlap_step`` step: training goes on bitwise as plain
    stage 3 without optimizer offload (it raised a size mismatch on the empty placeholder)."""
    runs = {}
    for opt in ("none", "nvme"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        zc = {
            "stage": 3,
            "stage3_param_persistence_threshold": 20,
            "sub_group_size": 60,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2, "buffer_size": 4096},
        }
        if opt == "nvme":
            zc["offload_optimizer"] = {
                "device": "nvme",
                "nvme_path": str(tmp_path),
                "cpu_adam": "same",
                "overlap_step": True,
            }
        engine = zerodp.initialize(
            model,
            {
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": zc,
                "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
            },
        )
        losses, first = [], None
        for step in range(3):
            loss = engine(torch.randn(2, 16, generator=torch.Generator().manual_seed(step))).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if step == 0:
                first = engine.module_state_dict()
            if step == 1:
                error = None  # caught and kept as text: pytest's traceback would print swapped-out shards
                try:
                    engine.load_module_state_dict({k: v * 0.5 for k, v in first.items()})
                except RuntimeError as exc:
                    error = str(exc)
                assert error is None, error
        runs[opt] = (losses, engine.module_state_dict())
        engine.close()
    assert runs["nvme"][0] == runs["none"][0]
    assert all(torch.equal(runs["nvme"][1][k], runs["none"][1][k]) for k in runs["none"][1])
    assert list(tmp_path.iterdir()) == []
