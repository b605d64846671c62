"""The RAM rows of ``zerodp train --preset infinity``'s plan (:func:`ram_accounting`): host bytes per
rank at the run's peak, each row bounded by a layer, a sub-group, a configured pool or the activations,
none by the parameter count.

Every row names a holder that :file:`tools/infinity_rss_probe.py` measures from live storages (the
engine's buffers, pools and shards, and ``mallinfo2`` / ``VmRSS`` for the rest). On the 3.8B run's knobs
(GPT of width 2816, ``sub_group_size`` 12.5M, ``max_in_cpu`` 1 GB), 12 of its 40 layers, one rank, the
peak (4.5 GB) was in backward; by holder (MB): optimizer sub-group buffers 1,197, parameter swap pool
301 and shards read ahead or kept 872-1,000, gather pool lent and free 780, shards pinned by gathers in
flight 333-381, the reducer's partitions 127 and the gradient swap's read buffers, scratch and writes
in flight 163, saved activations 140, autograd's weight-gradient temporaries of one unit 224, the rest
(interpreter, Python heap, libraries) 370 (docs/benchmarks/2026-12-02-infinity-2.4x.md).

Rows (per rank, summed over ranks): the runtime; the optimizer's sub-group buffers; the parameter swap
pool and read-ahead budget (``max_in_cpu``: shards read ahead, or kept after the step's update for the
next forward); the gradient swap (a read buffer of a sub-group per optimizer buffer, and the reduced partitions of at
most :data:`MAX_BUCKETS_IN_FLIGHT` reduce-scatters in flight plus :data:`MAX_WRITES_IN_FLIGHT` writes,
each at most the largest coalesced group of units, 1/N of it per rank); then the largest of the phases
that do not overlap:

- backward: the gather pool (the live window ``stage3_max_live_parameters``, the running unit, gradient
  staging of the group being filled and those in flight, all-to-all receive buffers with N > 1: the
  engine's own limit, :func:`zerodp.stage3.sharding._pool_limit`), the shards pinned by the gathers in
  flight (the window's, 1/N per rank), the saved activations, and autograd's temporaries of one unit's
  weight gradient (bf16 on the CPU: the product in fp32 and bf16 copies, :data:`WEIGHT_GRAD_BYTES`);
- forward: the gathered window, the pinned shards, the activations; with ``overlap_step`` the step's
  sub-group loop (fp32 gradient scratch, resident shards of two sub-groups, Adam's temporaries) runs
  during it;
- step: nothing of its own (the gradient norm is taken as the boundary backward writes
  ``gradients.swp``, in a scratch counted with the gradient swap: :mod:`zerodp.offload.grad_swap`;
  the preset trains bf16 without ``clip_grad_norm_``, so no factor makes the step read the gradients
  back), and without ``overlap_step`` the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerodp.app.model import GPTConfig
from zerodp.offload.grad_swap import MAX_WRITES_IN_FLIGHT, NORM_BLOCK
from zerodp.runtime.grad_reducer import MAX_BUCKETS_IN_FLIGHT
from zerodp.stage3.sharding import REDUCE_GROUPS_PER_BACKWARD

#: the gradient swap's RAM row: a read buffer of a sub-group per optimizer sub-group buffer, the
#: partitions being reduced or written, and the 16 MiB scratch of the norm taken as they are written
_GROUPS = MAX_BUCKETS_IN_FLIGHT + MAX_WRITES_IN_FLIGHT
GRAD_SWAP_ROW = f"gradient swap: reads + {_GROUPS} groups + norm scratch per rank"

GIB = 2**30


@dataclass(frozen=True)
class Knobs:
    """Engine sizes used by the preset (DeepSpeed keys in brackets); see :func:`knobs_for`."""

    sub_group_size: int  # elements per optimizer swap sub-group [zero_optimization.sub_group_size]
    param_buffer_size: int  # bytes [offload_param.buffer_size]
    max_in_cpu: int  # bytes of shards read ahead [offload_param.max_in_cpu]
    probe_bytes: int  # raw direct-I/O probe (file on disk, buffer in RAM)
    optimizer_buffers: int = 4  # [offload_optimizer.buffer_count]
    param_buffer_count: int = 5  # [offload_param.buffer_count]
    runtime_bytes: int = 384 * 2**20  # interpreter, torch, Python heap, libraries per rank (~370 MB measured)
    reduce_bucket_size: int = 25_000_000  # elements of unit gradients staged per reduce-scatter [same]
    max_live_parameters: int = 200_000_000  # elements gathered ahead [stage3_max_live_parameters]
    persistence_threshold: int = 100_000  # elements; smaller modules stay gathered [stage3_param_persistence_threshold]
    # the step's sub-group loop goes on during the next forward [offload_optimizer.overlap_step]
    overlap_step: bool = True


def knobs_for(params: int, largest_layer: int, nproc: int, overlap_step: bool = True) -> Knobs:
    """Sizes chosen from job-wide budgets divided among the ``nproc`` ranks, so that the host bytes of
    the swap buffers do not grow with the number of ranks on the machine: sub-groups of at most
    12.5M / ``nproc`` elements (150 MB of fp32 state per swap read with one rank: large sequential I/O;
    the 3.8B run peaked at 9.0 GB RSS with 25M), at least 4 per rank down to 1M, so reads, updates and
    writes pipeline; parameter swap buffers that hold the largest layer in bf16 (at most DeepSpeed's
    default 1e8 bytes); read-ahead of at most 1 GB / ``nproc`` or a quarter of the rank's bf16 shards; a
    live window of 200M / ``nproc`` elements gathered ahead (at least two of the largest layer); a
    raw-I/O probe of a quarter of the bf16 shards, between 256 MiB and 1 GiB. With ``overlap_step``, 8
    optimizer buffers (6 sub-groups read ahead while the forward computes), else 4."""
    align = 4096
    shard_bytes = 2 * params
    rank_shard_bytes = -(-shard_bytes // nproc)
    return Knobs(
        sub_group_size=min(12_500_000 // nproc, max(1_000_000, math.ceil(params / nproc / 4))),
        param_buffer_size=min(100_000_000, -(-2 * largest_layer // align) * align),
        max_in_cpu=max(align, min(1_000_000_000 // nproc, rank_shard_bytes // 4)),
        probe_bytes=min(GIB, max(256 * 2**20, shard_bytes // 4 // align * align)),
        optimizer_buffers=8 if overlap_step else 4,
        max_live_parameters=min(200_000_000, max(200_000_000 // nproc, 2 * largest_layer)),
        overlap_step=overlap_step,
    )


#: bytes of saved activations per token, layer and d_model element (bf16, no activation checkpointing):
#: measured with saved_tensors_hooks on this GPT (33-35 at d_model 256-512; 32.5 at 2816), rounded up
ACTIVATION_BYTES = 36
#: bytes per element of the largest unit that autograd holds at once while computing a bf16 weight gradient
#: on the CPU (the product in fp32, the bf16 result, a copy): 130-224 MB measured at width 2816 (largest unit
#: 31.7M elements), above what the holders account for, in the backward of any block's qkv, fc or mlp.proj
WEIGHT_GRAD_BYTES = 8
#: engine buffers of the reducer's gradient staging in the gather pool: the group being filled and those
#: in flight (zerodp.stage3.sharding._pool_limit)
STAGING_GROUPS = 1 + MAX_BUCKETS_IN_FLIGHT


def unit_sizes(model: GPTConfig, persistence_threshold: int) -> list[int]:
    """Elements of the GPT's stage-3 units (per module, its parameters above the threshold; the others
    stay gathered) in the order backward completes them: ``ln_f``, the blocks from the last, then the
    embeddings (the token embedding is the tied head's weight: complete last)."""
    d = model.d_model
    ln = [d, d]
    block = [[4 * d * d, d], [4 * d * d, 4 * d], ln, [d * d, d], [3 * d * d, 3 * d], ln]  # mlp.proj .. ln1
    modules = [ln] + block * model.n_layer + [[model.seq_len * d], [model.vocab_size * d]]
    units = [sum(n for n in params if n > persistence_threshold) for params in modules]
    return [n for n in units if n]


def reduce_flush(units: list[int], reduce_bucket_size: int) -> int:
    """Elements the stage-3 reducer holds before one coalesced reduce-scatter (as
    :func:`zerodp.stage3.sharding.reduce_flush_elements`)."""
    return max(1, min(reduce_bucket_size, max(max(units), -(-sum(units) // REDUCE_GROUPS_PER_BACKWARD))))


def largest_reduce_group(units: list[int], flush: int) -> int:
    """Elements of the largest coalesced group: units in backward order added until ``flush`` is reached."""
    held = best = 0
    for n in units:
        held += n
        if held >= flush:
            best, held = max(best, held), 0
    return max(best, held)


def ram_accounting(
    p: int, model: GPTConfig, micro_batch: int, largest_layer: int, nproc: int, k: Knobs, grad_bytes: int = 2
) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Host bytes at the run's peak, all ranks together (module docstring), and the phases of which
    the largest is counted. ``grad_bytes``: bytes per element of the swapped gradient partition (2
    bf16, 4 with fp32 accumulation). ``S`` = ``sub_group_size``, ``u`` = ``largest_layer``."""
    align = 4096
    s_, u = k.sub_group_size, largest_layer
    units = unit_sizes(model, k.persistence_threshold)
    flush = reduce_flush(units, k.reduce_bucket_size)
    group = largest_reduce_group(units, flush)
    phases = transient_phases(p, model, micro_batch, u, nproc, k, flush, grad_bytes)
    candidates = (
        {"backward": ["backward"], "forward + loop (overlap_step)": ["forward", "loop"], "step": ["step"]}
        if k.overlap_step
        else {"backward": ["backward"], "forward": ["forward"], "step + loop": ["step", "loop"]}
    )
    sums = {name: sum(sum(phases[ph].values()) for ph in parts) for name, parts in candidates.items()}
    larger = max(sums, key=lambda name: sums[name])
    ram = {
        "runtime per rank": nproc * k.runtime_bytes,
        "optimizer sub-group buffers per rank": nproc * k.optimizer_buffers * -(-12 * s_ // align) * align,
        "parameter swap pool + read-ahead per rank": nproc
        * (k.param_buffer_count * k.param_buffer_size + min(k.max_in_cpu, -(-2 * p // nproc))),
        GRAD_SWAP_ROW: nproc * (k.optimizer_buffers * (grad_bytes * s_ + 2**20) + 4 * NORM_BLOCK)
        + (MAX_BUCKETS_IN_FLIGHT + MAX_WRITES_IN_FLIGHT) * grad_bytes * min(group, p),
        f"transients per rank: {larger}": sums[larger],
    }
    # 15% over the rows: the rows matched a measured peak within 10% (module docstring)
    ram["slack (15%)"] = math.ceil(0.15 * sum(ram.values()))
    return ram, phases


def transient_phases(
    p: int, model: GPTConfig, micro_batch: int, u: int, nproc: int, k: Knobs, flush: int, grad_bytes: int = 2
) -> dict[str, dict[str, int]]:
    """The transient rows by phase, all ranks together (module docstring)."""
    s_ = k.sub_group_size
    tokens = micro_batch * model.seq_len
    window = min(k.max_live_parameters, p)
    staging = min(STAGING_GROUPS * (flush + u), p)
    receive = min(MAX_BUCKETS_IN_FLIGHT * (flush + u), p) if nproc > 1 else 0  # gloo's all-to-all
    activations = nproc * (ACTIVATION_BYTES * tokens * model.d_model * model.n_layer + 8 * tokens * model.vocab_size)
    pinned = 2 * window  # each rank pins its 1/N of the window's shards
    return {
        "backward": {
            "gather pool (window, unit, grad staging)": nproc * 2 * (window + u + staging + receive),
            "shards pinned by gathers in flight (bf16)": pinned,
            "saved activations (bf16)": activations,
            "weight-gradient temporaries of one unit": nproc * WEIGHT_GRAD_BYTES * u,
        },
        "forward": {
            "gathered live window (bf16)": nproc * 2 * (window + u),
            "shards pinned by gathers in flight (bf16)": pinned,
            "saved activations (bf16)": activations,
        },
        "loop": {
            "fp32 gradient scratch (one sub-group)": nproc * 4 * s_,
            "resident shards (2 sub-groups + 2 layers, bf16)": nproc * 2 * (2 * s_ + 2 * u),
            "Adam temporaries (2 x fp32 sub-group)": nproc * 8 * s_,
        },
        "step": {},  # the norm was taken as gradients.swp was written (module docstring)
    }


__all__ = [
    "ACTIVATION_BYTES",
    "GRAD_SWAP_ROW",
    "WEIGHT_GRAD_BYTES",
    "largest_reduce_group",
    "ram_accounting",
    "reduce_flush",
    "transient_phases",
    "unit_sizes",
]
