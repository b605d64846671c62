"""Host and NVMe bytes per rank of an offloaded engine, measured beside the formula.

Measured: host bytes from the live storages of the masters, moments, gradient buffers and swap
buffers (``untyped_storage().nbytes()``, each storage counted once); NVMe bytes from the swap file's
segments. Formula (ZeRO-Offload section 4, paper convention, Psi / N_d owned elements per rank): fp32
master 4, Adam moments 8, fp32 gradient 4 bytes per element; NVMe moves master and moments (12).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zerodp.runtime.accounting import STAGE_NAMES, BytesPerElement, MemoryReport, human_bytes, model_state_bytes

if TYPE_CHECKING:  # annotation only: zerodp.config is not imported at run time here
    from zerodp.config import ZeroDPConfig


def offload_formula(
    device: str,
    numel_per_rank: float,
    buffer_bytes: int = 0,
    grad_numel: float | None = None,
    masters_in_file: bool = True,
    grad_read_bytes: int = 0,
) -> dict[str, dict[str, float]]:
    """Expected host / NVMe bytes for one rank with ``numel_per_rank`` = Psi / N_d owned elements:
    fp32 master 4, Adam moments 8 and fp32 gradient 4 bytes per element (ZeRO-Offload section 4);
    with NVMe, the master and moments (12 bytes) move to the swap file and host memory keeps the
    gradients and the swapper's buffer pool. ``grad_numel``: elements of the fp32 host gradient when
    it is not a full copy of the partition (NVMe with the gradients in host memory already: a scratch
    of the largest sub-group, see :mod:`zerodp.offload.nvme`); default ``numel_per_rank``.
    ``masters_in_file`` False: fp32 training on the CPU, where the module's tensors are the masters
    (the swap file holds the moments only). ``grad_read_bytes``: host buffers of the gradient swap
    file (:mod:`zerodp.offload.grad_swap`), counted with the gradients."""
    n = numel_per_rank
    g = n if grad_numel is None else grad_numel
    if device == "cpu":
        return {
            "host": {"master_weights": 4 * n, "optimizer_states": 8 * n, "gradients": 4 * n, "swap_buffers": 0},
            "nvme": {"master_weights": 0, "optimizer_states": 0},
        }
    return {
        "host": {
            "master_weights": 0,
            "optimizer_states": 0,
            "gradients": 4 * g + grad_read_bytes,
            "swap_buffers": buffer_bytes,
        },
        "nvme": {"master_weights": 4 * n if masters_in_file else 0, "optimizer_states": 8 * n},
    }


@dataclass(frozen=True)
class OffloadReport:
    """``host`` and ``nvme``: category -> bytes measured; ``formula``: the same keys, expected."""

    device: str
    rank: int
    owned_numel: int
    host: dict[str, int]
    nvme: dict[str, int]
    formula: dict[str, dict[str, float]]

    def format(self) -> str:
        lines = [
            f"rank {self.rank}  offload_optimizer.device = {self.device}  owned elements {self.owned_numel:,}",
            f"  {'where':<6}{'category':<18}{'measured':>14}{'formula':>14}",
        ]
        for where, measured in (("host", self.host), ("nvme", self.nvme)):
            for c, v in measured.items():
                lines.append(f"  {where:<6}{c:<18}{human_bytes(v):>14}{human_bytes(self.formula[where][c]):>14}")
        return "\n".join(lines)


def host_total(memory: MemoryReport, offload: OffloadReport | None, param_host: dict[str, int] | None = None) -> int:
    """Host bytes of this rank's model states, measured: ``engine.memory_report().total`` (parameters,
    gradients, optimizer states, masters and communication buffers in memory) plus what only the
    offload holds (``engine.offload_report()``: the NVMe swapper's buffers and the fp32 host
    gradients or gradient scratch) and, with ``param_host`` (``engine.param_offload.swapper.host_bytes()``,
    stage 3 ``offload_param``), the parameter swapper's buffer pool (its resident shards are counted
    by the memory report already). On a CPU-only machine this is the figure to set beside the
    process's resident set (tests/test_offload_rss.py matches them within 10 % while gradients are held,
    after a backward)."""
    total = memory.total + (param_host or {}).get("swap_buffers", 0)
    if offload is None:
        return total
    return total + offload.host["swap_buffers"] + offload.host["gradients"]


def offload_estimate_table(numel: int, world_size: int, b: BytesPerElement) -> str:
    """Per-rank device / host / NVMe bytes for stages 1-3 x offload none / cpu / nvme, as zerodp
    places them (paper convention; swap buffers and padding not counted). With offload the device
    keeps the module's parameters and its gradient partition (stage 1: full gradients); host memory
    takes the fp32 gradient copy and, for cpu, the fp32 masters and Adam moments; NVMe takes the
    masters and moments."""
    rows = [
        f"offload (Psi = {numel:,}, N_d = {world_size}, bytes/element: param {b.param}, grad {b.grad})",
        f"{'stage':<22}{'offload':<9}{'device':>14}{'host':>14}{'nvme':>14}",
    ]
    for stage in (1, 2, 3):
        f = model_state_bytes(stage, numel, world_size, b)
        owned = numel / world_size
        for device in ("none", "cpu", "nvme"):
            if device == "none":
                dev, host, nvme = sum(f.values()), 0.0, 0.0
            else:
                form = offload_formula(device, owned)
                dev = f["parameters"] + f["gradients"]
                host, nvme = sum(form["host"].values()), sum(form["nvme"].values())
            rows.append(
                f"{STAGE_NAMES[stage]:<22}{device:<9}{human_bytes(dev):>14}{human_bytes(host):>14}"
                f"{human_bytes(nvme):>14}"
            )
    return "\n".join(rows)


def offload_report(engine: Any) -> OffloadReport | None:
    """Host and NVMe bytes of ``engine``'s offloaded optimizer partition on this rank, beside
    :func:`offload_formula` (None without optimizer offload)."""
    offload = engine.optimizer_offload
    if offload.device == "none":
        return None
    owned = sum(p.hi - p.lo for g in engine.groups for p in g.pieces)
    host = offload.host_bytes(engine.optimizer)
    return OffloadReport(
        offload.device,
        engine.rank,
        owned,
        host,
        offload.nvme_bytes(),
        offload.formula(engine.numel / engine.world_size, host),
    )


def configured_offload_table(numel: int, world_size: int, cfg: ZeroDPConfig) -> str:
    """``zerodp estimate --config``: host and NVMe bytes per rank of the offload buffers as ``cfg``
    configures them on a CPU-only machine, sized by the engine's own code
    (:func:`zerodp.offload.sizing.estimate_offload_bytes`); no padding to 4096 bytes per segment."""
    import torch

    from zerodp.offload.sizing import estimate_offload_bytes
    from zerodp.runtime.precision import grad_accum_dtype

    zc = cfg.zero_optimization
    owned = -(-numel // world_size)
    low = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else torch.float32
    accum = grad_accum_dtype(low, cfg.gradient_accumulation_steps or 1, cfg.data_types.grad_accum_dtype)
    rows = [
        f"offload as configured (stage {zc.stage}, {str(accum).replace('torch.', '')} gradients, "
        f"{owned:,} owned elements per rank):"
    ]
    oo, op = zc.offload_optimizer, zc.offload_param
    if oo.device == "nvme":
        user = zc.sub_group_size if "sub_group_size" in zc.model_fields_set else None
        in_place = low == torch.float32 and not op.enabled
        spill = zc.stage >= 2 and not cfg.fp16.enabled  # zerodp.runtime.grad_spill
        e = estimate_offload_bytes(owned, user, oo.buffer_count, oo.host_buffer_bytes, in_place, accum.itemsize, spill)
        how = "set" if user else f"chosen from host_buffer_bytes {oo.host_buffer_bytes:,}"
        rows += [
            f"  offload_optimizer nvme: sub_group_size {e['sub_group_size']:,} ({how}), {e['buffer_count']} buffers",
            f"    host  sub-group buffers + gradient scratch  {human_bytes(e['host_buffers']):>12}",
            f"    host  gradient swap read buffers            {human_bytes(e['host_gradient_reads']):>12}",
            f"    nvme  {'Adam moments' if in_place else 'fp32 masters + Adam moments':<38}"
            f"{human_bytes(e['nvme_states']):>12}",
            f"    nvme  reduced gradient partition            {human_bytes(e['nvme_gradients']):>12}",
        ]
    elif oo.device == "cpu":
        rows.append(
            f"  offload_optimizer cpu: host fp32 masters, moments and gradients {human_bytes(16 * owned)} "
            "(on a CPU-only machine nothing moves: see zerodp.offload.build)"
        )
    if op.device == "nvme":
        shard = (low.itemsize if low != torch.float32 else 4) * owned
        rows += [
            f"  offload_param nvme: host pool {op.buffer_count} x {human_bytes(op.buffer_size)} + read-ahead "
            f"{human_bytes(op.max_in_cpu)} = {human_bytes(op.buffer_count * op.buffer_size + op.max_in_cpu)}, "
            f"nvme parameter shards {human_bytes(shard)}"
        ]
    if len(rows) == 1:
        rows.append("  no offload configured (zero_optimization.offload_optimizer / offload_param)")
    return "\n".join(rows)


__all__ = [
    "OffloadReport",
    "configured_offload_table",
    "host_total",
    "offload_formula",
    "offload_estimate_table",
    "offload_report",
]
