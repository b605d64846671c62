"""ZeRO-Offload (zerodp.offload): training with the optimizer partition in host memory or NVMe swap
files equals the non-offloaded engine bitwise (fp32, bf16, accumulation + clipping, fp16 overflow
skips, stages 1-3, world sizes 1-3), checkpoints cross between placements, swap files are removed,
and the error paths name what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import zerodp
from zerodp.offload.aio import AsyncIO, SwapFile, aligned_buffer
from zerodp.offload.config import AioConfig
from zerodp.offload.nvme import OffloadError

from distributed import run_worker

WORKER = Path(__file__).with_name("offload_worker.py")

# (world size, stages, scenarios): every scenario at every stage somewhere, each world size once.
PLAN = [
    (1, "1,2,3", "bf16,fp16_overflow"),
    (2, "1,2", "fp32,adam_no_overlap"),
    (3, "3", "fp32,accum_clip,bf16_accum"),
]


@pytest.mark.parametrize("world,stages,scenarios", PLAN)
def test_offload_equals_non_offloaded(world, stages, scenarios):
    with tempfile.TemporaryDirectory() as nvme, tempfile.TemporaryDirectory() as ckpt:
        results = run_worker(world, stages, scenarios, worker=WORKER, extra_args=["--nvme", nvme, "--ckpt", ckpt])
        leftover = os.listdir(nvme)
    compared = 0
    for r, res in enumerate(results):
        errors = res.pop("errors")
        assert errors["raised_on"] == [True], f"rank {r}: a deleted swap file was not reported: {errors}"
        assert "was deleted or replaced" in errors["message"] and "rank 0" in errors["message"]
        assert errors["unchanged"], "training state changed although the step was refused"
        for key, out in res.items():
            assert "error" not in out, f"rank {r} {key}:\n{out['error']}"
            assert out["equal"] == {"cpu": True, "nvme": True}, f"rank {r} {key}: {out['equal']}"
            nv = out["reports"]["nvme"]
            assert nv["subgroups"] >= 2 and nv["swap"][0] > 0 and nv["swap"][1] > 0, nv
            for device in ("cpu", "nvme"):
                rep = out["reports"][device]
                owned = rep["host"]["gradients"] / 4  # fp32 gradient buffer per owned element
                assert rep["formula"]["host"]["gradients"] * 0.5 <= rep["host"]["gradients"] \
                    <= rep["formula"]["host"]["gradients"] * 1.5 + 64
                if device == "cpu":
                    assert rep["host"]["master_weights"] == 4 * owned
                    assert rep["host"]["optimizer_states"] == 8 * owned
                else:  # nothing of the optimizer partition resident between steps
                    assert rep["memory"]["optimizer_states"] == 0 and rep["memory"]["master_weights"] == 0
                    assert rep["nvme"]["optimizer_states"] == 2 * rep["nvme"]["master_weights"] >= 4 * owned
            if key.endswith("fp16_overflow"):
                assert 0 < out["reports"]["cpu"]["skipped"] < out["steps"], out["reports"]["cpu"]
            if "ref_maxdiff" in out:
                assert out["ref_maxdiff"] < 1e-5
            if "ckpt" in out:
                assert out["ckpt"] == {"nvme->none": True, "none->nvme": True, "cpu->nvme": True}, out["ckpt"]
            compared += 1
    assert compared == world * len(stages.split(",")) * len(scenarios.split(","))
    assert leftover == []


def _engine(nvme: str, **offload) -> zerodp.Engine:
    torch.manual_seed(0)
    cfg = {"zero_optimization": {"stage": 1, "sub_group_size": 50,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": nvme, **offload}}}
    return zerodp.initialize(nn.Linear(8, 8), cfg)


def test_missing_and_unwritable_path(tmp_path):
    with pytest.raises(OffloadError, match=f"nvme_path '{tmp_path}/nope' does not exist"):
        _engine(str(tmp_path / "nope"))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root ignores permission bits: use a regular file as a non-directory
        (tmp_path / "file").write_text("x")
        with pytest.raises(OffloadError, match="is not a directory"):
            _engine(str(tmp_path / "file"))
    else:
        with pytest.raises(OffloadError, match="is not writable"):
            _engine(str(ro))


def test_full_disk_names_bytes(tmp_path, monkeypatch):
    import shutil as sh

    real = sh.disk_usage
    monkeypatch.setattr("zerodp.offload.nvme.shutil.disk_usage",
                        lambda p: real(p)._replace(free=1000))
    with pytest.raises(OffloadError) as err:
        _engine(str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path) in msg and "needs" in msg and "1,000 bytes are free" in msg
    assert list(tmp_path.iterdir()) == []


def test_swap_files_removed_on_close_and_on_exception(tmp_path):
    engine = _engine(str(tmp_path), fast_init=True)
    swap = engine.offload.file.path
    assert os.path.getsize(swap) > 0
    engine.close()
    assert list(tmp_path.iterdir()) == []
    script = (f"import torch, zerodp\nfrom torch import nn\n"
              f"e = zerodp.initialize(nn.Linear(8, 8), {{'zero_optimization': {{'stage': 1, "
              f"'offload_optimizer': {{'device': 'nvme', 'nvme_path': {str(tmp_path)!r}}}}}}})\n"
              f"e.backward(e(torch.ones(2, 8)).sum()); e.step()\n"
              f"assert len(list(__import__('pathlib').Path({str(tmp_path)!r}).rglob('*.swp'))) == 1\n"
              f"raise RuntimeError('boom')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "boom" in proc.stderr and proc.returncode != 0, proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_aio_round_trip(tmp_path):
    io = AsyncIO(AioConfig(block_size=8192, queue_depth=2, thread_count=3))
    f = SwapFile(str(tmp_path / "x.swp"))
    src = aligned_buffer(5 * 8192 + 4096)
    src.copy_(torch.randint(0, 255, (src.numel(),), dtype=torch.uint8))
    os.ftruncate(f.fd, src.numel() + 4096)
    io.write(f, src, 4096).wait()
    dst = aligned_buffer(src.numel())
    io.read(f, dst, 4096).wait()
    assert torch.equal(src, dst) and io.bytes_read == io.bytes_written == src.numel()
    with pytest.raises(ValueError, match="alignment"):
        io.read(f, dst, 100)
    f.close()
    io.close()


def test_offload_config_errors():
    with pytest.raises(zerodp.ConfigError, match="'zero_optimization.offload_param' .*needs zero_optimization.stage 3"):
        zerodp.load_config({"zero_optimization": {"offload_param": {"device": "cpu"}}})
    with pytest.raises(zerodp.ConfigError, match="device 'nvme' needs nvme_path"):
        zerodp.load_config({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})
    with pytest.raises(zerodp.ConfigError, match="'zero_optimization.offload_optimizer.ratio'"):
        zerodp.load_config({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
    with pytest.raises(zerodp.ConfigError, match="'aio.block_size'"):
        zerodp.load_config({"aio": {"block_size": 1000}})
    with pytest.raises(zerodp.ConfigError, match="'zero_optimization.offload_optimizer.device'"):
        zerodp.load_config({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})
    with pytest.raises(zerodp.ConfigError, match="stage 1, 2 or 3"):
        zerodp.initialize(nn.Linear(2, 2), {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    cfg = zerodp.load_config({"zero_optimization": {"sub_group_size": 1e9, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/x", "pin_memory": True, "buffer_count": 5, "fast_init": True}},
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True}})
    assert cfg.zero_optimization.sub_group_size == 10 ** 9 and cfg.zero_optimization.offload_optimizer.buffer_count == 5
