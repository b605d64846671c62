"""The engine sizes and the host RAM of the ZeRO-Infinity preset's plan (``zerodp train --preset
infinity``, :mod:`zerodp.app.infinity`): :class:`Knobs` (the DeepSpeed keys the preset sets, from the
parameter count and the largest layer) and :func:`ram_accounting` (the RAM rows of the plan, all ranks
together, every row bounded by a layer, a sub-group or a configured pool; see the module docstring of
:mod:`zerodp.app.infinity` for what each covers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerodp.app.model import GPTConfig

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
    runtime_bytes: int = 768 * 2**20  # interpreter, torch, allocator slack per rank
    reduce_bucket_size: int = 25_000_000  # elements of unit gradients staged per reduce-scatter [same]
    max_live_parameters: int = 200_000_000  # elements gathered ahead [stage3_max_live_parameters]
    # the step's sub-group loop goes on during the next forward [offload_optimizer.overlap_step]
    overlap_step: bool = True


def knobs_for(params: int, largest_layer: int, nproc: int, overlap_step: bool = True) -> Knobs:
    """Sub-groups of at most 12.5M elements (150 MB of fp32 state per swap read: large sequential I/O;
    the 3.8B run peaked at 9.0 GB RSS with 25M), at least 4 per rank down to 1M, so reads, updates and
    writes pipeline; parameter swap buffers that hold the largest layer in bf16
    (at most DeepSpeed's default 1e8 bytes); read-ahead of at most 1 GB or a quarter of the bf16
    shards; a raw-I/O probe of a quarter of the bf16 shards, between 256 MiB and 1 GiB. With
    ``overlap_step``, 8 optimizer buffers (6 sub-groups read ahead while the forward computes), else 4."""
    align = 4096
    shard_bytes = 2 * params
    return Knobs(sub_group_size=min(12_500_000, max(1_000_000, math.ceil(params / nproc / 4))),
                 param_buffer_size=min(100_000_000, -(-2 * largest_layer // align) * align),
                 max_in_cpu=min(1_000_000_000, max(align, shard_bytes // 4)),
                 probe_bytes=min(GIB, max(256 * 2**20, shard_bytes // 4 // align * align)),
                 optimizer_buffers=8 if overlap_step else 4, overlap_step=overlap_step)


#: bytes of saved activations per token, layer and d_model element (bf16, no activation checkpointing):
#: measured with saved_tensors_hooks on this GPT (33-35 at d_model 256-512), rounded up
ACTIVATION_BYTES = 36


def ram_accounting(p: int, model: GPTConfig, micro_batch: int, largest_layer: int, nproc: int,
                   k: Knobs, grad_bytes: int = 2) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Host bytes the run holds at its peak, all ranks together (module docstring), and the two
    transient phases (backward, optimizer step) of which the larger is counted. ``grad_bytes``: bytes
    per element of the swapped gradient partition (2 bf16, 4 with fp32 accumulation).

    Per rank: ``S`` = sub_group_size, ``U`` = elements of the largest layer (the MLP's up projection,
    one stage-3 unit). Step: resident shards are those of the units whose pieces are in sub-groups k and
    k+1 (:mod:`zerodp.offload.nvme`): at most ``2 S`` elements plus two units cut by the boundaries."""
    align = 4096
    s_, u = k.sub_group_size, largest_layer
    tokens = micro_batch * model.seq_len
    pool = 2 * (min(k.max_live_parameters, p) + u + min(k.reduce_bucket_size + u, p) + 2 * u)
    phases = {
        "backward": {"gather pool limit (window, unit, grad staging)": nproc * pool,
                     "saved activations (bf16)": nproc * ACTIVATION_BYTES * tokens * model.d_model * model.n_layer
                     + nproc * 8 * tokens * model.vocab_size},
        "step": {"fp32 gradient scratch (one sub-group)": nproc * 4 * s_,
                 "resident shards (2 sub-groups + 2 layers, bf16)": nproc * 2 * (2 * s_ + 2 * u),
                 "grad norm of one layer in fp64 (value + square)": nproc * 16 * u,
                 "Adam temporaries (2 x fp32 sub-group)": nproc * 8 * s_},
    }
    if k.overlap_step:  # the step's loop runs during the next forward: both phases at once
        larger, transient = "backward + step (overlap_step)", sum(v for ph in phases.values() for v in ph.values())
    else:
        larger = max(phases, key=lambda ph: sum(phases[ph].values()))
        transient = sum(phases[larger].values())
    bucket = min(k.reduce_bucket_size + u, p)  # a coalesced reduce-scatter: its owned share is 1/nproc
    ram = {"runtime per rank": nproc * k.runtime_bytes,
           "gradient swap: 2 read buffers + 4 reduced buckets per rank": (nproc * 2 * (grad_bytes * s_ + 2**20)
                                                                          + 4 * grad_bytes * bucket),
           "optimizer sub-group buffers per rank": nproc * k.optimizer_buffers * -(-12 * s_ // align) * align,
           "parameter swap pool + read-ahead per rank": nproc * (k.param_buffer_count * k.param_buffer_size
                                                                + k.max_in_cpu),
           f"transients per rank, {'larger phase (' + larger + ')' if not k.overlap_step else larger}": transient}
    # the 3.2B runs' unattributed 20-21% was the allocator's sliding mmap threshold, now fixed (MALLOC_ENV); 15%
    # covers the interpreter and allocator variation, not yet measured at that scale since
    ram["slack (15%)"] = math.ceil(0.15 * sum(ram.values()))
    return ram, phases


__all__ = ["ACTIVATION_BYTES", "GIB", "Knobs", "knobs_for", "ram_accounting"]
