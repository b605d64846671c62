"""What a checkpoint reads off a live engine: the model's records, trained slots, optimizer groups, full
fp32 master values, loss-scaler and scheduler state. Stage-independent (the stage-dependent part is
:mod:`zerodp.checkpoint.layout`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from zerodp.checkpoint.format import IMPLEMENTATION_OPTIONS, CheckpointError, dtype_name, prod
from zerodp.checkpoint.meta import CheckpointMeta, GroupRecord, LossScalerRecord, SchedulerRecord, TensorRecord
from zerodp.checkpoint.protocol import CheckpointableEngine as Engine
from zerodp.runtime import comm
from zerodp.runtime.partition import ParamSlot, Piece
from zerodp.stage3.units import ShardedUnit


def units(engine: Engine) -> list[ShardedUnit]:
    return engine.sharding.units if engine.sharding is not None else []


def outside_slots(engine: Engine) -> dict[str, torch.Tensor]:
    """The live state_dict entries (first name) that are not in any flat group: frozen parameters
    outside the groups (stages 0-2) and persistent buffers."""
    in_slots = {id(s.param) for g in engine.groups for s in g.slots}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in in_slots or id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t.data if isinstance(t, torch.nn.Parameter) else t
    return out


def piece_value(piece: Piece) -> torch.Tensor:
    """The optimizer's parameter for ``piece``: its saved value and the key of its optimizer state (an
    fp32 master copy when the piece has one, else its view of the flat buffer)."""
    master = getattr(piece, "master", None)
    return master if master is not None else piece.tensor


def engine_precision(engine: Engine) -> str:
    """``"fp32"``, ``"bf16"`` or ``"fp16"``: the dtype policy of ``engine``'s module parameters."""
    policy = getattr(engine, "precision", None)
    dtype = policy.param_dtype if policy is not None else torch.float32
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def full_master_values(engine: Engine) -> dict[int, torch.Tensor]:
    """id(parameter) -> a fresh copy of its full fp32 master value (parameter-shaped), for every
    trained parameter; {} when the engine keeps no master copies (fp32 training).

    Collective at stages 1-3 with more than one rank: one all-reduce (SUM, ledger purpose
    ``"checkpoint"``) per flat group of a buffer holding this rank's master pieces and -0.0 elsewhere.
    The pieces of all ranks are disjoint and ``x + (-0.0) == x`` for every x (+0.0 and nan included),
    so the sum is each element's master value bit for bit.
    """
    policy = getattr(engine, "precision", None)
    if policy is None or not policy.has_master:
        return {}
    trained = {id(s.param) for s in trained_slots(engine)}
    out: dict[int, torch.Tensor] = {}
    for g in engine.groups:
        slots = [s for s in g.slots if id(s.param) in trained]
        if not slots:
            continue
        full = torch.full((max(s.offset + s.numel for s in slots),), -0.0, dtype=torch.float32, device=g.buffer.device)
        for piece in g.pieces:
            if piece.master is not None:
                full[piece.lo : piece.hi] = piece.master
        if engine.stage > 0 and engine.world_size > 1:
            comm.all_reduce(full, engine.process_group, engine.ledger, "checkpoint")
        for s in slots:
            out[id(s.param)] = s.view(full[s.offset : s.offset + s.numel]).clone()
    return out


_NOT_JSON = object()


def _json_part(v: Any) -> Any:
    """``v`` without what JSON cannot hold: dict entries (recursively) whose key is not a string or whose
    value is not JSON; a list or tuple (tuples become lists) holding such a value is dropped whole.
    Returns ``_NOT_JSON`` when ``v`` itself cannot be stored."""
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            j = _json_part(x)
            if isinstance(k, str) and j is not _NOT_JSON:
                out[k] = j
        return out
    if isinstance(v, (list, tuple)):
        items = [_json_part(x) for x in v]
        return _NOT_JSON if any(x is _NOT_JSON for x in items) else items
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return _NOT_JSON


def loss_scaler_state(engine: Engine) -> LossScalerRecord | None:
    scaler = getattr(engine, "loss_scaler", None)
    if scaler is None:
        return None
    return LossScalerRecord.model_validate({"dynamic": bool(scaler.dynamic), **scaler.state_dict()})


def scheduler_state(engine: Engine) -> SchedulerRecord | None:
    """The engine's LR scheduler: class name and the JSON-serialisable part of its ``state_dict()``
    (a DeepSpeed schedule's parameters come from the config, a LambdaLR's functions from the code)."""
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is None:
        return None
    return SchedulerRecord(type=type(scheduler).__name__, state=_json_part(scheduler.state_dict()))


def describe_model(engine: Engine) -> tuple[list[TensorRecord], list[TensorRecord], list[str]]:
    """(parameter records, buffer records, state_dict keys) of ``engine.module`` as it is now."""
    slots = {id(s.param): s for g in engine.groups for s in g.slots}
    trained_ids = {id(s.param) for s in trained_slots(engine)}
    param_ids = {id(p) for p in engine.module.parameters()}
    sd = engine.module.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    first: dict[int, torch.Tensor] = {}
    for k, v in sd.items():
        aliases.setdefault(id(v), []).append(k)
        first.setdefault(id(v), v)
    params: list[TensorRecord] = []
    buffers: list[TensorRecord] = []
    for i, names in aliases.items():
        t = first[i]
        s = slots.get(i)  # a slot's parameter may be a placeholder (stage 3): take the slot's shape
        name, shape = (s.name, s.shape) if s is not None else (names[0], t.shape)
        rec = TensorRecord(
            name=name,
            aliases=[name] + [n for n in names if n != name],
            shape=list(shape),
            numel=prod(list(shape)),
            dtype=dtype_name(t.dtype),
            requires_grad=bool(t.requires_grad),
            trained=i in trained_ids,
            strides=list(s.stride) if s is not None and s.stride is not None and i in trained_ids else None,
        )  # trained values are stored in slot order; others as tensors
        (params if i in param_ids else buffers).append(rec)
    return params, buffers, list(sd.keys())


def optimizer_group_names(engine: Engine) -> list[list[str]]:
    """Names of the parameters in each of ``engine.optimizer.param_groups`` (one per user param group,
    ``ParamSlot.group_index``; a slot of a frozen parameter has none)."""
    names: list[list[str]] = [[] for _ in engine.optimizer.param_groups]
    for s in trained_slots(engine):
        if 0 <= s.group_index < len(names):
            names[s.group_index].append(s.name)
    return names


def trained_slots(engine: Engine) -> list[ParamSlot]:
    """Slots of the parameters the optimizer's partitions cover: fixed at ``zerodp.initialize`` (a
    parameter with ``requires_grad=True`` there, in ``model_parameters``), whatever its
    ``requires_grad`` now. A parameter frozen mid-run (``requires_grad_(False)`` after initialize) keeps
    its pieces, master and optimizer state, so it is saved and loaded as trained; its current flag only
    says whether it gets a gradient. A stage-3 unit also holds parameters frozen at initialize and ones
    left out of ``model_parameters`` (``group_index`` -1): those are saved like frozen ones."""
    return [s for g in engine.groups for s in g.slots if s.group_index >= 0]


def group_hyperparameters(meta: CheckpointMeta, names: list[str]) -> dict[str, Any] | None:
    """The saved hyperparameters of the optimizer group that held parameters ``names`` (any alias), matched
    by name, so param groups may be split or numbered differently (other dtype split, stage 3 units);
    None when no saved group held any of them.

    Raises:
        CheckpointError: the parameters were in saved groups with different hyperparameters.
    """
    canonical = {a: r.name for r in meta.params for a in r.aliases}
    saved_group = {canonical.get(n, n): g for g in meta.groups for n in g.names}
    found: dict[int, tuple[GroupRecord, str]] = {}
    for n in names:
        g = saved_group.get(canonical.get(n, n))
        if g is not None:
            found.setdefault(g.index, (g, n))
    hps = {
        json.dumps({k: v for k, v in g.hyperparameters.items() if k not in IMPLEMENTATION_OPTIONS}, sort_keys=True): (
            g,
            n,
        )
        for g, n in found.values()
    }
    if len(hps) > 1:
        (g1, n1), (g2, n2) = list(hps.values())[:2]
        raise CheckpointError(
            f"its parameters {n1!r} and {n2!r} were in saved param groups {g1.index} and "
            f"{g2.index} with different hyperparameters; group them as when saving"
        )
    return next(iter(found.values()))[0].hyperparameters if found else None


def group_records(engine: Engine) -> list[GroupRecord]:
    out = []
    for i, (pg, names) in enumerate(zip(engine.optimizer.param_groups, optimizer_group_names(engine), strict=True)):
        hp = {}
        for k, v in pg.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                v = v.item() if v.numel() == 1 else v.tolist()
            elif isinstance(v, tuple):
                v = list(v)
            try:
                json.dumps(v)
            except (TypeError, ValueError):
                continue  # not a hyperparameter we can store; it stays as configured
            hp[k] = v
        out.append(GroupRecord(index=i, names=names, hyperparameters=hp))
    return out


def keyed_like_state_dict(
    engine: Engine, full: dict[int, torch.Tensor], other: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``module.state_dict()``'s keys mapped to ``full[id(tensor)]`` where present (tied names: the
    first takes that tensor, the others their own copy), else to ``other(tensor)``."""
    out: dict[str, torch.Tensor] = {}
    taken: set[int] = set()
    for k, v in engine.module.state_dict(keep_vars=True).items():
        if id(v) in full:
            out[k] = full[id(v)] if id(v) not in taken else full[id(v)].clone()
            taken.add(id(v))
        else:
            out[k] = other(v)
    return out
