"""ZeRO-Offload (zerodp.offload): training with the optimizer partition in host memory or NVMe swap
files equals the non-offloaded engine bitwise (fp32, bf16, accumulation + clipping, fp16 overflow
skips, stages 1-3, world sizes 1-3; with ZERODP_TEST_DEVICE=cuda within a few epsilons of each
tensor's scale, the two steps running on different devices), checkpoints cross between placements,
swap files are removed, and the error paths name what is wrong."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import zerodp
from devices import device_type, skip_beyond_devices
from distributed import run_offload_worker
from swap_checks import assert_nvme_path_errors, assert_swap_removed_after_exception, full_disk_error
from zerodp.offload.aio import AsyncIO, SwapFile, aligned_buffer
from zerodp.offload.config import AioConfig

WORKER = Path(__file__).with_name("offload_worker.py")
#: the non-offloaded engine's Adam kernel in the offloaded step, for the tests that compare bitwise
#: (the default fused kernel is compared within 1e-6 relative in tests/test_cpu_adam.py)
SAME_ADAM = {"cpu_adam": "same"}
#: ZERODP_TEST_DEVICE=cuda (tests/devices.py): the non-offloaded engine steps on the GPU
ON_GPU = device_type() == "cuda"

# (world size, stages, scenarios): every scenario at every stage somewhere, each world size once.
PLAN = [
    (1, "1,2,3", "bf16,fp16_overflow,edit_bf16,fp16_accum_clip"),
    (2, "1,2", "fp32,adam_no_overlap,edit,edit_frozen"),
    (3, "3", "fp32,accum_clip,bf16_accum,edit_frozen"),
]


@pytest.mark.parametrize("world,stages,scenarios", PLAN)
def test_offload_equals_non_offloaded(world, stages, scenarios):
    skip_beyond_devices(world)  # ZERODP_TEST_DEVICE (tests/devices.py): engines and reference run there
    results, leftover = run_offload_worker(world, stages, scenarios, WORKER)
    compared = 0
    for r, res in enumerate(results):
        errors = res.pop("errors")
        assert errors["raised_on"] == [True], f"rank {r}: a deleted swap file was not reported: {errors}"
        assert "was deleted or replaced" in errors["message"] and "rank 0" in errors["message"]
        assert errors["unchanged"], "training state changed although the step was refused"
        for key, out in res.items():
            assert "error" not in out, f"rank {r} {key}:\n{out['error']}"
            low = "bf16" in key or "fp16" in key
            if ON_GPU:  # the non-offloaded step on the GPU, the offloaded one on the host: rounded differently
                limit = 2.0 if low else 8.0
                assert max(out["ulps"].values()) <= limit, f"rank {r} {key}: {out['ulps']} (limit {limit})"
            else:
                assert out["equal"] == {"cpu": True, "nvme": True}, f"rank {r} {key}: {out['equal']}"
                assert out["ulps"] == {"cpu": 0.0, "nvme": 0.0}, out["ulps"]
            nv = out["reports"]["nvme"]
            assert nv["subgroups"] >= 2 and nv["swap"][0] > 0 and nv["swap"][1] > 0, nv
            if ON_GPU:  # nothing of the optimizer partition resident between steps (the host layout
                # asserted below is the CPU engine's: there the module's fp32 tensors are the masters)
                assert nv["memory"]["optimizer_states"] == 0 and nv["memory"]["master_weights"] == 0, nv
            for device in () if ON_GPU else ("cpu", "nvme"):
                rep = out["reports"][device]
                owned = rep["owned"]
                assert (
                    rep["formula"]["host"]["gradients"] * 0.5
                    <= rep["host"]["gradients"]
                    <= rep["formula"]["host"]["gradients"] * 1.5 + 64
                )
                if device == "cpu":
                    assert rep["host"]["gradients"] == 4 * owned  # ZeRO-Offload's fp32 host gradient
                    assert rep["host"]["master_weights"] == 4 * owned
                    assert rep["host"]["optimizer_states"] == 8 * owned
                else:  # nothing of the optimizer partition resident between steps
                    assert rep["memory"]["optimizer_states"] == 0 and rep["memory"]["master_weights"] == 0
                    # fp32 on the CPU: the module's tensors are the masters, the file holds the moments
                    masters = rep["nvme"]["optimizer_states"] // 2 if low else 0
                    assert rep["nvme"]["master_weights"] == masters, rep["nvme"]
                    assert rep["nvme"]["optimizer_states"] >= 8 * owned
                    # CPU gradients are held once (the reducer's partition): no fp32 copy per piece;
                    # in bf16/fp16 a scratch of the largest sub-group (live storage; several sub-groups
                    # per rank), in fp32 nothing (the partition is fp32 already)
                    assert rep["max_grad_buffer"] == 0, rep
                    # stages 2-3 without fp16 loss scaling: the reduced gradients are in the gradient
                    # swap file (zerodp.offload.grad_swap); host memory keeps its two read buffers
                    spilled = key[0] in "23" and "fp16" not in key
                    assert ("gradients" in rep["nvme"]) == spilled, (key, rep["nvme"])
                    if spilled:
                        assert rep["nvme"]["gradients"] >= (2 if low else 4) * owned, rep["nvme"]
                        assert rep["memory"]["gradients"] == 0, rep["memory"]  # the reducer holds none
                        assert rep["host"]["gradients"] == rep["formula"]["host"]["gradients"], rep
                    else:
                        assert rep["host"]["gradients"] == rep["formula"]["host"]["gradients"] < 4 * owned, rep
                        assert (rep["host"]["gradients"] > 0) == low, rep
            if "clip" in key:  # clipping active: the deferred scale factors include coef < 1
                assert out["reports"]["nvme"]["norm"] > 0.05 and out["reports"]["cpu"]["skipped"] == 0, out
            if key.endswith("fp16_overflow"):
                assert 0 < out["reports"]["cpu"]["skipped"] < out["steps"], out["reports"]["cpu"]
            if "ref_maxdiff" in out:
                assert out["ref_maxdiff"] < 1e-5, (key, out["ref_maxdiff"])
            if key.endswith("/edit"):  # in-place edits between steps reach the offloaded masters too
                assert "ref_maxdiff" in out
            if key.endswith("/edit_frozen"):  # ... also of parameters without a gradient at that step:
                # the state dict, safe_get_full_fp32_param and a checkpoint right after it are the
                # non-offloaded engine's, bitwise
                assert "ref_maxdiff" in out
                if ON_GPU:
                    assert max(max(v.values()) for v in out["frozen_ulps"].values()) <= 8.0, out["frozen_ulps"]
                else:
                    assert out["frozen"] == {w: {"cpu": True, "nvme": True} for w in ("after", "accessor", "loaded")}, (
                        key,
                        out["frozen"],
                    )
            if "ckpt" in out and ON_GPU:  # across placements: steps on the GPU and on the host
                assert all(v <= 2.0 for k, v in out["ckpt"].items() if k.endswith("ulps")), out["ckpt"]
            if "ckpt" in out and not ON_GPU:  # bitwise across placements: one device's arithmetic
                assert out["ckpt"] == {
                    **{k: True for k in ("nvme->none", "none->nvme", "cpu->nvme")},
                    **{f"{k} ulps": 0.0 for k in ("nvme->none", "none->nvme", "cpu->nvme")},
                }, out["ckpt"]
            compared += 1
    assert compared == world * len(stages.split(",")) * len(scenarios.split(","))
    assert leftover == []


def _engine(nvme: str, **offload) -> zerodp.Engine:
    torch.manual_seed(0)
    cfg = {
        "zero_optimization": {
            "stage": 1,
            "sub_group_size": 50,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, **offload},
        }
    }
    return zerodp.initialize(nn.Linear(8, 8), cfg)


def test_missing_and_unwritable_path(tmp_path):
    assert_nvme_path_errors(_engine, tmp_path, "offload_optimizer.nvme_path")


def test_full_disk_names_bytes(tmp_path, monkeypatch):
    msg = full_disk_error(_engine, tmp_path, monkeypatch, "zerodp.offload.swap_job")
    assert "needs" in msg
    assert list(tmp_path.iterdir()) == []


def test_swap_files_removed_on_close_and_on_exception(tmp_path):
    engine = _engine(str(tmp_path), fast_init=True)
    swap = engine.optimizer_offload.file.path
    assert os.path.getsize(swap) > 0
    engine.close()
    assert list(tmp_path.iterdir()) == []
    assert_swap_removed_after_exception(
        {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}, tmp_path, "*.swp"
    )


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
    assert io.busy_seconds > 0  # the disk-busy clock of the swap report ran
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
    cfg = zerodp.load_config(
        {
            "zero_optimization": {
                "sub_group_size": 1e9,
                "offload_optimizer": {
                    "device": "nvme",
                    "nvme_path": "/x",
                    "pin_memory": True,
                    "buffer_count": 5,
                    "fast_init": True,
                },
            },
            "aio": {
                "block_size": 1048576,
                "queue_depth": 8,
                "thread_count": 1,
                "single_submit": False,
                "overlap_events": True,
            },
        }
    )
    assert cfg.zero_optimization.sub_group_size == 10**9 and cfg.zero_optimization.offload_optimizer.buffer_count == 5


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_gradients_stream_to_host_during_backward(device, tmp_path, monkeypatch):
    """Each bucket's reduced gradient is copied into the host partition as its reduction completes,
    before backward has produced the first layer's gradient; the step then copies nothing more for
    the gradients, and the result equals the non-offloaded engine bitwise."""
    monkeypatch.setattr("zerodp.offload.host.MIN_CHUNK_NUMEL", 8)  # several step chunks

    def build(offload):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
        zc = {"stage": 2, "reduce_bucket_size": 200, "overlap_comm": True}
        if offload:
            zc["offload_optimizer"] = {"device": device, "nvme_path": str(tmp_path), **SAME_ADAM}
            zc["sub_group_size"] = 300
        return zerodp.initialize(
            model, {"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": zc}
        )

    streamed_before_last_grad = []
    plain, off = build(False), build(True)
    real = off.optimizer_offload.stream_grad
    calls = []
    monkeypatch.setattr(
        off.optimizer_offload, "stream_grad", lambda piece, grad: (calls.append(piece), real(piece, grad))
    )
    off.module[0].weight.register_post_accumulate_grad_hook(lambda p: streamed_before_last_grad.append(len(calls)))
    x = torch.randn(5, 6)
    for _ in range(3):
        for e in (plain, off):
            e.backward(e(x).square().mean())
        n_pieces = len(off.optimizer_offload.pieces)
        assert len(calls) == n_pieces and off.optimizer_offload.copies.pending() <= n_pieces
        submitted = off.optimizer_offload.copies.copies
        for e in (plain, off):
            e.step()
        # parameters back
        assert off.optimizer_offload.copies.copies - submitted == (n_pieces if device == "cpu" else 0)
        calls.clear()
    assert len(off.reducer.groups[0].buckets) >= 3
    # buckets stream while backward is still running, from the first micro-step on (the calibration
    # step launches complete buckets too, see zerodp.runtime.grad_reducer)
    assert all(0 < n < n_pieces for n in streamed_before_last_grad), streamed_before_last_grad
    for a, b in zip(plain.module.parameters(), off.module.parameters(), strict=True):
        assert torch.equal(a, b)
    off.close()


@pytest.mark.parametrize("through", ["param", "data"])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_edit_of_parameter_without_gradient_reaches_offloaded_master(device, through, tmp_path):
    """``w.mul_(0.5)`` (or ``w.data.mul_(0.5)``, which moves no version counter) on a parameter that
    gets no gradient at the next steps is still folded into its offloaded master at the next step
    (NVMe: the masters of the sub-groups the step does not update are read, compared, written back),
    so the fp32 master (what module_state_dict and safe_get_full_fp32_param return under bf16) is the
    edited one, as without offload; the optimizer state accessor reads the swap file too; the swap
    report is produced."""
    from zerodp.accessors import safe_get_full_fp32_param, safe_get_full_optimizer_state

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head_a, self.head_b = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
            return getattr(self, head)(self.body(x))

    def build(offload):
        torch.manual_seed(0)
        zc = {"stage": 2, "reduce_bucket_size": 30}
        if offload:
            zc["offload_optimizer"] = {"device": device, "nvme_path": str(tmp_path), **SAME_ADAM}
            zc["sub_group_size"] = 20
        return zerodp.initialize(
            TwoHeads(),
            {"optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "bf16": {"enabled": True}, "zero_optimization": zc},
        )

    x = torch.randn(3, 4)
    engines = [build(False), build(True)]
    states = []
    for e in engines:
        for head in ("head_a", "head_b", "head_b"):
            e.backward(e(x.bfloat16(), head).float().square().mean())
            e.step()
            if head == "head_a":
                with torch.no_grad():  # head_a gets no gradient at the next steps
                    (e.module.head_a.weight if through == "param" else e.module.head_a.weight.data).mul_(0.5)
        states.append(e.module_state_dict())
    compared = 0
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k
        compared += 1
    assert compared == 6
    for a, b in zip(engines[0].module.parameters(), engines[1].module.parameters(), strict=True):
        assert torch.equal(safe_get_full_fp32_param(a), safe_get_full_fp32_param(b))
        assert torch.equal(safe_get_full_optimizer_state(a, "exp_avg"), safe_get_full_optimizer_state(b, "exp_avg"))
    if device == "nvme":
        from zerodp.app import bench_offload

        bench_offload.NVME_ENGINES[:] = [engines[1]]
        report = bench_offload.swap_report(str(tmp_path))
        bench_offload.NVME_ENGINES.clear()
        assert "swap / raw" in report and "blocked on reads" in report and "1 stream(s)" in report, report
    engines[1].close()


class ElsewhereTensor(torch.Tensor):
    """Stands for a tensor on an accelerator on a CPU-only machine: its data is in host memory, but
    ``device`` reports ``meta``, and a torch op that takes it together with a plain host tensor of one
    or more dimensions raises, as PyTorch does for tensors on two devices; ``copy_`` is allowed (it
    copies across devices). Wrap with ``torch.Tensor._make_subclass(ElsewhereTensor, t)`` (same storage)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:
            return torch.device("meta")
        if func is not torch.Tensor.copy_:
            leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(type(t) is cls for t in leaves) and any(type(t) is not cls and t.dim() > 0 for t in leaves):
                raise RuntimeError(
                    f"{getattr(func, '__name__', func)}: expected all tensors on the same device, "
                    "got a device tensor and a host tensor"
                )
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_edit_folding_with_parameters_on_another_device(device, tmp_path, monkeypatch):
    """Parameters on an accelerator, masters in host memory: folding in-place edits into the masters
    (cpu: ``fold_edits``; nvme: every sub-group, as after a skipped step) uses no op that needs both on
    one device, and folds exactly what it folds when both are in host memory (several host chunks per
    piece). The parameter pieces are :class:`ElsewhereTensor` views of the engine's buffers."""
    from zerodp.accessors import safe_get_full_fp32_param

    monkeypatch.setattr("zerodp.offload.edits.FOLD_CHUNK_NUMEL", 4)

    def build(elsewhere: bool) -> zerodp.Engine:
        torch.manual_seed(0)
        zc = {"stage": 2, "sub_group_size": 20, "offload_optimizer": {"device": device, "nvme_path": str(tmp_path)}}
        e = zerodp.initialize(
            nn.Linear(6, 5),
            {"optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "bf16": {"enabled": True}, "zero_optimization": zc},
        )
        e.backward(e(torch.ones(3, 6).bfloat16()).float().square().mean())
        e.step()
        with torch.no_grad():
            e.module.weight[1:3].mul_(0.5)
            e.module.bias[0] = 3.0
        originals = [p.tensor for p in e.optimizer_offload.pieces]
        if elsewhere:
            for p in e.optimizer_offload.pieces:
                p.tensor = torch.Tensor._make_subclass(ElsewhereTensor, p.tensor)
        e.optimizer_offload.fold_edits() if device == "cpu" else e.optimizer_offload.skipped_step()
        for p, t in zip(e.optimizer_offload.pieces, originals, strict=True):
            p.tensor = t
        return e

    plain, moved = build(False), build(True)
    for a, b in zip(plain.module.parameters(), moved.module.parameters(), strict=True):
        assert torch.equal(safe_get_full_fp32_param(a), safe_get_full_fp32_param(b))
    assert safe_get_full_fp32_param(moved.module.bias)[0] == 3.0  # the edit reached the master
    plain.close()
    moved.close()
