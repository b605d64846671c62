"""Loading a checkpoint into an engine of any world size and stage: check it fits, stage every value on
every rank, and only when all ranks succeeded copy values, optimizer state, hyperparameters, scheduler,
loss scaler, counters and RNG states in (see :mod:`zerodp.checkpoint`, [Note: precision])."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerodp.checkpoint.collective import check_same_on_ranks, collectively
from zerodp.checkpoint.engine_state import (
    describe_model,
    engine_precision,
    group_hyperparameters,
    optimizer_group_names,
    piece_value,
)
from zerodp.checkpoint.format import IMPLEMENTATION_OPTIONS, SCHEDULED_OPTIONS, CheckpointError, PathLike, dtype_name
from zerodp.checkpoint.layout import CheckpointLayout, layout_for
from zerodp.checkpoint.meta import CheckpointMeta, TensorRecord
from zerodp.checkpoint.optimizer_match import check_optimizer_state
from zerodp.checkpoint.protocol import CheckpointableEngine as Engine
from zerodp.checkpoint.reader import CheckpointReader, resolve_checkpoint


def check_compatible(meta: CheckpointMeta, engine: Engine) -> None:
    """Compare the checkpoint's model with ``engine``'s.

    Raises:
        CheckpointError: listing every difference: names only one side has, tied names that differ,
            parameter/buffer kind or shape mismatches, a parameter trained on one side and frozen at
            initialize on the other (a trained parameter frozen mid-run, ``requires_grad_(False)`` after
            initialize, is trained on both sides), or an optimizer param group whose
            parameters were saved in groups with different hyperparameters.
    """
    params, buffers, keys = describe_model(engine)
    mine = {a: r for r in params + buffers for a in r.aliases}
    theirs = {a: r for r in meta.params + meta.buffers for a in r.aliases}
    kind_mine, kind_theirs = _kinds(params, buffers), _kinds(meta.params, meta.buffers)
    problems = [
        f"checkpoint has {kind_theirs[k]} {k!r} that the model lacks" for k in meta.state_dict_keys if k not in mine
    ]
    problems += [f"model has {kind_mine[k]} {k!r} missing from checkpoint" for k in keys if k not in theirs]
    for k in keys:
        if k in theirs and k == mine[k].name:  # report each tensor once, under its first name
            problems += _tensor_problems(
                k, theirs[k], mine[k], (kind_theirs[k], kind_mine[k]), k in meta.excluded_frozen
            )
    if not problems:
        for i, names in enumerate(optimizer_group_names(engine)):
            try:
                group_hyperparameters(meta, names)
            except CheckpointError as e:
                problems.append(f"optimizer param group {i}: {e}")
    if problems:
        raise CheckpointError("; ".join(problems))


def _kinds(params: list[TensorRecord], buffers: list[TensorRecord]) -> dict[str, str]:
    """Every name (aliases included) -> ``"parameter"`` or ``"buffer"``."""
    return {a: kind for kind, rs in (("parameter", params), ("buffer", buffers)) for r in rs for a in r.aliases}


def _tensor_problems(k: str, a: TensorRecord, b: TensorRecord, kinds: tuple[str, str], excluded: bool) -> list[str]:
    """How the tensor named ``k`` differs between the checkpoint (``a``) and the model (``b``): its tied
    names, then the first of kind, shape, element order (strides) or trained/frozen; ``kinds``: its kind
    in each; ``excluded``: its values were not saved (``exclude_frozen_parameters``)."""
    out = []
    if sorted(a.aliases) != sorted(b.aliases):
        out.append(f"tied names differ: checkpoint ties {sorted(a.aliases)}, model ties {sorted(b.aliases)}")
    if kinds[0] != kinds[1]:
        out.append(f"{k!r} is a {kinds[0]} in the checkpoint but a {kinds[1]} in the model")
    elif a.shape != b.shape:
        out.append(f"{kinds[1]} {k!r} has shape {a.shape} in the checkpoint but {b.shape} in the model")
    elif a.strides != b.strides and a.trained and b.trained:
        out.append(
            f"parameter {k!r} was saved in the element order of strides {a.strides} but the "
            f"model's has strides {b.strides} (None: row-major); give the parameter the "
            "memory format it had when saved (e.g. model.to(memory_format=torch.channels_last)) "
            "before zerodp.initialize, or load zerodp.checkpoint.load_full_state_dict(...) "
            "with engine.load_module_state_dict"
        )
    elif kinds[1] == "parameter" and _trains(a) != _trains(b):
        out.append(
            _training_mismatch(k, a, b)
            + (" (its values were not saved either: exclude_frozen_parameters=True)" if excluded else "")
        )
    return out


def _trains(rec: TensorRecord) -> bool:
    """Whether the engine trains the parameter: covered by its optimizer partitions (``trained``, fixed
    at ``zerodp.initialize``; its ``requires_grad`` may be False now, frozen mid-run), or left out of
    ``model_parameters`` with ``requires_grad=True``. Only parameters frozen at initialize are False."""
    return rec.trained or rec.requires_grad


def _training_mismatch(name: str, saved: TensorRecord, mine: TensorRecord) -> str:
    """The problem line for a parameter trained on one side and frozen at initialize on the other."""
    if _trains(saved):
        when = " (frozen mid-run when saved)" if saved.trained and not saved.requires_grad else ""
        return (
            f"parameter {name!r} is trained in the checkpoint{when} but was frozen (requires_grad=False) "
            "at zerodp.initialize of this engine, so its saved optimizer state would be dropped: set "
            "requires_grad=True before zerodp.initialize (freeze it after initialize if it should not "
            "train yet), or load only the values with zerodp.checkpoint.load_full_state_dict(...) and "
            "engine.load_module_state_dict"
        )
    return (
        f"parameter {name!r} was frozen (requires_grad=False) at zerodp.initialize of the engine that saved "
        "the checkpoint (no optimizer state saved) but trains in this engine: freeze it before "
        "zerodp.initialize as when saving, or load only the values with "
        "zerodp.checkpoint.load_full_state_dict(...) and engine.load_module_state_dict"
    )


@dataclass
class _StagedLoad:
    """Everything read from a checkpoint, ready to be copied in (nothing touched yet)."""

    path: Path
    meta: CheckpointMeta
    values: list[tuple[torch.Tensor, torch.Tensor]]  # (live tensor, new values)
    states: list[tuple[torch.Tensor, dict[str, torch.Tensor] | None]]  # (optimizer param, new state)
    rng: dict[str, torch.Tensor]
    hyperparameters: list[dict[str, Any] | None]  # per optimizer param group; None: leave as is
    loss_scaler: dict[str, Any] | None = None  # None: leave the engine's as is
    lr_scheduler: dict[str, Any] | None = None  # state_dict() entries to load; None: leave as is


def _stage_load(
    engine: Engine, layout: CheckpointLayout, reader: CheckpointReader, load_optimizer_states: bool = True
) -> _StagedLoad:
    """Read everything the load copies in (values in this engine's layout, optimizer states and
    hyperparameters unless ``load_optimizer_states`` is False, RNG, scaler and scheduler states); the
    engine is not touched.

    Raises:
        CheckpointError: a value would overflow this engine's dtype (:func:`_check_representable`).
    """
    named: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, live tensor, new values)
    for t in layout.value_targets(engine):
        if reader.record(t.name).name in reader.excluded:
            continue  # frozen, not saved (exclude_frozen_parameters): this engine's values stay
        if t.reorder is not None:  # stored row-major, held in the slot's memory order
            full = reader.read_values(t.name, 0, t.reorder.numel).reshape(t.reorder.shape)
            new = t.reorder.flat_values(full)[t.start : t.end]
        else:
            new = reader.read_values(t.name, t.start, t.end)
        named.append((t.name, t.tensor, new.reshape(t.tensor.shape)))
    for name, live in layout.extra_targets(engine).items():
        if reader.record(name).name in reader.excluded:
            continue
        named.append((name, live, reader.read_values(name, 0, live.numel()).reshape(live.shape)))
    theirs, mine = reader.meta.effective_precision(), engine_precision(engine)
    if theirs != mine:
        _check_representable(reader.path, named, theirs, mine)
    values = [(live, new) for _, live, new in named]
    states = _stage_optimizer_states(engine, reader, values, load_optimizer_states)
    rng = reader.read_rng(engine.rank) if reader.meta.world_size == engine.world_size else {}
    hps = [
        group_hyperparameters(reader.meta, names) if load_optimizer_states else None
        for names in optimizer_group_names(engine)
    ]
    scaler, saved_scaler = getattr(engine, "loss_scaler", None), reader.meta.loss_scaler
    scaler_state = (
        saved_scaler.model_dump()
        if scaler is not None and scaler.dynamic and saved_scaler is not None and saved_scaler.dynamic
        else None
    )
    scheduler, saved_scheduler = getattr(engine, "lr_scheduler", None), reader.meta.lr_scheduler
    scheduler_state = (
        copy.deepcopy(saved_scheduler.state)
        if scheduler is not None and saved_scheduler is not None and saved_scheduler.type == type(scheduler).__name__
        else None
    )
    return _StagedLoad(reader.path, reader.meta, values, states, rng, hps, scaler_state, scheduler_state)


def _stage_optimizer_states(
    engine: Engine, reader: CheckpointReader, values: list[tuple[torch.Tensor, torch.Tensor]], with_states: bool = True
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor] | None]]:
    """``(optimizer parameter, its new state or None)`` for each of this rank's pieces, read for the
    piece's range (none at all when not ``with_states``: the optimizer state stays); a piece's fp32
    master gets its values appended to ``values``. Scalar states go to the parameter's device under
    ``capturable`` / ``fused``, as torch keeps them."""
    groups_by_piece = {}
    for pg in engine.optimizer.param_groups:
        for p in pg["params"]:
            groups_by_piece[id(p)] = pg
    states: list[tuple[torch.Tensor, dict[str, torch.Tensor] | None]] = []
    for g in engine.groups:
        for piece in g.pieces:
            rec = reader.record(piece.slot.name)
            start, end = piece.lo - piece.slot.offset, piece.hi - piece.slot.offset
            param = piece_value(piece)  # the optimizer's parameter
            if param is not piece.tensor:  # a master copy: loaded besides the flat buffer (value_targets)
                values.append((param, reader.read_values(rec.name, start, end).reshape(param.shape)))
            if not with_states:
                continue
            kinds = reader.state_kinds(rec.name) if rec.trained else {}
            if not kinds:
                states.append((param, None))
                continue
            pg = groups_by_piece[id(param)]
            on_device = bool(pg.get("capturable") or pg.get("fused"))
            st: dict[str, torch.Tensor] = {}
            for k, shape in kinds.items():
                if shape == []:
                    v = reader.read_scalar(k, rec.name, start, end)
                    st[k] = v.to(param.device) if on_device else v
                else:
                    st[k] = reader.read_range(k, rec.name, start, end, param.dtype).to(param.device)
            states.append((param, st))
    return states


def _check_representable(
    path: Path, named: list[tuple[str, torch.Tensor, torch.Tensor]], theirs: str, mine: str
) -> None:
    """A checkpoint of another precision loads only if no finite saved value becomes inf in the dtype
    this engine holds it in (e.g. a weight above 65504 in an fp16 module). Rounding to the engine's
    dtype is not refused: the fp32 masters get the exact values, and frozen parameters and buffers are
    held in the module dtype by this engine's precision policy anyway.

    Raises:
        CheckpointError: naming the tensors (first name) that would overflow.
    """
    bad: dict[str, torch.dtype] = {}
    for name, live, new in named:
        if not (live.is_floating_point() and new.is_floating_point()) or live.dtype == new.dtype:
            continue
        if torch.finfo(live.dtype).max >= torch.finfo(new.dtype).max:
            continue
        if (torch.isfinite(new) & ~torch.isfinite(new.to(live.dtype))).any():
            bad.setdefault(name, live.dtype)
    if bad:
        names = sorted(bad)
        dtype = bad[names[0]]
        raise CheckpointError(
            f"checkpoint {path} was saved with {theirs} and this engine uses {mine}: values of {names[:5]}"
            f"{' and others' if len(names) > 5 else ''} exceed the largest finite {dtype_name(dtype)} "
            f"({torch.finfo(dtype).max:g}) and would become inf; load it into an engine with {theirs} or fp32"
        )


def load_checkpoint(
    engine: Engine, load_dir: PathLike, tag: str | None = None, load_optimizer_states: bool = True
) -> tuple[Path, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``engine``, any world size or stage.

    Collective: every rank calls it. Every rank reads ``meta.json``, checks it against the engine and
    every file against ``meta.json``, and reads what it needs into new tensors; only when every rank
    succeeded are parameters (fp32 masters and the module's, possibly lower-precision, copy), frozen
    parameters (except those saved with ``exclude_frozen_parameters=True``: the engine's own values
    stay, e.g. a base model loaded before), buffers, optimizer state (pieces whose parameter had
    none get none), param-group hyperparameters (matched to the saved groups by parameter name, see
    :func:`group_hyperparameters`), the LR scheduler's state, the fp16 loss scaler's state and
    ``skipped_steps`` (see [Note: precision]), ``global_steps``, ``micro_steps`` (``global_steps x
    gradient_accumulation_steps`` if the saved count is not a multiple of this engine's accumulation
    steps, so the next step is a full accumulation window) and (same world size only) each rank's RNG
    states replaced. Gradients are zeroed. Resuming at the same world size
    and stage continues bit-identically.

    Args:
        load_dir: the ``save_dir`` given to :func:`save_checkpoint` (or a checkpoint directory).
        tag: checkpoint to load; default the one named by ``load_dir/latest``.
        load_optimizer_states: False: leave the optimizer's state and param-group hyperparameters as
            they are (DeepSpeed's argument); the fp32 masters still get the saved values. The way to
            load a checkpoint saved with another optimizer.

    Returns:
        (checkpoint directory, the ``client_state`` given to :func:`save_checkpoint`).

    Raises:
        CheckpointError (on every rank, before anything is changed): no such checkpoint; ``meta.json``
            missing, corrupt or of another version; a rank file missing, truncated or not matching
            ``meta.json``; saved pieces not covering a parameter; the model differs (names each
            missing or extra name, shape mismatch, a parameter frozen at initialize on one side only);
            saved with another precision and holding values this engine's dtype cannot represent (see
            [Note: precision]); with ``load_optimizer_states``, optimizer state saved by another
            optimizer or with other state keys (:func:`~zerodp.checkpoint.optimizer_match.check_optimizer_state`);
            the ranks passed different ``load_dir``s, tags or ``load_optimizer_states`` (names each rank's).
    """
    check_same_on_ranks(
        engine,
        "load_checkpoint",
        {"load_dir": Path(load_dir), "tag": tag, "load_optimizer_states": load_optimizer_states},
    )
    layout = layout_for(engine)
    staged = _stage_on_every_rank(engine, layout, load_dir, tag, load_optimizer_states)
    layout.before_load(engine)
    with torch.no_grad():
        for live, new in staged.values:
            live.copy_(new)
    _restore_optimizer(engine, staged)
    _restore_counters_and_rng(engine, staged)
    engine.reducer.zero_grads()
    layout.after_load(engine)
    return staged.path, staged.meta.client_state


def _stage_on_every_rank(
    engine: Engine, layout: CheckpointLayout, load_dir: PathLike, tag: str | None, load_optimizer_states: bool = True
) -> _StagedLoad:
    """Collective: each rank resolves, checks and reads the checkpoint into new tensors; every rank
    raises the first error any rank met (:func:`zerodp.checkpoint.collective.collectively`)."""

    def stage() -> _StagedLoad:
        path = resolve_checkpoint(load_dir, tag)
        with CheckpointReader(path) as reader:
            try:
                check_compatible(reader.meta, engine)
            except CheckpointError as e:
                raise CheckpointError(f"checkpoint {path} does not fit this model: {e}") from None
            reader.validate_files()
            if load_optimizer_states:
                check_optimizer_state(reader, engine)
            return _stage_load(engine, layout, reader, load_optimizer_states)

    return collectively(engine, "load_checkpoint", stage)


def _restore_optimizer(engine: Engine, staged: _StagedLoad) -> None:
    """Optimizer state per parameter, param-group hyperparameters, the LR scheduler and the fp16 loss scaler."""
    opt = engine.optimizer
    for param, st in staged.states:
        opt.state.pop(param, None)
        if st is not None:
            opt.state[param] = st
    same_optimizer = staged.meta.optimizer == type(opt).__name__
    for pg, hp in zip(opt.param_groups, staged.hyperparameters, strict=True):
        if hp is not None:
            _restore_hyperparameters(pg, hp, same_optimizer)
    if staged.lr_scheduler is not None:
        assert engine.lr_scheduler is not None  # staged only for an engine with a scheduler
        engine.lr_scheduler.load_state_dict(staged.lr_scheduler)
    if staged.loss_scaler is not None:
        assert engine.loss_scaler is not None  # staged only for an engine with a dynamic scaler
        engine.loss_scaler.load_state_dict(staged.loss_scaler)


def _restore_counters_and_rng(engine: Engine, staged: _StagedLoad) -> None:
    """``skipped_steps``, ``global_steps``, ``micro_steps`` (a full accumulation window next) and the RNG states."""
    if hasattr(engine, "skipped_steps"):
        engine.skipped_steps = staged.meta.skipped_steps
    engine.global_steps = staged.meta.global_steps
    accum = engine.gradient_accumulation_steps
    micro = staged.meta.micro_steps
    engine.micro_steps = micro if micro % accum == 0 else staged.meta.global_steps * accum
    if "torch_cpu" in staged.rng:
        torch.set_rng_state(staged.rng["torch_cpu"])
    if "torch_cuda" in staged.rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(staged.rng["torch_cuda"])


def _restore_hyperparameters(pg: dict[str, Any], hp: Mapping[str, Any], same_optimizer: bool) -> None:
    """Set ``pg``'s saved options (lr as a scheduler left it, betas, ...) except implementation switches.
    Across optimizer classes (Adam <-> AdamW) only the learning rate is carried over: the other options
    mean different things there and stay as configured."""
    for k, v in hp.items():
        if k in IMPLEMENTATION_OPTIONS or (not same_optimizer and k not in SCHEDULED_OPTIONS):
            continue
        cur = pg.get(k)
        if isinstance(cur, torch.Tensor):
            cur.fill_(v)
        elif isinstance(cur, tuple) or (cur is None and isinstance(v, list)):
            pg[k] = tuple(v)
        else:
            pg[k] = v
