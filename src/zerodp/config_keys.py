"""Which DeepSpeed names zerodp maps and which it refuses: optimizer types and unimplemented config keys.

- :data:`OPTIMIZERS`: DeepSpeed's ``optimizer.type`` names (and every torch.optim optimizer by its
  class name) mapped to the torch class the engine builds over this rank's pieces.
- :data:`REFUSED_OPTIMIZERS`: names refused, each with the reason (a DeepSpeed-only fused/compressed
  optimizer, or a torch optimizer whose update depends on the parameter's shape or needs a closure).
- :data:`NOT_IMPLEMENTED`: config key paths (dotted, DeepSpeed's spelling) refused with the message
  ``"'<key>' is not implemented: <reason>"`` instead of a generic unknown-key error.
- :data:`OWN_KEYS`: zerodp's own keys, which DeepSpeed does not have (``device``, ``seed``...).
- :data:`ONLY_VALUE`: keys accepted only at the value that describes what zerodp always does
  (``reduce_scatter: true``...) or at DeepSpeed's default that leaves a feature off
  (``prescale_gradients: false``...), refused as not implemented at any other.
- :data:`OFF_SECTIONS`: DeepSpeed sections for features zerodp lacks (monitors, profilers, the hybrid
  engine...): accepted and dropped when disabled (``enabled`` false, or absent: DeepSpeed's default),
  refused as not implemented when enabled.
- :data:`ALIASES`: DeepSpeed's former key names (``bfloat16`` for ``bf16``; dotted paths), read as DeepSpeed does.

The "DeepSpeed config keys" table of docs/deepspeed.md lists the same keys (tests/test_readme_config_table.py).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

import torch

#: ``optimizer.type`` (case-insensitive) -> torch optimizer class. Each piece the optimizer sees is a
#: 1-D slice of a parameter, so only element-wise optimizers are listed: their update of a slice equals
#: the slice of their update on the whole parameter.
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    name: getattr(torch.optim, name)
    for name in ("Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
}

#: ``optimizer.type`` names refused, with the reason.
REFUSED_OPTIMIZERS: dict[str, str] = {
    "Lamb": "torch has no Lamb and zerodp does not ship one (its trust ratio needs each whole "
    "parameter's norm, which a partitioned piece does not have)",
    "OneBitAdam": "1-bit compressed communication is not implemented",
    "ZeroOneAdam": "0/1 Adam compressed communication is not implemented",
    "OneBitLamb": "1-bit compressed communication is not implemented",
    "MuAdam": "muP optimizers are not implemented",
    "MuAdamW": "muP optimizers are not implemented",
    "MuSGD": "muP optimizers are not implemented",
    "Lion": "torch has no Lion and zerodp does not ship one",
    "Muon": "its update orthogonalises each whole 2-D parameter; a partitioned 1-D piece would give another result",
    "Adafactor": "its second moment is factored by the parameter's rows and columns; a partitioned 1-D "
    "piece would give another result",
    "LBFGS": "it needs a closure re-evaluating the loss, which engine.step() does not take",
    "SparseAdam": "it needs sparse gradients; zerodp reduces dense ones",
}


def canonical_optimizer(name: str) -> str | None:
    """The canonical spelling of ``name`` (case-insensitive) in :data:`OPTIMIZERS` or
    :data:`REFUSED_OPTIMIZERS`; None if neither knows it."""
    for known in (*OPTIMIZERS, *REFUSED_OPTIMIZERS):
        if known.lower() == name.lower():
            return known
    return None


_ZERO_PP = "ZeRO++ (hierarchical partitioning, quantized weights/gradients) and MiCS are not implemented"
_SCOPE = "outside zerodp's scope (ZeRO data parallelism only)"

#: dotted key path -> why it is refused. The offload keys (``offload_optimizer``, ``offload_param``,
#: ``aio``, ``sub_group_size``) are owned by zerodp.offload and are not listed here.
NOT_IMPLEMENTED: dict[str, str] = {
    "zero_optimization.zero_hpz_partition_size": _ZERO_PP,
    "zero_optimization.zero_quantized_weights": _ZERO_PP,
    "zero_optimization.zero_quantized_gradients": _ZERO_PP,
    "zero_optimization.mics_shard_size": _ZERO_PP,
    "bf16.immediate_grad_update": "gradients are reduced and applied at the step",
    "pipeline": _SCOPE,
    "compression_training": _SCOPE,
    "checkpoint": _SCOPE,
}

_OFF = "accepted only when disabled"
#: top-level section -> the feature it configures. DeepSpeed turns each on with ``enabled: true`` and
#: leaves it off by default; zerodp has none of them, so a disabled section changes nothing.
OFF_SECTIONS: dict[str, str] = {
    "amp": "NVIDIA apex AMP (zerodp trains in bf16/fp16 with the bf16/fp16 sections)",
    "flops_profiler": "the FLOPs profiler",
    "tensorboard": "the TensorBoard monitor",
    "wandb": "the W&B monitor",
    "csv_monitor": "the CSV monitor",
    "comms_logger": "the communication logger",
    "autotuning": "autotuning",
    "elasticity": "elastic training",
    "data_efficiency": "data efficiency (curriculum, sampling)",
    "hybrid_engine": "the hybrid (training + inference) engine",
    "curriculum_learning": "curriculum learning",
    "progressive_layer_drop": "progressive layer drop",
    "eigenvalue": "eigenvalue computation",
    "nebula": "Nebula checkpointing",
}

#: DeepSpeed's former top-level names -> the name it reads them as (when the new name is absent).
ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    # DeepSpeed's deprecated name (still read by DeepSpeed's config; in older HF example configs)
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": (
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    ),
}


#: dotted key path -> (the one value accepted: what zerodp always does, why another is refused). The
#: key is dropped from the config when it has that value, refused as not implemented otherwise.
ONLY_VALUE: dict[str, tuple[Any, str]] = {
    "zero_optimization.reduce_scatter": (True, "gradients are always reduce-scattered at stages 1-3"),
    "zero_optimization.allgather_partitions": (True, "updated partitions are always all-gathered"),
    "zero_optimization.round_robin_gradients": (False, "gradient partitions are assigned contiguously"),
    "zero_optimization.elastic_checkpoint": (False, "checkpoints load at any world size and stage anyway"),
    "zero_optimization.ignore_unused_parameters": (True, "a parameter with no gradient on any rank is always skipped"),
    # DeepSpeed's defaults, which leave a feature zerodp lacks off
    "zero_optimization.cpu_offload": (False, "offload is configured with offload_optimizer"),
    "prescale_gradients": (False, "gradients are averaged once, after the reduction"),
    "gradient_predivide_factor": (1.0, "gradients are averaged once, after the reduction"),
    "sparse_gradients": (False, "gradients are reduced dense"),
    "communication_data_type": (None, "gradients are reduced in the module's dtype"),
    "fp16.auto_cast": (False, "inputs are not cast; the module runs in fp16"),
    "fp16.fp16_master_weights_and_grads": (False, "masters are always fp32"),
    "fp16.consecutive_hysteresis": (False, "the hysteresis budget is restored when the loss scale grows"),
    "dataloader_drop_last": (False, "zerodp builds no data loader (DeepSpeed's deepspeed_io)"),
    "memory_breakdown": (False, "memory is reported by engine.memory_report()"),
    "dump_state": (False, "the engine's state is not printed at the first step"),
}


#: zerodp's own top-level keys (DeepSpeed has none of them) -> what they do. ``device``: "auto"
#: (default: ``cuda:LOCAL_RANK`` when CUDA is available and the data-parallel group's backend takes
#: CUDA tensors, else the CPU), "cpu" or "cuda" (refused where CUDA or an NCCL group is missing); see
#: :func:`zerodp.runtime.device.resolve_device`. The DeepSpeed drop-in accepts ``"auto"`` for it.
OWN_KEYS: dict[str, str] = {
    "seed": "torch.manual_seed applied by initialize()",
    "device": "where the engine puts the module, its shards and batches: auto, cpu or cuda",
    "collective_guard": "agreement of the ranks before each collective engine call",
}


def _lookup(config: Mapping[str, Any], path: str) -> tuple[bool, Any, Any]:
    node: Any = config
    parent: Any = None
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None, None
        parent, node = node, node[part]
    return True, node, parent


def _same(given: Any, value: Any) -> bool:
    """``given`` is ``value``: the same bool or None, or an equal number (1 for 1.0; never a bool)."""
    if isinstance(value, bool) or value is None:
        return given is value
    return isinstance(given, (int, float)) and not isinstance(given, bool) and given == value


def screen_keys(config: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Split off DeepSpeed keys zerodp does not model as fields.

    Returns:
        (``config`` without the :data:`ONLY_VALUE` keys that have their accepted value, a message for
        every :data:`NOT_IMPLEMENTED` key present and every :data:`ONLY_VALUE` key with another value).
    """
    out = copy.deepcopy(dict(config))
    found = []
    for old, new in ALIASES.items():  # an alias and its key share a parent section
        present, given, parent = _lookup(out, old)
        if not present:
            continue
        old_leaf, new_leaf = old.rsplit(".", 1)[-1], new.rsplit(".", 1)[-1]
        del parent[old_leaf]
        if new_leaf in parent and parent[new_leaf] != given:
            found.append(
                f"'{old}' (DeepSpeed's former name of '{new}') and '{new}' are both given, with "
                f"different values; give '{new}' only"
            )
        parent.setdefault(new_leaf, given)
    for section, feature in OFF_SECTIONS.items():
        if section not in out:
            continue
        given = out[section]
        enabled = given.get("enabled", False) if isinstance(given, Mapping) else given
        if enabled is False or given is None:
            del out[section]  # disabled: DeepSpeed would not run it either
        else:
            found.append(
                f"'{section}' is not implemented ({feature}): {_OFF}, i.e. with \"enabled\": false "
                f"(got {json.dumps(given, default=repr)})"
            )
    for path, reason in NOT_IMPLEMENTED.items():
        if _lookup(out, path)[0]:
            found.append(f"'{path}' is not implemented: {reason}")
    for path, (value, reason) in ONLY_VALUE.items():
        present, given, parent = _lookup(out, path)
        if not present:
            continue
        if _same(given, value):
            del parent[path.rsplit(".", 1)[-1]]
        else:
            found.append(
                f"'{path}' is not implemented for {json.dumps(given, default=repr)} (only "
                f"{json.dumps(value)} is accepted): {reason}"
            )
    return out, found
