"""One mode of tools/gpu_offload_headline.py, run in its own process (``--child MODE``): cap the device
memory, build the GPT, train a few steps with zerodp, measure, write one JSON record.

The record: ``status`` (``trained``, ``oom`` with the ``phase`` it happened in, or ``error``), losses,
median step seconds and tokens/s over the steps after the first, peak ``torch.cuda.max_memory_allocated``
(None on the CPU), host VmRSS / VmHWM, the host's waits for the offload's copies per step
(``zerodp.offload.stream.CopyStream.host_wait`` timed), the same copies alone (each owned piece to its
host gradient buffer and back, synchronised), the hidden shares, and the NVMe swap statistics.
Ran on one H200 (docs/benchmarks/2026-12-04-first-gpu-run.md).
"""

from __future__ import annotations

import json
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import zerodp
from zerodp.app.model import GPT, GPTConfig
from zerodp.offload import stream

WAITS = {"seconds": 0.0}


def _timed(fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            WAITS["seconds"] += time.perf_counter() - t

    return wrapper


def engine_config(mode: str, spec: dict) -> dict:
    """zerodp's config for ``mode``: bf16, AdamW, clipping 1.0; stage 2 (none, cpu) or 3 (nvme)."""
    zc: dict[str, Any] = {"stage": 2}
    if mode == "cpu":
        zc["offload_optimizer"] = {"device": "cpu"}
    elif mode == "nvme":
        zc = {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": spec["nvme_path"]},
            "offload_optimizer": {"device": "nvme", "nvme_path": spec["nvme_path"]},
        }
    return {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_clipping": 1.0,
        "device": spec["device"],
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zc,
    }


def build(mode: str, cfg: GPTConfig, config: dict) -> torch.nn.Module:
    """The GPT in bf16 on the host (placed on the device by ``initialize``: 2 bytes per parameter);
    ``nvme``: under ``zerodp.zero.Init``, each shard going to the swap file as it is built."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        if mode == "nvme":
            with zerodp.zero.Init(config=config):
                return GPT(cfg)
        return GPT(cfg)
    finally:
        torch.set_default_dtype(previous)


def rss() -> dict[str, int]:
    """VmRSS and VmHWM of this process in bytes (empty where /proc cannot be read)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(engine: Any, spec: dict, device: torch.device, rec: dict) -> None:
    """``spec["steps"]`` steps on random tokens; the first untimed. Fills losses, step times, waits."""
    b, s = spec["micro_batch"], spec["model"]["seq_len"]
    times = []
    for step in range(spec["steps"]):
        idx = torch.randint(0, spec["model"]["vocab_size"], (b, s + 1), generator=torch.Generator().manual_seed(step))
        x, y = idx[:, :-1].to(device), idx[:, 1:].to(device)
        if step == 1:
            WAITS["seconds"] = 0.0
        sync(device)
        t = time.perf_counter()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t)
        rec["losses"].append(float(loss.item()))
    timed = times[1:]
    rec["step_s_median"] = statistics.median(timed)
    rec["tokens_per_s"] = b * s / rec["step_s_median"]
    rec["copy_wait_s_per_step"] = WAITS["seconds"] / len(timed)


def copies_alone(engine: Any, device: torch.device, rec: dict) -> float | None:
    """Seconds of the offload's per-step copies done alone and synchronised: each owned piece into its
    host gradient buffer and back (values unchanged), over the pieces whose storage is resident (with
    ``offload_param`` on NVMe only the persistent ones; ``copies_alone_pieces`` says how many); None
    when there is none (the NVMe offload in CPU training reads the gradients in place)."""
    off = engine.optimizer_offload
    pieces = getattr(off, "pieces", [])
    pairs = [
        (p.tensor, g)
        for p, g in zip(pieces, getattr(off, "grad_buffers", []), strict=False)
        if g.numel() == p.tensor.numel() > 0
        and p.tensor.untyped_storage().nbytes()
        >= (p.tensor.storage_offset() + p.tensor.numel()) * p.tensor.element_size()
    ]
    rec["copies_alone_pieces"] = f"{len(pairs)} of {len(pieces)}"
    if not pairs:
        return None
    sync(device)
    t = time.perf_counter()
    with torch.no_grad():
        for tensor, host in pairs:
            host.copy_(tensor)
        for tensor, host in pairs:
            tensor.copy_(host)
    sync(device)
    return time.perf_counter() - t


def is_oom(exc: BaseException | None) -> bool:
    """``exc`` or an exception it was raised from is CUDA's out-of-memory error (zerodp may wrap it)."""
    while exc is not None:
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "CUDA out of memory" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def measure(engine: Any, device: torch.device, rec: dict) -> None:
    """Peak device memory, host RSS, copies alone, hidden shares, swap statistics."""
    if device.type == "cuda":
        rec["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
        rec["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)  # what the cap limits
    rec.update({f"host_{k}_bytes": v for k, v in rss().items()})
    try:
        alone = copies_alone(engine, device, rec)
    except RuntimeError as exc:  # e.g. no room for a cast's temporary under the cap: the figure is missing
        alone, rec["copies_alone_error"] = None, f"{type(exc).__name__}: {exc}"[:300]
    rec["copies_alone_s"] = alone
    if alone:
        rec["copy_hidden_share"] = max(0.0, 1.0 - min(1.0, rec["copy_wait_s_per_step"] / alone))
    stats = getattr(engine.optimizer_offload, "stats", None)
    if stats is not None and getattr(stats, "io_busy_seconds", 0):
        waited = stats.read_wait_seconds + stats.write_wait_seconds
        rec["io_hidden_share"] = max(0.0, 1.0 - min(1.0, waited / stats.io_busy_seconds))
        rec["swap"] = {
            k: getattr(stats, k)
            for k in (
                "bytes_read",
                "bytes_written",
                "seconds",
                "update_seconds",
                "read_wait_seconds",
                "write_wait_seconds",
                "io_busy_seconds",
            )
        }


def run(mode: str, spec: dict) -> dict:
    device = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
    rec: dict[str, Any] = {"mode": mode, "status": "error", "phase": "setup", "losses": [], "peak_device_bytes": None}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        if spec["budget_bytes"] is None:  # a probe: uncapped, to measure what the model needs
            rec.update(total_device_bytes=total, memory_fraction=None)
        else:
            fraction = min(1.0, spec["budget_bytes"] / total)
            torch.cuda.set_per_process_memory_fraction(fraction, device)
            rec.update(total_device_bytes=total, memory_fraction=fraction)
    else:
        rec["memory_cap"] = "skipped: no CUDA (set_per_process_memory_fraction caps CUDA's allocator)"
    stream.CopyStream.host_wait = _timed(stream.CopyStream.host_wait)  # type: ignore[method-assign]
    zerodp.init_distributed()
    config = engine_config(mode, spec)
    engine = None
    try:
        rec["phase"] = "build"
        model = build(mode, GPTConfig(**spec["model"]), config)
        rec["phase"] = "initialize"
        engine = zerodp.initialize(model, config)
        rec["phase"] = "train"
        train(engine, spec, device, rec)
        rec["status"] = "trained"
        measure(engine, device, rec)
    except Exception as exc:  # recorded: the parent judges and goes on with the next mode
        if is_oom(exc):
            rec.update(status="oom", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            if device.type == "cuda":
                rec["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
                rec["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        else:
            rec.update(
                status="error", error=f"{type(exc).__name__}: {exc}"[:600], traceback=traceback.format_exc()[-2000:]
            )
    finally:
        if engine is not None:
            engine.close()
    return rec


def main(mode: str, spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    rec = run(mode, spec)
    Path(out_path).write_text(json.dumps(rec, indent=1))
    zerodp.shutdown_distributed()
    return 0
