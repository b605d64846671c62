"""Sharded checkpoints that do not depend on the world size or the ZeRO stage.

[Note: format] A checkpoint is the directory ``save_dir/<tag>/`` (tag ``global_step{N}`` by default):

- ``rank{r}.safetensors``, one per rank of the saving world: the *pieces* that rank owned. A piece is
  elements ``[start, end)`` of one flattened trainable parameter (named by its first name in
  ``module.state_dict()``); it is stored as ``param/<name>/<start>-<end>`` (fp32 values) plus one
  tensor per optimizer-state entry, ``<key>/<name>/<start>-<end>`` (``exp_avg``, ``exp_avg_sq``:
  ``end - start`` elements; ``step``: a scalar). A parameter that never received a gradient has no
  state entries. The file also holds the rank's RNG states (``rng/torch_cpu``, ``rng/torch_cuda``) as
  uint8 tensors. At stage 0 every rank owns everything, so only rank 0 writes pieces.
- ``model_extra.safetensors`` (rank 0): frozen parameters and persistent buffers, full, native dtype.
- ``meta.json`` (rank 0, written last): format version, stage, world size, every parameter and buffer
  (name, shape, numel, dtype, requires_grad, tied aliases), the pieces of every rank file, the
  optimizer's param groups (names and hyperparameters such as the current lr), ``global_steps``,
  ``micro_steps``, the caller's JSON ``client_state``, and (keys added later, optional when reading)
  ``precision`` (``fp32``/``bf16``/``fp16``: the module's parameter dtype; the top-level ``dtype`` is
  that of the stored piece values, fp32 in all three), ``skipped_steps`` (fp16 overflows),
  ``loss_scaler`` (fp16: ``dynamic``, ``scale``, ``hysteresis_left``, ``clean_steps``) and
  ``lr_scheduler`` (class name and the JSON-serialisable entries of its ``state_dict()``).

Pieces are addressed by parameter name and element range, never by flat-buffer offset, so a
checkpoint saved by N ranks at any stage loads into M ranks at any stage: each rank assembles the
ranges it needs now from whichever saved pieces overlap them. Loading never unpickles anything
(safetensors and JSON only).

[Note: crash safety] Every rank writes into ``save_dir/.tmp-<tag>/``; once all ranks have written
(a collective that also propagates any rank's failure), rank 0 writes ``meta.json``, renames the
directory to ``save_dir/<tag>`` (an existing one is moved aside first and removed after) and then
replaces ``save_dir/latest`` atomically. A process killed at any point before that last replace
leaves the previous checkpoint and ``latest`` untouched (a save replacing the checkpoint ``latest``
names, killed between the two renames, is recovered by :func:`resolve_checkpoint`). ``save_dir`` must
be on a filesystem that every rank sees (a shared one for multi-node runs).

[Note: stage 3] What depends on where parameters live is confined to a :class:`CheckpointLayout`
(which pieces a rank writes, where loaded values go, how to get full values). Stages 0-2 share
:class:`ReplicatedParamsLayout`; stage 3 uses :class:`ShardedParamsLayout`. At stage 3 every parameter
(frozen ones too) lives in a :class:`~zerodp.stage3.units.ShardedUnit` whose flat group's ``buffer`` is this
rank's shard, and a sharded parameter's ``.data`` is an empty placeholder (its shape is the slot's). The
pieces are the optimizer's, exactly as at stages 1-2; loading fills each slot's intersection with this
rank's shard (frozen slots from ``model_extra``); frozen parameters are gathered unit by unit to be
saved, and full values are read unit by unit under ``zero.GatheredParameters``. Loading releases units
left gathered but unused (e.g. prefetched) first, and afterwards re-gathers the persistent unit and any
unit still in use, so no gathered copy is stale. The format is the same at every stage.

[Note: optimizer parameter] The value saved for a piece, and the tensor its optimizer state is keyed
by, is :func:`_piece_value` (an fp32 ``master`` when the piece has one, else the piece's view of the
flat buffer). Loading writes it and, separately, the flat buffer (cast with ``copy_``), so a bf16/fp16
module's parameters are its masters rounded, as after an optimizer step. Full values
(:func:`module_state_dict`) of trained parameters are the masters, assembled across ranks.

[Note: precision] Pieces are fp32 whatever the precision, so a checkpoint loads into an engine of
another precision (fp32 <-> bf16 <-> fp16) without losing trained values; frozen parameters and buffers
are cast to the engine's module dtype. Refused: a finite saved value that would overflow to inf in the
engine's dtype (:func:`_check_representable`). The loss scaler state is restored only between dynamic
fp16 scalers (a static scale stays as configured; a non-fp16 engine has none); the LR scheduler's only
into a scheduler of the same class (otherwise the configured one starts afresh; the param groups' lr is
restored either way).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Union

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed import ReduceOp

from zerodp.runtime import comm
from zerodp.runtime.partition import ParamSlot, Piece
from zerodp.stage3.units import ShardedUnit, ShardState
from zerodp.zero import GatheredParameters

if TYPE_CHECKING:
    from zerodp.engine import Engine

FORMAT = "zerodp-checkpoint"
VERSION = 1
META_FILE = "meta.json"
EXTRA_FILE = "model_extra.safetensors"
LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
PARAM_KEY = "param"  # key prefix of the fp32 values of a piece
RNG_PREFIX = "rng/"
#: param-group options that describe how the optimizer runs, not what it computes: never restored.
IMPLEMENTATION_OPTIONS = frozenset({"foreach", "fused", "capturable", "differentiable"})
#: param-group options carried over even when loading into another optimizer class (set by schedulers).
SCHEDULED_OPTIONS = frozenset({"lr", "initial_lr"})
#: ``meta.json``'s ``precision``: the module's parameter dtype under mixed precision.
PRECISIONS = ("fp32", "bf16", "fp16")

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(ValueError):
    """A checkpoint cannot be written, found or read, or does not fit the engine it is loaded into."""


# ---- the records stored in meta.json -------------------------------------------------------------------
@dataclass(frozen=True)
class PieceRecord:
    """Elements ``[start, end)`` of flattened parameter ``name`` saved in one rank file.

    ``state`` maps each optimizer-state key to its stored shape: ``[]`` for a scalar (``step``),
    ``[end - start]`` for a per-element tensor (``exp_avg``, ``exp_avg_sq``); empty when the parameter
    had no optimizer state (it never received a gradient).
    """

    name: str
    start: int
    end: int
    state: dict[str, list[int]] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def key(self, kind: str) -> str:
        """Tensor name in the rank file: ``<kind>/<name>/<start>-<end>`` (kind ``param`` or a state key)."""
        return f"{kind}/{self.name}/{self.start}-{self.end}"


@dataclass
class RankRecord:
    """One rank file: its pieces and which RNG states it holds (``torch_cpu``, ``torch_cuda``)."""

    rank: int
    file: str
    pieces: list[PieceRecord]
    rng: list[str]


@dataclass
class TensorRecord:
    """A parameter or persistent buffer of the module, under its first ``state_dict`` name.

    ``trained``: optimized by the engine, so its values are in the rank files' pieces (fp32);
    otherwise (frozen parameters, buffers) they are in ``model_extra.safetensors`` in ``dtype``.
    """

    name: str
    aliases: list[str]  # every state_dict name of this tensor (tied weights), ``name`` first
    shape: list[int]
    numel: int
    dtype: str  # the module's dtype, e.g. "float32"
    requires_grad: bool
    trained: bool


@dataclass
class GroupRecord:
    """One optimizer param group: its parameters (by name) and hyperparameters (lr, betas, ...)."""

    index: int
    names: list[str]
    hyperparameters: dict[str, Any]


@dataclass
class CheckpointMeta:
    """Everything in ``meta.json``. See the module docstring, [Note: format]."""

    version: int
    stage: int
    world_size: int
    dtype: str  # dtype of the stored piece values (float32; float64 for a float64 model)
    optimizer: str
    params: list[TensorRecord]
    buffers: list[TensorRecord]
    state_dict_keys: list[str]  # in module.state_dict() order
    groups: list[GroupRecord]
    ranks: list[RankRecord]
    global_steps: int
    micro_steps: int
    client_state: Any
    # mixed precision and schedules (absent from older checkpoints: these defaults)
    precision: str = ""  # "fp32", "bf16" or "fp16"; "" when not recorded (see :meth:`effective_precision`)
    skipped_steps: int = 0  # optimizer steps skipped because gradients overflowed (fp16)
    loss_scaler: Optional[dict[str, Any]] = None  # fp16: {"dynamic", "scale", "hysteresis_left", "clean_steps"}
    lr_scheduler: Optional[dict[str, Any]] = None  # {"type": class name, "state": JSON parts of state_dict()}
    torch_version: str = torch.__version__
    format: str = FORMAT

    def to_json(self) -> str:
        """Pretty JSON: one line per record, short lists (shapes, names) inline."""
        d = asdict(self)
        return _dump_json({"format": d.pop("format"), **d}, "") + "\n"

    @classmethod
    def from_json(cls, obj: Any) -> "CheckpointMeta":
        """Parse and check ``meta.json``'s content.

        Raises:
            CheckpointError: a key is missing or has the wrong type, the format or version is not this
                one, names repeat, pieces lie outside their parameter or do not cover a trained
                parameter, or pieces of one parameter disagree on which optimizer state exists.
        """
        d = _obj(obj, "meta.json")
        fmt = _get(d, "format", str, "meta.json")
        if fmt != FORMAT:
            raise CheckpointError(f"'format' is {fmt!r}, not {FORMAT!r}")
        version = _get(d, "version", int, "meta.json")
        if version != VERSION:
            raise CheckpointError(f"format version {version} is not supported (this zerodp reads version "
                                  f"{VERSION})")
        meta = cls(
            version=version, stage=_get(d, "stage", int, "meta.json"),
            world_size=_get(d, "world_size", int, "meta.json"), dtype=_get(d, "dtype", str, "meta.json"),
            optimizer=_get(d, "optimizer", str, "meta.json"),
            params=[_tensor_record(x, f"params[{i}]") for i, x in enumerate(_get(d, "params", list, "meta.json"))],
            buffers=[_tensor_record(x, f"buffers[{i}]")
                     for i, x in enumerate(_get(d, "buffers", list, "meta.json"))],
            state_dict_keys=_str_list(_get(d, "state_dict_keys", list, "meta.json"), "state_dict_keys"),
            groups=[_group_record(x, i) for i, x in enumerate(_get(d, "groups", list, "meta.json"))],
            ranks=[_rank_record(x, i) for i, x in enumerate(_get(d, "ranks", list, "meta.json"))],
            global_steps=_get(d, "global_steps", int, "meta.json"),
            micro_steps=_get(d, "micro_steps", int, "meta.json"),
            client_state=d.get("client_state"), precision=_opt(d, "precision", str, ""),
            skipped_steps=_opt(d, "skipped_steps", int, 0), loss_scaler=_loss_scaler_record(d.get("loss_scaler")),
            lr_scheduler=_scheduler_record(d.get("lr_scheduler")),
            torch_version=str(d.get("torch_version", "")), format=fmt,
        )
        meta._check_consistent()
        return meta

    def effective_precision(self) -> str:
        """``precision``, or for a checkpoint that does not record it, what its parameters' dtypes imply."""
        if self.precision:
            return self.precision
        dtypes = {r.dtype for r in self.params if r.trained}
        return "bf16" if "bfloat16" in dtypes else "fp16" if "float16" in dtypes else "fp32"

    def _check_consistent(self) -> None:
        records = self.params + self.buffers
        names = [r.name for r in records]
        if len(set(names)) != len(names):
            repeated = sorted({n for n in names if names.count(n) > 1})
            raise CheckpointError(f"names repeat in params/buffers: {repeated}")
        aliases = [a for r in records for a in r.aliases]
        if sorted(aliases) != sorted(self.state_dict_keys) or len(set(aliases)) != len(aliases):
            raise CheckpointError("the aliases of params and buffers do not match 'state_dict_keys' one to one")
        for r in records:
            if r.name not in r.aliases or r.numel != _prod(r.shape):
                raise CheckpointError(f"record {r.name!r}: name not among its aliases or numel != prod(shape)")
        if self.precision not in ("",) + PRECISIONS:
            raise CheckpointError(f"'precision' is {self.precision!r}; expected one of {list(PRECISIONS)}")
        if self.skipped_steps < 0:
            raise CheckpointError(f"'skipped_steps' is {self.skipped_steps}; expected >= 0")
        if len(self.ranks) != self.world_size or [r.rank for r in self.ranks] != list(range(self.world_size)):
            raise CheckpointError(f"'ranks' must list ranks 0..{self.world_size - 1} in order")
        by_name = {r.name: r for r in self.params}
        covered: dict[str, list[PieceRecord]] = {r.name: [] for r in self.params if r.trained}
        for rr in self.ranks:
            for p in rr.pieces:
                rec = by_name.get(p.name)
                if rec is None or not rec.trained:
                    raise CheckpointError(f"{rr.file} holds a piece of {p.name!r}, which is not a trained "
                                          "parameter")
                if not 0 <= p.start < p.end <= rec.numel:
                    raise CheckpointError(f"{rr.file}: piece [{p.start}, {p.end}) of {p.name!r} lies outside "
                                          f"its {rec.numel} elements")
                for k, shape in p.state.items():
                    if shape not in ([], [p.numel]):
                        raise CheckpointError(f"{rr.file}: state {k!r} of {p.name!r} [{p.start}, {p.end}) has "
                                              f"shape {shape}; expected [] or [{p.numel}]")
                covered[p.name].append(p)
        for name, pieces in covered.items():
            gap = _first_gap(pieces, by_name[name].numel)
            if gap is not None:
                raise CheckpointError(f"the saved pieces of parameter {name!r} do not cover its elements "
                                      f"(elements from {gap} are missing)")
            kinds = {tuple(sorted(p.state)) for p in pieces}
            if len(kinds) > 1:
                raise CheckpointError(f"the pieces of parameter {name!r} disagree on its optimizer state")


def _dump_json(v: Any, indent: str) -> str:
    """Objects whose values are all scalars or lists of scalars go on one line; others are expanded."""
    def scalars(x: Any) -> bool:
        return isinstance(x, list) and all(map(_scalar, x))

    def flat(x: Any) -> bool:
        if isinstance(x, dict):
            return all(_scalar(y) or scalars(y) or (isinstance(y, dict) and all(map(scalars, y.values())))
                       for y in x.values())
        return scalars(x)

    if _scalar(v) or flat(v):
        return json.dumps(v)
    inner = indent + " "
    if isinstance(v, list):
        return "[\n" + ",\n".join(inner + _dump_json(x, inner) for x in v) + "\n" + indent + "]" if v else "[]"
    if isinstance(v, dict):
        if not v:
            return "{}"
        items = [f"{inner}{json.dumps(k)}: {_dump_json(x, inner)}" for k, x in v.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    return json.dumps(v)


def _scalar(x: Any) -> bool:
    return x is None or isinstance(x, (str, int, float, bool))


def _obj(x: Any, where: str) -> dict:
    if not isinstance(x, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(x).__name__}")
    return x


def _get(d: dict, key: str, typ: type, where: str) -> Any:
    if key not in d:
        raise CheckpointError(f"{where}: missing key {key!r}")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise CheckpointError(f"{where}: {key!r} should be {typ.__name__}, got {type(v).__name__}")
    return v


def _opt(d: dict, key: str, typ: type, default: Any) -> Any:
    """``d[key]`` checked like :func:`_get`, or ``default`` when absent (keys added after version 1)."""
    return _get(d, key, typ, "meta.json") if key in d else default


def _loss_scaler_record(x: Any) -> Optional[dict[str, Any]]:
    if x is None:
        return None
    where = "loss_scaler"
    d = _obj(x, where)
    scale = d.get("scale")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise CheckpointError(f"{where}: 'scale' should be a positive number, got {scale!r}")
    return {"dynamic": _get(d, "dynamic", bool, where), "scale": float(scale),
            "hysteresis_left": _get(d, "hysteresis_left", int, where),
            "clean_steps": _get(d, "clean_steps", int, where)}


def _scheduler_record(x: Any) -> Optional[dict[str, Any]]:
    if x is None:
        return None
    where = "lr_scheduler"
    d = _obj(x, where)
    return {"type": _get(d, "type", str, where), "state": _get(d, "state", dict, where)}


def _str_list(v: list, where: str) -> list[str]:
    if not all(isinstance(x, str) for x in v):
        raise CheckpointError(f"{where}: expected a list of strings")
    return list(v)


def _int_list(v: Any, where: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise CheckpointError(f"{where}: expected a list of integers")
    return list(v)


def _tensor_record(x: Any, where: str) -> TensorRecord:
    d = _obj(x, where)
    return TensorRecord(
        name=_get(d, "name", str, where), aliases=_str_list(_get(d, "aliases", list, where), where),
        shape=_int_list(_get(d, "shape", list, where), where), numel=_get(d, "numel", int, where),
        dtype=_get(d, "dtype", str, where), requires_grad=_get(d, "requires_grad", bool, where),
        trained=_get(d, "trained", bool, where),
    )


def _group_record(x: Any, i: int) -> GroupRecord:
    where = f"groups[{i}]"
    d = _obj(x, where)
    return GroupRecord(index=_get(d, "index", int, where), names=_str_list(_get(d, "names", list, where), where),
                       hyperparameters=_get(d, "hyperparameters", dict, where))


def _rank_record(x: Any, i: int) -> RankRecord:
    where = f"ranks[{i}]"
    d = _obj(x, where)
    pieces = []
    for j, p in enumerate(_get(d, "pieces", list, where)):
        pw = f"{where}.pieces[{j}]"
        pd = _obj(p, pw)
        state = _get(pd, "state", dict, pw)
        pieces.append(PieceRecord(_get(pd, "name", str, pw), _get(pd, "start", int, pw), _get(pd, "end", int, pw),
                                  {str(k): _int_list(v, pw) for k, v in state.items()}))
    return RankRecord(rank=_get(d, "rank", int, where), file=_get(d, "file", str, where), pieces=pieces,
                      rng=_str_list(_get(d, "rng", list, where), where))


def _prod(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _first_gap(pieces: list[PieceRecord], numel: int) -> Optional[int]:
    """First element of ``[0, numel)`` no piece covers, or None."""
    reach = 0
    for p in sorted(pieces, key=lambda p: p.start):
        if p.start > reach:
            return reach
        reach = max(reach, p.end)
    return reach if reach < numel else None


def value_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype in which trained parameter values are stored and consolidated: fp32 (fp64 stays fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _parse_dtype(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    return d if isinstance(d, torch.dtype) else torch.float32


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- what depends on the stage: where parameters live --------------------------------------------------
@dataclass
class Target:
    """Elements ``[start, end)`` of flattened state_dict entry ``name`` that this rank holds in ``tensor``
    (``end - start`` elements, any shape; written with ``copy_``, which casts to its dtype)."""

    name: str
    start: int
    end: int
    tensor: torch.Tensor


class CheckpointLayout(Protocol):
    """Stage-dependent part of saving and loading (see [Note: stage 3])."""

    def saved_pieces(self, engine: "Engine") -> list[Piece]:
        """The pieces (values and optimizer state) this rank writes to its rank file."""

    def value_targets(self, engine: "Engine") -> list[Target]:
        """The parameter ranges this rank keeps in its flat buffers: loading fills exactly these."""

    def extra_values(self, engine: "Engine") -> dict[str, torch.Tensor]:
        """Full values of every state_dict entry outside the flat buffers' trained parameters (frozen
        parameters, persistent buffers) by first state_dict name. Called on every rank when saving (it
        may gather); only rank 0's are written, so other ranks may leave out what they would copy."""

    def extra_targets(self, engine: "Engine") -> dict[str, torch.Tensor]:
        """The live full tensors, by first state_dict name, that loading fills besides
        :meth:`value_targets` (frozen parameters and buffers that every rank holds in full)."""

    def full_state_dict(self, engine: "Engine") -> dict[str, torch.Tensor]:
        """Fresh full copies keyed like ``module.state_dict()``, trained parameters in fp32 (the fp32
        masters when the engine keeps them), frozen parameters and buffers in their dtype (every rank)."""

    def before_load(self, engine: "Engine") -> None:
        """Runs once every rank has staged the load successfully, before anything is copied in."""

    def after_load(self, engine: "Engine") -> None:
        """Runs after new values were copied into :meth:`value_targets` (e.g. re-gather parameters)."""


class ReplicatedParamsLayout:
    """Stages 0-2: every rank holds every parameter in full (views of the flat buffers) and the module's
    frozen parameters and buffers in full. Pieces are the optimizer's owned ranges; at stage 0 every
    rank owns everything, so only rank 0 writes them."""

    def saved_pieces(self, engine: "Engine") -> list[Piece]:
        if engine.stage == 0 and engine.rank != 0:
            return []
        return [p for g in engine.groups for p in g.pieces]

    def value_targets(self, engine: "Engine") -> list[Target]:
        return [Target(s.name, 0, s.numel, g.buffer[s.offset : s.offset + s.numel])
                for g in engine.groups for s in g.slots]

    def extra_values(self, engine: "Engine") -> dict[str, torch.Tensor]:
        return self.extra_targets(engine)

    def extra_targets(self, engine: "Engine") -> dict[str, torch.Tensor]:
        return _outside_slots(engine)  # all slots are trained at stages 0-2

    def full_state_dict(self, engine: "Engine") -> dict[str, torch.Tensor]:
        """Trained parameters: the fp32 masters when there are any (assembled across ranks at stages
        1-2, see :func:`_full_master_values`), else the module's values cast to fp32."""
        masters = _full_master_values(engine)
        trained = {id(s.param) for s in _trained_slots(engine)}
        return _keyed_like_state_dict(engine, masters, lambda v: v.detach().to(
            dtype=value_dtype(v.dtype) if id(v) in trained else v.dtype, copy=True))

    def before_load(self, engine: "Engine") -> None:
        pass

    def after_load(self, engine: "Engine") -> None:
        pass


class ShardedParamsLayout:
    """Stage 3: each rank holds one shard of every unit (frozen parameters included) and the module's
    buffers in full; parameters are gathered only to be read (see [Note: stage 3])."""

    def saved_pieces(self, engine: "Engine") -> list[Piece]:
        return [p for g in engine.groups for p in g.pieces]

    def value_targets(self, engine: "Engine") -> list[Target]:
        out = []
        for g in engine.groups:
            base, end = g.shard_offset, g.shard_offset + g.buffer.numel()  # the shard, in unit coordinates
            for s in g.slots:
                lo, hi = max(base, s.offset), min(end, s.offset + s.numel)
                if lo < hi:
                    out.append(Target(s.name, lo - s.offset, hi - s.offset, g.buffer[lo - base : hi - base]))
        return out

    def extra_values(self, engine: "Engine") -> dict[str, torch.Tensor]:
        """Buffers (every rank), and on rank 0 CPU copies of the frozen unit parameters: each unit
        holding one is gathered on every rank (collective), one unit at a time."""
        trained = {id(s.param) for s in _trained_slots(engine)}
        out: dict[str, torch.Tensor] = {}
        for u in _units(engine):
            frozen = [s for s in u.slots if id(s.param) not in trained]
            if not frozen:
                continue
            with torch.no_grad(), GatheredParameters([s.param for s in frozen]):
                if engine.rank == 0:
                    for s in frozen:
                        out[s.name] = s.param.detach().to("cpu", copy=True)
        out.update(_outside_slots(engine))
        return out

    def extra_targets(self, engine: "Engine") -> dict[str, torch.Tensor]:
        return _outside_slots(engine)  # buffers (a parameter outside every unit, if any, is full)

    def full_state_dict(self, engine: "Engine") -> dict[str, torch.Tensor]:
        """Gathers one unit at a time (collective) and copies its parameters; nothing stays gathered
        that was not gathered before. With fp32 masters, trained parameters are assembled from every
        rank's master pieces instead (:func:`_full_master_values`) and only units holding frozen
        parameters are gathered."""
        trained = {id(s.param) for s in _trained_slots(engine)}
        full: dict[int, torch.Tensor] = _full_master_values(engine)
        for u in _units(engine):
            rest = [s for s in u.slots if id(s.param) not in full]
            if not rest:
                continue
            with torch.no_grad(), GatheredParameters([s.param for s in rest]):
                for s in rest:
                    v = s.param.detach()
                    full[id(s.param)] = v.to(dtype=value_dtype(v.dtype) if id(s.param) in trained else v.dtype,
                                             copy=True)
        return _keyed_like_state_dict(engine, full, lambda v: v.detach().clone())

    def before_load(self, engine: "Engine") -> None:
        # Units gathered ahead of use (prefetched, then not used) would keep the old values: drop them
        # now (finishing any all-gather in flight, so none reads a shard while it is overwritten).
        engine.sharding.coordinator.release_idle()

    def after_load(self, engine: "Engine") -> None:
        sharding = engine.sharding
        sharding.after_step()  # the persistent unit, from the new shards
        for u in sharding.units:  # units held gathered right now (e.g. inside GatheredParameters)
            if not u.persistent and u.state is not ShardState.SHARDED:
                if u.state is ShardState.GATHERING:
                    u.finish_gather()
                comm.all_gather(u.full, u.shard, sharding.pg, sharding.ledger, "parameters")


def _units(engine: "Engine") -> list[ShardedUnit]:
    return engine.sharding.units if engine.sharding is not None else []


def _outside_slots(engine: "Engine") -> dict[str, torch.Tensor]:
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


def _piece_value(piece: Piece) -> torch.Tensor:
    """The optimizer's parameter for ``piece``: its saved value and the key of its optimizer state (an
    fp32 master copy when the piece has one, else its view of the flat buffer)."""
    master = getattr(piece, "master", None)
    return master if master is not None else piece.tensor


def engine_precision(engine: "Engine") -> str:
    """``"fp32"``, ``"bf16"`` or ``"fp16"``: the dtype policy of ``engine``'s module parameters."""
    policy = getattr(engine, "precision", None)
    dtype = policy.param_dtype if policy is not None else torch.float32
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _full_master_values(engine: "Engine") -> dict[int, torch.Tensor]:
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
    trained = {id(s.param) for s in _trained_slots(engine)}
    out: dict[int, torch.Tensor] = {}
    for g in engine.groups:
        slots = [s for s in g.slots if id(s.param) in trained]
        if not slots:
            continue
        full = torch.full((max(s.offset + s.numel for s in slots),), -0.0, dtype=torch.float32,
                          device=g.buffer.device)
        for piece in g.pieces:
            if piece.master is not None:
                full[piece.lo : piece.hi] = piece.master
        if engine.stage > 0 and engine.world_size > 1:
            comm.all_reduce(full, engine.process_group, engine.ledger, "checkpoint")
        for s in slots:
            out[id(s.param)] = full[s.offset : s.offset + s.numel].view(s.shape).clone()
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


def _loss_scaler_state(engine: "Engine") -> Optional[dict[str, Any]]:
    scaler = getattr(engine, "loss_scaler", None)
    if scaler is None:
        return None
    return {"dynamic": bool(scaler.dynamic), **scaler.state_dict()}


def _scheduler_state(engine: "Engine") -> Optional[dict[str, Any]]:
    """The engine's LR scheduler: class name and the JSON-serialisable part of its ``state_dict()``
    (a DeepSpeed schedule's parameters come from the config, a LambdaLR's functions from the code)."""
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is None:
        return None
    return {"type": type(scheduler).__name__, "state": _json_part(scheduler.state_dict())}


#: layout per ZeRO stage.
LAYOUTS: dict[int, CheckpointLayout] = {0: ReplicatedParamsLayout(), 1: ReplicatedParamsLayout(),
                                        2: ReplicatedParamsLayout(), 3: ShardedParamsLayout()}


def layout_for(engine: "Engine") -> CheckpointLayout:
    """The :class:`CheckpointLayout` of ``engine``'s stage.

    Raises:
        NotImplementedError: no layout is registered in :data:`LAYOUTS` for that stage.
    """
    try:
        return LAYOUTS[engine.stage]
    except KeyError:
        raise NotImplementedError(f"checkpoints are not implemented for ZeRO stage {engine.stage}: register a "
                                  "CheckpointLayout in zerodp.checkpoint.LAYOUTS") from None


def module_state_dict(engine: "Engine") -> dict[str, torch.Tensor]:
    """Full state dict of ``engine.module`` on every rank, keyed like ``module.state_dict()`` (tied
    weights under each name, as separate tensors), buffers included. Trained parameters are fp32: the
    fp32 master values under bf16/fp16 (collective: assembled across ranks), else the module's values;
    frozen parameters and buffers keep the module's dtype."""
    return layout_for(engine).full_state_dict(engine)


# ---- describing the engine's model -------------------------------------------------------------------
def describe_model(engine: "Engine") -> tuple[list[TensorRecord], list[TensorRecord], list[str]]:
    """(parameter records, buffer records, state_dict keys) of ``engine.module`` as it is now."""
    slots = {id(s.param): s for g in engine.groups for s in g.slots}
    trained_ids = {id(s.param) for s in _trained_slots(engine)}
    param_ids = {id(p) for p in engine.module.parameters()}
    sd = engine.module.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    first: dict[int, torch.Tensor] = {}
    for k, v in sd.items():
        aliases.setdefault(id(v), []).append(k)
        first.setdefault(id(v), v)
    params, buffers = [], []
    for i, names in aliases.items():
        t = first[i]
        s = slots.get(i)  # a slot's parameter may be a placeholder (stage 3): take the slot's shape
        name, shape = (s.name, s.shape) if s is not None else (names[0], t.shape)
        rec = TensorRecord(name=name, aliases=[name] + [n for n in names if n != name], shape=list(shape),
                           numel=_prod(list(shape)), dtype=_dtype_name(t.dtype),
                           requires_grad=bool(t.requires_grad), trained=i in trained_ids)
        (params if i in param_ids else buffers).append(rec)
    return params, buffers, list(sd.keys())


def _optimizer_group_names(engine: "Engine") -> list[list[str]]:
    """Names of the parameters in each of ``engine.optimizer.param_groups`` (one per user param group,
    ``ParamSlot.group_index``; a slot of a frozen parameter has none)."""
    names: list[list[str]] = [[] for _ in engine.optimizer.param_groups]
    for s in _trained_slots(engine):
        if 0 <= s.group_index < len(names):
            names[s.group_index].append(s.name)
    return names


def _trained_slots(engine: "Engine") -> list[ParamSlot]:
    """Slots of the parameters the optimizer updates. A stage-3 unit also holds frozen parameters and
    ones left out of ``model_parameters`` (``group_index`` -1): those are saved like frozen ones."""
    return [s for g in engine.groups for s in g.slots if s.group_index >= 0 and s.param.requires_grad]


def group_hyperparameters(meta: CheckpointMeta, names: list[str]) -> Optional[dict[str, Any]]:
    """The saved hyperparameters of the optimizer group that held parameters ``names`` (any alias), matched
    by name, so param groups may be split or numbered differently (other dtype split, stage 3 units);
    None when no saved group held any of them.

    Raises:
        CheckpointError: the parameters were in saved groups with different hyperparameters.
    """
    canonical = {a: r.name for r in meta.params for a in r.aliases}
    saved_group = {canonical.get(n, n): g for g in meta.groups for n in g.names}
    found = {}
    for n in names:
        g = saved_group.get(canonical.get(n, n))
        if g is not None:
            found.setdefault(g.index, (g, n))
    hps = {json.dumps({k: v for k, v in g.hyperparameters.items() if k not in IMPLEMENTATION_OPTIONS},
                      sort_keys=True): (g, n) for g, n in found.values()}
    if len(hps) > 1:
        (g1, n1), (g2, n2) = list(hps.values())[:2]
        raise CheckpointError(f"its parameters {n1!r} and {n2!r} were in saved param groups {g1.index} and "
                              f"{g2.index} with different hyperparameters; group them as when saving")
    return next(iter(found.values()))[0].hyperparameters if found else None


def _group_records(engine: "Engine") -> list[GroupRecord]:
    out = []
    for i, (pg, names) in enumerate(zip(engine.optimizer.param_groups, _optimizer_group_names(engine))):
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
        out.append(GroupRecord(i, names, hp))
    return out


# ---- saving ------------------------------------------------------------------------------------------
def save_checkpoint(engine: "Engine", save_dir: PathLike, tag: Optional[str] = None,
                    client_state: Optional[Mapping[str, Any]] = None) -> Path:
    """Write a checkpoint of ``engine`` to ``save_dir/<tag>`` and point ``save_dir/latest`` at it.

    Collective: every rank of the engine's group must call it with the same ``save_dir`` and ``tag``.
    See [Note: format] and [Note: crash safety].

    Args:
        save_dir: directory holding checkpoints (created if needed; visible to every rank).
        tag: checkpoint name; default ``global_step{engine.global_steps}``. A checkpoint with the same
            tag is replaced.
        client_state: JSON-serialisable data returned by :func:`load_checkpoint` (rank 0's is kept; it
            comes back as JSON does: tuples as lists, non-string dict keys as strings).

    Returns:
        The checkpoint directory ``save_dir/<tag>``.

    Raises:
        CheckpointError (on every rank): ``client_state`` is not JSON-serialisable, the tag is not a plain
            directory name, the engine is in the middle of gradient accumulation, or a rank failed to
            write (its own rank re-raises the original error); the previous checkpoint is intact.
    """
    layout = layout_for(engine)
    save_dir = Path(save_dir)
    tag = f"global_step{engine.global_steps}" if tag is None else tag
    tmp = save_dir / f"{TMP_PREFIX}{tag}"
    _collectively(engine, "save_checkpoint", lambda: _check_can_save(engine, tag, client_state))
    _collectively(engine, "save_checkpoint", lambda: _prepare_dir(tmp) if engine.rank == 0 else None)
    extra = _collectively(engine, "save_checkpoint", lambda: _copy_extra_values(engine, layout))
    _collectively(engine, "save_checkpoint", lambda: _write_rank_file(engine, layout, tmp))
    _collectively(engine, "save_checkpoint",
                  lambda: _finish_save(engine, extra, save_dir, tag, client_state) if engine.rank == 0 else None)
    return save_dir / tag


def _check_can_save(engine: "Engine", tag: str, client_state: Any) -> None:
    check_tag(tag)
    if engine.micro_steps % engine.gradient_accumulation_steps != 0:
        raise CheckpointError(
            f"save_checkpoint at micro-step {engine.micro_steps} is inside a gradient accumulation window "
            f"of {engine.gradient_accumulation_steps}: the partial gradients would be lost; save right "
            "after the engine.step() that updates the parameters")
    if client_state is not None:
        try:
            json.dumps(client_state, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"client_state must be JSON-serialisable (dicts, lists, str, numbers, "
                                  f"bools, None): {e}") from None


def check_tag(tag: str) -> str:
    """Return ``tag`` if it can name a checkpoint directory.

    Raises:
        CheckpointError: empty, a path (contains a separator), ``.``/``..``, starts with ``.``, or is
            ``latest``.
    """
    if (not isinstance(tag, str) or not tag or tag in (".", "..", LATEST_FILE) or tag.startswith(".")
            or "/" in tag or os.sep in tag or (os.altsep and os.altsep in tag) or "\n" in tag):
        raise CheckpointError(f"invalid checkpoint tag {tag!r}: use a plain directory name (not starting "
                              f"with '.', not {LATEST_FILE!r})")
    return tag


def _prepare_dir(tmp: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted save
    tmp.mkdir()


def _copy_extra_values(engine: "Engine", layout: CheckpointLayout) -> dict[str, torch.Tensor]:
    """Every rank asks the layout (it may gather); rank 0 keeps CPU copies for ``model_extra``."""
    values = layout.extra_values(engine)
    if engine.rank != 0:
        return {}
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in values.items()}


def _write_rank_file(engine: "Engine", layout: CheckpointLayout, tmp: Path) -> Path:
    """Write this rank's pieces and RNG states to ``tmp/rank{r}.safetensors`` (fsynced)."""
    if not tmp.is_dir():
        raise CheckpointError(f"rank {engine.rank} does not see {tmp}, which rank 0 created: save_dir must be "
                              "on a filesystem shared by all ranks")
    tensors: dict[str, torch.Tensor] = {}
    for piece in layout.saved_pieces(engine):
        s = piece.slot
        rec = PieceRecord(s.name, piece.lo - s.offset, piece.hi - s.offset)
        value = _piece_value(piece)
        tensors[rec.key(PARAM_KEY)] = value.detach().to("cpu", value_dtype(value.dtype), copy=True)
        for k, v in engine.optimizer.state.get(value, {}).items():
            if not isinstance(v, torch.Tensor) or list(v.shape) not in ([], [rec.numel]):
                raise CheckpointError(f"optimizer state {k!r} of {s.name!r} is {type(v).__name__} "
                                      f"{list(getattr(v, 'shape', []))}; only scalar tensors and tensors "
                                      "shaped like the parameter piece can be saved")
            if k in (PARAM_KEY, RNG_PREFIX[:-1]) or "/" in k:
                raise CheckpointError(f"optimizer state key {k!r} collides with checkpoint tensor names")
            tensors[rec.key(k)] = v.detach().to("cpu", copy=True)
    tensors[RNG_PREFIX + "torch_cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors[RNG_PREFIX + "torch_cuda"] = torch.cuda.get_rng_state()
    path = tmp / _rank_file(engine.rank)
    save_file(tensors, str(path), metadata={"format": FORMAT, "version": str(VERSION), "rank": str(engine.rank)})
    _fsync(path)
    return path


def _rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def _scan_rank_file(path: Path, rank: int) -> RankRecord:
    """Rebuild a rank file's :class:`RankRecord` from its safetensors header (tensor names and shapes)."""
    pieces: dict[tuple[str, int, int], dict[str, list[int]]] = {}
    rng = []
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            if key.startswith(RNG_PREFIX):
                rng.append(key[len(RNG_PREFIX):])
                continue
            kind, name, start, end = _parse_key(key)
            pieces.setdefault((name, start, end), {})[kind] = list(f.get_slice(key).get_shape())
    records = []
    for (name, start, end), kinds in sorted(pieces.items()):
        if kinds.pop(PARAM_KEY, None) is None:
            raise CheckpointError(f"{path}: piece {name!r} [{start}, {end}) has optimizer state but no values")
        records.append(PieceRecord(name, start, end, dict(sorted(kinds.items()))))
    return RankRecord(rank, path.name, records, sorted(rng))


def _parse_key(key: str) -> tuple[str, str, int, int]:
    """``<kind>/<name>/<start>-<end>`` -> (kind, name, start, end); the name may contain '/'."""
    try:
        kind, rest = key.split("/", 1)
        name, span = rest.rsplit("/", 1)
        start, end = (int(x) for x in span.split("-"))
    except ValueError:
        raise CheckpointError(f"unexpected tensor name {key!r} in a rank file") from None
    return kind, name, start, end


def _finish_save(engine: "Engine", extra: dict[str, torch.Tensor], save_dir: Path, tag: str,
                 client_state: Any) -> None:
    """Rank 0, after every rank wrote its file: extra file, meta.json, rename, ``latest``."""
    tmp = save_dir / f"{TMP_PREFIX}{tag}"
    save_file(extra, str(tmp / EXTRA_FILE), metadata={"format": FORMAT, "version": str(VERSION)})
    _fsync(tmp / EXTRA_FILE)
    params, buffers, keys = describe_model(engine)
    ranks = []
    for r in range(engine.world_size):
        path = tmp / _rank_file(r)
        if not path.is_file():
            raise CheckpointError(f"rank {r} did not write {path}")
        ranks.append(_scan_rank_file(path, r))
    meta = CheckpointMeta(
        version=VERSION, stage=engine.stage, world_size=engine.world_size,
        dtype=_dtype_name(value_dtype(engine.groups[0].buffer.dtype if engine.groups else torch.float32)),
        optimizer=type(engine.optimizer).__name__, params=params, buffers=buffers, state_dict_keys=keys,
        groups=_group_records(engine), ranks=ranks, global_steps=engine.global_steps,
        micro_steps=engine.micro_steps, client_state=client_state, precision=engine_precision(engine),
        skipped_steps=int(getattr(engine, "skipped_steps", 0)), loss_scaler=_loss_scaler_state(engine),
        lr_scheduler=_scheduler_state(engine),
    )
    _write_text(tmp / META_FILE, meta.to_json())
    _fsync_dir(tmp)
    _publish(save_dir, tag)


def _publish(save_dir: Path, tag: str) -> None:
    """Rename ``.tmp-<tag>`` to ``<tag>`` (moving an old ``<tag>`` aside), then replace ``latest``."""
    final, tmp = save_dir / tag, save_dir / f"{TMP_PREFIX}{tag}"
    if final.exists():
        os.replace(final, save_dir / f"{OLD_PREFIX}{tag}-{uuid.uuid4().hex[:8]}")
    os.replace(tmp, final)
    _fsync_dir(save_dir)
    _write_latest(save_dir, tag)
    for old in save_dir.glob(f"{OLD_PREFIX}{tag}-*"):  # this one, and any left by a killed save
        shutil.rmtree(old, ignore_errors=True)


def _write_latest(save_dir: Path, tag: str) -> None:
    _write_text(save_dir / LATEST_FILE, tag)
    _fsync_dir(save_dir)


def _write_text(path: Path, text: str) -> None:
    """Replace ``path`` atomically with ``text`` (write ``path.tmp``, fsync, os.replace)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:  # some filesystems cannot fsync a directory
        pass


def _collectively(engine: "Engine", what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank, then synchronise: if it raised on any rank, raise on every rank
    (the failing rank re-raises its own error, the others a :class:`CheckpointError`). Acts as a
    barrier, so no rank hangs in a later collective when another failed."""
    error: Optional[BaseException] = None
    result = None
    try:
        result = fn()
    except Exception as e:  # re-raised below, after every rank knows
        error = e
    failed = error is not None
    if engine.world_size > 1:
        flag = torch.tensor([int(failed)], dtype=torch.int32, device=_comm_device(engine))
        comm.all_reduce(flag, engine.process_group, engine.ledger, "checkpoint", op=ReduceOp.MAX)
        failed = bool(flag.item())
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{what} failed on another rank (see that rank's error); nothing was changed here")
    return result


def _comm_device(engine: "Engine") -> torch.device:
    if dist.get_backend(engine.process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- finding and reading -----------------------------------------------------------------------------
def resolve_checkpoint(checkpoint_dir: PathLike, tag: Optional[str] = None) -> Path:
    """The checkpoint directory for ``tag`` in ``checkpoint_dir`` (``latest``'s tag when None).

    ``checkpoint_dir`` may also be a checkpoint directory itself (one holding ``meta.json``) when
    ``tag`` is None. If ``<tag>`` is missing because a save replacing it was killed mid-rename, the
    complete new (``.tmp-<tag>``) or old (``.old-<tag>-*``) directory is returned instead.

    Raises:
        CheckpointError: no ``latest`` file (and no ``meta.json``), an invalid tag, or no such checkpoint.
    """
    d = Path(checkpoint_dir)
    if tag is None:
        latest = d / LATEST_FILE
        if latest.is_file():
            tag = latest.read_text(encoding="utf-8").strip()
            try:
                check_tag(tag)
            except CheckpointError as e:
                raise CheckpointError(f"{latest} is corrupt: {e}") from None
        elif (d / META_FILE).is_file():
            return d
        elif not d.is_dir():
            raise CheckpointError(f"checkpoint directory {d} does not exist")
        else:
            raise CheckpointError(f"no checkpoint in {d}: it has neither a {LATEST_FILE!r} file nor a "
                                  f"{META_FILE}; name one with a tag (--tag in the CLI)")
    path = d / check_tag(tag)
    if (path / META_FILE).is_file():
        return path
    # A save replacing ``tag`` was killed between moving the old directory aside and renaming the new
    # one into place: the new one is complete once its meta.json exists (written last), else the old one.
    for candidate in [d / f"{TMP_PREFIX}{tag}", *sorted(d.glob(f"{OLD_PREFIX}{tag}-*"))]:
        if not path.exists() and (candidate / META_FILE).is_file():
            return candidate
    raise CheckpointError(f"checkpoint {path} does not exist or has no {META_FILE}")


def read_meta(path: Path) -> CheckpointMeta:
    """Parse ``path/meta.json``.

    Raises:
        CheckpointError: missing, not JSON, or not a valid meta (names the file and the problem).
    """
    file = path / META_FILE
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} is corrupt (not readable JSON): {e}") from None
    try:
        return CheckpointMeta.from_json(obj)
    except CheckpointError as e:
        raise CheckpointError(f"{file} is corrupt: {e}") from None


class CheckpointReader:
    """Reads one checkpoint directory: its meta and, lazily, ranges of saved tensors.

    Use as a context manager; :meth:`validate_files` opens every file and checks it against
    ``meta.json`` before anything is read.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.meta = read_meta(self.path)
        self.records: dict[str, TensorRecord] = {r.name: r for r in self.meta.params + self.meta.buffers}
        self.canonical: dict[str, str] = {a: r.name for r in self.records.values() for a in r.aliases}
        self.pieces: dict[str, list[tuple[RankRecord, PieceRecord]]] = {}
        for rr in self.meta.ranks:
            for p in rr.pieces:
                self.pieces.setdefault(p.name, []).append((rr, p))
        for v in self.pieces.values():
            v.sort(key=lambda x: x[1].start)
        self._files: dict[str, Any] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._files.clear()

    def _open(self, name: str) -> Any:
        if name not in self._files:
            file = self.path / name
            if not file.is_file():
                raise CheckpointError(f"checkpoint file {file} is missing")
            try:
                self._files[name] = safe_open(str(file), framework="pt")
            except Exception as e:  # safetensors raises its own error type on truncated/corrupt files
                raise CheckpointError(f"checkpoint file {file} is truncated or corrupt: {e}") from None
        return self._files[name]

    def validate_files(self) -> None:
        """Open every rank file and the extra file; check their tensor names and shapes against meta.json.

        Raises:
            CheckpointError: a file is missing, truncated or corrupt, or holds other tensors than listed.
        """
        for rr in self.meta.ranks:
            expected: dict[str, Optional[list[int]]] = {RNG_PREFIX + k: None for k in rr.rng}
            for p in rr.pieces:
                expected[p.key(PARAM_KEY)] = [p.numel]
                expected.update({p.key(k): shape for k, shape in p.state.items()})
            self._check_file(rr.file, expected)
        extras: dict[str, Optional[list[int]]] = {r.name: r.shape for r in self.records.values() if not r.trained}
        self._check_file(EXTRA_FILE, extras)

    def _check_file(self, name: str, expected: Mapping[str, Optional[list[int]]]) -> None:
        f = self._open(name)
        try:
            actual = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:
            raise CheckpointError(f"checkpoint file {self.path / name} is corrupt: {e}") from None
        missing, unexpected = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
        if missing or unexpected:
            raise CheckpointError(f"checkpoint file {self.path / name} does not match {META_FILE}: missing "
                                  f"tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
        for k, shape in expected.items():
            if shape is not None and actual[k] != shape:
                raise CheckpointError(f"checkpoint file {self.path / name}: tensor {k!r} has shape {actual[k]}, "
                                      f"{META_FILE} says {shape}")

    def _read(self, file: str, key: str, lo: Optional[int] = None, hi: Optional[int] = None) -> torch.Tensor:
        try:
            f = self._open(file)
            return f.get_tensor(key) if lo is None else f.get_slice(key)[lo:hi]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read {key!r} from {self.path / file}: {e}") from None

    def record(self, name: str) -> TensorRecord:
        """The record of the tensor that state_dict name ``name`` (any alias) refers to."""
        return self.records[self.canonical[name]]

    def read_values(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of flattened tensor ``name`` (any alias): fp32 for trained
        parameters (assembled from the overlapping pieces), the stored dtype otherwise. 1-D."""
        rec = self.record(name)
        if not rec.trained:
            return self._read(EXTRA_FILE, rec.name).reshape(-1)[start:end]
        return self.read_range(PARAM_KEY, rec.name, start, end, value_dtype(_parse_dtype(rec.dtype)))

    def read_range(self, kind: str, name: str, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Per-element tensor ``kind`` (``param`` or a state key) of trained parameter ``name`` (its first
        name), elements ``[start, end)``, assembled from every overlapping piece."""
        out = torch.empty(end - start, dtype=dtype)
        for rr, p in self.pieces.get(name, []):
            lo, hi = max(start, p.start), min(end, p.end)
            if lo < hi:
                out[lo - start : hi - start] = self._read(rr.file, p.key(kind), lo - p.start, hi - p.start)
        return out

    def read_scalar(self, kind: str, name: str, start: int, end: int) -> torch.Tensor:
        """Scalar state ``kind`` (``step``) of parameter ``name``, the same in every piece that overlaps
        ``[start, end)``.

        Raises:
            CheckpointError: overlapping pieces hold different values.
        """
        values = [self._read(rr.file, p.key(kind)) for rr, p in self.pieces.get(name, [])
                  if max(start, p.start) < min(end, p.end)]
        if any(not torch.equal(v, values[0]) for v in values[1:]):
            raise CheckpointError(f"pieces of {name!r} disagree on optimizer state {kind!r}")
        return values[0]

    def state_kinds(self, name: str) -> dict[str, list[int]]:
        """Optimizer-state keys (-> shape of the first piece) of trained parameter ``name``; {} if none."""
        pieces = self.pieces.get(name, [])
        return dict(pieces[0][1].state) if pieces else {}

    def read_rng(self, rank: int) -> dict[str, torch.Tensor]:
        rr = self.meta.ranks[rank]
        return {k: self._read(rr.file, RNG_PREFIX + k) for k in rr.rng}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors keyed like the saved module's ``state_dict()`` (tied names as separate copies):
        trained parameters in fp32, frozen parameters and buffers in their dtype."""
        full = {r.name: self.read_values(r.name, 0, r.numel).reshape(r.shape) for r in self.records.values()}
        out: dict[str, torch.Tensor] = {}
        for k in self.meta.state_dict_keys:
            name = self.canonical[k]
            out[k] = full[name] if k == name else full[name].clone()
        return out


# ---- loading -----------------------------------------------------------------------------------------
def check_compatible(meta: CheckpointMeta, engine: "Engine") -> None:
    """Compare the checkpoint's model with ``engine``'s.

    Raises:
        CheckpointError: listing every difference: names only one side has, tied names that differ,
            parameter/buffer kind, shape or requires_grad mismatches, or an optimizer param group whose
            parameters were saved in groups with different hyperparameters.
    """
    params, buffers, keys = describe_model(engine)
    mine = {a: r for r in params + buffers for a in r.aliases}
    theirs = {a: r for r in meta.params + meta.buffers for a in r.aliases}
    kind_mine = {a: kind for kind, rs in (("parameter", params), ("buffer", buffers))
                 for r in rs for a in r.aliases}
    kind_theirs = {a: kind for kind, rs in (("parameter", meta.params), ("buffer", meta.buffers))
                   for r in rs for a in r.aliases}
    problems = []
    for k in meta.state_dict_keys:
        if k not in mine:
            problems.append(f"checkpoint has {kind_theirs[k]} {k!r} that the model lacks")
    for k in keys:
        if k not in theirs:
            problems.append(f"model has {kind_mine[k]} {k!r} missing from checkpoint")
    for k in keys:
        if k not in theirs:
            continue
        a, b = theirs[k], mine[k]
        if k != b.name:
            continue  # report each tensor once, under its first name
        if sorted(a.aliases) != sorted(b.aliases):
            problems.append(f"tied names differ: checkpoint ties {sorted(a.aliases)}, model ties "
                            f"{sorted(b.aliases)}")
        if kind_theirs[k] != kind_mine[k]:
            problems.append(f"{k!r} is a {kind_theirs[k]} in the checkpoint but a {kind_mine[k]} in the model")
        elif a.shape != b.shape:
            problems.append(f"{kind_mine[k]} {k!r} has shape {a.shape} in the checkpoint but {b.shape} in the "
                            "model")
        elif kind_mine[k] == "parameter" and a.requires_grad != b.requires_grad:
            problems.append(f"parameter {k!r} has requires_grad={a.requires_grad} in the checkpoint but "
                            f"{b.requires_grad} in the model")
    if not problems:
        for i, names in enumerate(_optimizer_group_names(engine)):
            try:
                group_hyperparameters(meta, names)
            except CheckpointError as e:
                problems.append(f"optimizer param group {i}: {e}")
    if problems:
        raise CheckpointError("; ".join(problems))


@dataclass
class _StagedLoad:
    """Everything read from a checkpoint, ready to be copied in (nothing touched yet)."""

    path: Path
    meta: CheckpointMeta
    values: list[tuple[torch.Tensor, torch.Tensor]]  # (live tensor, new values)
    states: list[tuple[torch.Tensor, Optional[dict[str, torch.Tensor]]]]  # (optimizer param, new state)
    rng: dict[str, torch.Tensor]
    hyperparameters: list[Optional[dict[str, Any]]]  # per optimizer param group; None: leave as is
    loss_scaler: Optional[dict[str, Any]] = None  # None: leave the engine's as is
    lr_scheduler: Optional[dict[str, Any]] = None  # state_dict() entries to load; None: leave as is


def _stage_load(engine: "Engine", layout: CheckpointLayout, reader: CheckpointReader) -> _StagedLoad:
    named: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, live tensor, new values)
    for t in layout.value_targets(engine):
        named.append((t.name, t.tensor, reader.read_values(t.name, t.start, t.end).reshape(t.tensor.shape)))
    for name, live in layout.extra_targets(engine).items():
        named.append((name, live, reader.read_values(name, 0, live.numel()).reshape(live.shape)))
    theirs, mine = reader.meta.effective_precision(), engine_precision(engine)
    if theirs != mine:
        _check_representable(reader.path, named, theirs, mine)
    values = [(live, new) for _, live, new in named]
    groups_by_piece = {}
    for pg in engine.optimizer.param_groups:
        for p in pg["params"]:
            groups_by_piece[id(p)] = pg
    states: list[tuple[torch.Tensor, Optional[dict[str, torch.Tensor]]]] = []
    for g in engine.groups:
        for piece in g.pieces:
            rec = reader.record(piece.slot.name)
            start, end = piece.lo - piece.slot.offset, piece.hi - piece.slot.offset
            param = _piece_value(piece)  # the optimizer's parameter
            if param is not piece.tensor:  # a master copy: loaded besides the flat buffer (value_targets)
                values.append((param, reader.read_values(rec.name, start, end).reshape(param.shape)))
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
    rng = reader.read_rng(engine.rank) if reader.meta.world_size == engine.world_size else {}
    hps = [group_hyperparameters(reader.meta, names) for names in _optimizer_group_names(engine)]
    scaler, saved_scaler = getattr(engine, "loss_scaler", None), reader.meta.loss_scaler
    scaler_state = (dict(saved_scaler) if scaler is not None and scaler.dynamic and saved_scaler is not None
                    and saved_scaler["dynamic"] else None)
    scheduler, saved_scheduler = getattr(engine, "lr_scheduler", None), reader.meta.lr_scheduler
    scheduler_state = (copy.deepcopy(saved_scheduler["state"]) if scheduler is not None and saved_scheduler
                       is not None and saved_scheduler["type"] == type(scheduler).__name__ else None)
    return _StagedLoad(reader.path, reader.meta, values, states, rng, hps, scaler_state, scheduler_state)


def _check_representable(path: Path, named: list[tuple[str, torch.Tensor, torch.Tensor]], theirs: str,
                         mine: str) -> None:
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
            f"{' and others' if len(names) > 5 else ''} exceed the largest finite {_dtype_name(dtype)} "
            f"({torch.finfo(dtype).max:g}) and would become inf; load it into an engine with {theirs} or fp32")


def load_checkpoint(engine: "Engine", load_dir: PathLike, tag: Optional[str] = None) -> tuple[Path, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``engine``, any world size or stage.

    Collective: every rank calls it. Every rank reads ``meta.json``, checks it against the engine and
    every file against ``meta.json``, and reads what it needs into new tensors; only when every rank
    succeeded are parameters (fp32 masters and the module's, possibly lower-precision, copy), frozen
    parameters, buffers, optimizer state (pieces whose parameter had
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

    Returns:
        (checkpoint directory, the ``client_state`` given to :func:`save_checkpoint`).

    Raises:
        CheckpointError (on every rank, before anything is changed): no such checkpoint; ``meta.json``
            missing, corrupt or of another version; a rank file missing, truncated or not matching
            ``meta.json``; saved pieces not covering a parameter; the model differs (names each
            missing or extra name, shape or requires_grad mismatch); saved with another precision and
            holding values this engine's dtype cannot represent (see [Note: precision]).
    """
    layout = layout_for(engine)

    def stage() -> _StagedLoad:
        path = resolve_checkpoint(load_dir, tag)
        with CheckpointReader(path) as reader:
            try:
                check_compatible(reader.meta, engine)
            except CheckpointError as e:
                raise CheckpointError(f"checkpoint {path} does not fit this model: {e}") from None
            reader.validate_files()
            return _stage_load(engine, layout, reader)

    staged: _StagedLoad = _collectively(engine, "load_checkpoint", stage)
    layout.before_load(engine)
    with torch.no_grad():
        for live, new in staged.values:
            live.copy_(new)
    opt = engine.optimizer
    for param, st in staged.states:
        opt.state.pop(param, None)
        if st is not None:
            opt.state[param] = st
    same_optimizer = staged.meta.optimizer == type(opt).__name__
    for pg, hp in zip(opt.param_groups, staged.hyperparameters):
        if hp is not None:
            _restore_hyperparameters(pg, hp, same_optimizer)
    if staged.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(staged.lr_scheduler)
    if staged.loss_scaler is not None:
        engine.loss_scaler.load_state_dict(staged.loss_scaler)
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
    engine.reducer.zero_grads()
    layout.after_load(engine)
    return staged.path, staged.meta.client_state


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


# ---- consolidation -----------------------------------------------------------------------------------
def load_full_state_dict(checkpoint_dir: PathLike, tag: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The full state dict stored in a checkpoint (see :meth:`CheckpointReader.full_state_dict`); needs
    no process group.

    Raises:
        CheckpointError: as :func:`resolve_checkpoint`, :func:`read_meta` and
            :meth:`CheckpointReader.validate_files`.
    """
    with CheckpointReader(resolve_checkpoint(checkpoint_dir, tag)) as reader:
        reader.validate_files()
        return reader.full_state_dict()


def consolidate(checkpoint_dir: PathLike, out_path: PathLike, tag: Optional[str] = None) -> Path:
    """Write a checkpoint's full state dict, keyed like ``model.state_dict()`` (every tied name, as its
    own tensor; buffers included; floating tensors fp32 (fp64 stays fp64): trained parameters are the
    fp32 master values of a bf16/fp16 run, its frozen parameters and buffers are cast up), to one file
    loadable without zerodp.

    Pure function: no process group, CPU only, reads only the checkpoint's files.

    Args:
        checkpoint_dir: a ``save_dir`` (its ``latest`` or ``tag`` is used) or a checkpoint directory.
        out_path: ``*.safetensors`` (``safetensors.torch.load_file``) or ``*.pt``/``*.pth``
            (``torch.load(weights_only=True)``); written atomically, parent directories created.
        tag: checkpoint within ``checkpoint_dir``; default ``latest``.

    Returns:
        ``out_path`` as a Path.

    Raises:
        CheckpointError: an unknown extension, or the checkpoint cannot be read (see
            :func:`load_full_state_dict`).
    """
    out = Path(out_path)
    if out.suffix not in (".safetensors", ".pt", ".pth"):
        raise CheckpointError(f"cannot tell the format of {out}: use a .safetensors or .pt file name")
    sd = {k: (v.to(value_dtype(v.dtype)) if v.is_floating_point() else v).contiguous()
          for k, v in load_full_state_dict(checkpoint_dir, tag).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if out.suffix == ".safetensors":
        save_file(sd, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(sd, tmp)
    _fsync(tmp)
    os.replace(tmp, out)
    return out


__all__ = [
    "CheckpointError", "CheckpointMeta", "CheckpointLayout", "ReplicatedParamsLayout", "ShardedParamsLayout",
    "LAYOUTS",
    "save_checkpoint", "load_checkpoint", "module_state_dict", "consolidate", "load_full_state_dict",
    "resolve_checkpoint", "read_meta",
]


def _keyed_like_state_dict(engine: "Engine", full: dict[int, torch.Tensor],
                           other: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
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
