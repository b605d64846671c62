"""``meta.json``: the pydantic schema of a checkpoint's metadata, its consistency checks and its JSON form.

The models are strict (a JSON ``"2"`` is not an int, ``true`` is not an int) and every problem is
reported as a :class:`~zerodp.checkpoint.format.CheckpointError` naming the place (``meta.json``,
``params[3]``, ``ranks[0].pieces[1]``), the key and what was expected. Keys added after version 1
(``precision``, ``skipped_steps``, ``loss_scaler``, ``lr_scheduler``, ``excluded_frozen``) are optional
when reading;
unknown keys are ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from zerodp.checkpoint.format import (
    FORMAT,
    META_FILE,
    PRECISIONS,
    READABLE_VERSIONS,
    RNG_PREFIX,
    CheckpointError,
    piece_key,
    prod,
)


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class PieceRecord(_Record):
    """Elements ``[start, end)`` of flattened parameter ``name`` saved in one rank file.

    ``state`` maps each optimizer-state key to its stored shape: ``[]`` for a scalar (``step``),
    ``[end - start]`` for a per-element tensor (``exp_avg``, ``exp_avg_sq``); empty when the parameter
    had no optimizer state (it never received a gradient).
    """

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    name: str
    start: int
    end: int
    state: dict[str, list[int]] = Field(default_factory=dict)

    @property
    def numel(self) -> int:
        """``end - start`` elements."""
        return self.end - self.start

    def key(self, kind: str) -> str:
        """Tensor name in the rank file: ``<kind>/<name>/<start>-<end>`` (kind ``param`` or a state key)."""
        return piece_key(kind, self.name, self.start, self.end)


class RankRecord(_Record):
    """One rank file: its pieces and which RNG states it holds (``torch_cpu``, ``torch_cuda``)."""

    rank: int
    file: str
    pieces: list[PieceRecord]
    rng: list[str]
    crc32: dict[str, int] | None = None  # tensor name -> CRC-32 of its bytes (version >= 2)

    def tensor_names(self) -> list[str]:
        """Every tensor the rank file holds: each piece's values and state entries, the RNG states."""
        names = [RNG_PREFIX + k for k in self.rng]
        for p in self.pieces:
            names += [p.key("param")] + [p.key(k) for k in p.state]
        return names


class MisrecordedFreezeError(CheckpointError):
    """``meta.json`` written by an older zerodp while a trained parameter was frozen mid-run: it records
    the parameter as not trained although the rank files hold its pieces (not corrupt, not loadable)."""


class TensorRecord(_Record):
    """A parameter or persistent buffer of the module, under its first ``state_dict`` name.

    ``trained``: optimized by the engine (covered by its optimizer partitions, fixed at
    ``zerodp.initialize``), so its values are in the rank files' pieces (fp32); otherwise (parameters
    frozen at initialize, buffers) they are in ``model_extra.safetensors`` in ``dtype``.
    ``requires_grad``: the flag when saved; a trained parameter frozen mid-run has ``False`` (loading
    does not change a model's flags). Older zerodp versions recorded such a parameter as not trained
    while writing its pieces; :meth:`CheckpointMeta.validate` refuses those checkpoints by name.
    """

    name: str
    aliases: list[str]  # every state_dict name of this tensor (tied weights), ``name`` first
    shape: list[int]
    numel: int
    dtype: str  # the module's dtype, e.g. "float32"
    requires_grad: bool
    trained: bool
    #: element order of the stored values: the parameter's strides when it is dense but not row-major
    #: (``channels_last``, see ParamSlot.view); None (and in older checkpoints): row-major
    strides: list[int] | None = None

    def unflatten(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (1-D, ``numel``, in stored order) as a tensor of ``shape`` (in its memory format)."""
        if self.strides is None:
            return values.reshape(self.shape)
        return values.contiguous().as_strided(self.shape, self.strides)


class GroupRecord(_Record):
    """One optimizer param group: its parameters (by name) and hyperparameters (lr, betas, ...)."""

    index: int
    names: list[str]
    hyperparameters: dict[str, Any]


class LossScalerRecord(_Record):
    """The fp16 dynamic loss scaler's state (``LossScaler.state_dict()`` plus ``dynamic``)."""

    dynamic: bool
    scale: float = Field(gt=0)  # an int is accepted (JSON writes 65536.0 as 65536.0, users may not)
    hysteresis_left: int
    clean_steps: int


class SchedulerRecord(_Record):
    """The LR scheduler: class name and the JSON-serialisable entries of its ``state_dict()``."""

    type: str
    state: dict[str, Any]


class CheckpointMeta(_Record):
    """Everything in ``meta.json``. See :mod:`zerodp.checkpoint`, [Note: format]."""

    format: str = FORMAT
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
    client_state: Any = None
    # mixed precision and schedules (absent from older checkpoints: these defaults)
    precision: str = ""  # "fp32", "bf16" or "fp16"; "" when not recorded (see :meth:`effective_precision`)
    skipped_steps: int = 0  # optimizer steps skipped because gradients overflowed (fp16)
    loss_scaler: LossScalerRecord | None = None
    lr_scheduler: SchedulerRecord | None = None
    extra_crc32: dict[str, int] | None = None  # model_extra tensor name -> CRC-32 (version >= 2)
    #: frozen parameters (first names) whose values are not in model_extra: saved with
    #: ``exclude_frozen_parameters=True`` (DeepSpeed PR 3953, LoRA checkpoints); loading keeps the engine's
    excluded_frozen: list[str] = Field(default_factory=list)
    torch_version: str = torch.__version__

    def to_json(self) -> str:
        """Pretty JSON: one line per record, short lists (shapes, names) inline; ``format`` first."""
        return _dump_json(self.model_dump(), "") + "\n"

    @classmethod
    def from_json(cls, obj: Any) -> CheckpointMeta:
        """Parse and check ``meta.json``'s content.

        Raises:
            CheckpointError: a key is missing or has the wrong type, the format or version is not this
                one, names repeat, pieces lie outside their parameter or do not cover a trained
                parameter, or pieces of one parameter disagree on which optimizer state exists.
        """
        if not isinstance(obj, dict):
            raise CheckpointError(f"meta.json: expected a JSON object, got {type(obj).__name__}")
        for key, typ in (("format", str), ("version", int)):
            if key not in obj:
                raise CheckpointError(f"meta.json: missing key {key!r}")
            if not isinstance(obj[key], typ) or isinstance(obj[key], bool):
                raise CheckpointError(f"meta.json: {key!r} should be {typ.__name__}, got {type(obj[key]).__name__}")
        if obj["format"] != FORMAT:
            raise CheckpointError(f"'format' is {obj['format']!r}, not {FORMAT!r}")
        if obj["version"] not in READABLE_VERSIONS:
            raise CheckpointError(
                f"format version {obj['version']} is not supported (this zerodp reads "
                f"versions {list(READABLE_VERSIONS)})"
            )
        data = dict(obj)
        data["torch_version"] = str(data.get("torch_version", ""))
        try:
            meta = cls.model_validate(data)
        except ValidationError as e:
            raise CheckpointError(_describe(e)) from None
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
            if r.name not in r.aliases or r.numel != prod(r.shape):
                raise CheckpointError(f"record {r.name!r}: name not among its aliases or numel != prod(shape)")
        if self.precision not in ("",) + PRECISIONS:
            raise CheckpointError(f"'precision' is {self.precision!r}; expected one of {list(PRECISIONS)}")
        frozen = {r.name for r in self.params if not r.trained}
        if len(set(self.excluded_frozen)) != len(self.excluded_frozen) or not set(self.excluded_frozen) <= frozen:
            raise CheckpointError(
                f"'excluded_frozen' must name distinct frozen parameters; got "
                f"{sorted(set(self.excluded_frozen) - frozen)[:5]} that are not"
            )
        if self.skipped_steps < 0:
            raise CheckpointError(f"'skipped_steps' is {self.skipped_steps}; expected >= 0")
        if len(self.ranks) != self.world_size or [r.rank for r in self.ranks] != list(range(self.world_size)):
            raise CheckpointError(f"'ranks' must list ranks 0..{self.world_size - 1} in order")
        self._check_pieces()
        if self.version >= 2:
            self._check_checksums_listed()

    def _check_pieces(self) -> None:
        """Every rank's optimizer pieces belong to trained parameters, lie inside them, have states of
        their shape, and together cover each trained parameter with one kind of state."""
        by_name = {r.name: r for r in self.params}
        covered: dict[str, list[PieceRecord]] = {r.name: [] for r in self.params if r.trained}
        for rr in self.ranks:
            for p in rr.pieces:
                rec = by_name.get(p.name)
                if rec is not None and not rec.trained and not rec.requires_grad:
                    raise MisrecordedFreezeError(
                        f"{rr.file} holds optimizer pieces of parameter {p.name!r}, which meta.json records "
                        "as not trained with requires_grad=False: this checkpoint was saved by an older "
                        f"zerodp while {p.name!r} was frozen mid-run (requires_grad_(False) after "
                        "zerodp.initialize), which recorded it wrongly; its values are not in model_extra "
                        "and it cannot be loaded. Save again with this version (freezing mid-run is "
                        "recorded correctly now)"
                    )
                if rec is None or not rec.trained:
                    raise CheckpointError(f"{rr.file} holds a piece of {p.name!r}, which is not a trained parameter")
                if not 0 <= p.start < p.end <= rec.numel:
                    raise CheckpointError(
                        f"{rr.file}: piece [{p.start}, {p.end}) of {p.name!r} lies outside its {rec.numel} elements"
                    )
                for k, shape in p.state.items():
                    if shape not in ([], [p.numel]):
                        raise CheckpointError(
                            f"{rr.file}: state {k!r} of {p.name!r} [{p.start}, {p.end}) has "
                            f"shape {shape}; expected [] or [{p.numel}]"
                        )
                covered[p.name].append(p)
        for name, pieces in covered.items():
            gap = _first_gap(pieces, by_name[name].numel)
            if gap is not None:
                raise CheckpointError(
                    f"the saved pieces of parameter {name!r} do not cover its elements "
                    f"(elements from {gap} are missing)"
                )
            kinds = {tuple(sorted(p.state)) for p in pieces}
            if len(kinds) > 1:
                raise CheckpointError(f"the pieces of parameter {name!r} disagree on its optimizer state")

    def _check_checksums_listed(self) -> None:
        """Version 2: every tensor of every file has exactly one recorded checksum."""
        for rr in self.ranks:
            if rr.crc32 is None or sorted(rr.crc32) != sorted(rr.tensor_names()):
                raise CheckpointError(f"{rr.file}: 'crc32' must list a checksum for each of its tensors")
        extra = sorted(
            r.name for r in self.params + self.buffers if not r.trained and r.name not in self.excluded_frozen
        )
        if self.extra_crc32 is None or sorted(self.extra_crc32) != extra:
            raise CheckpointError("'extra_crc32' must list a checksum for each frozen parameter and buffer")


def read_meta(path: Path) -> CheckpointMeta:
    """Parse ``path/meta.json``.

    Raises:
        CheckpointError: missing, not JSON, or not a valid meta (names the file and the problem).
    """
    file = Path(path) / META_FILE
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} is corrupt (not readable JSON): {e}") from None
    try:
        return CheckpointMeta.from_json(obj)
    except MisrecordedFreezeError as e:
        raise CheckpointError(f"{file}: {e}") from None
    except CheckpointError as e:
        raise CheckpointError(f"{file} is corrupt: {e}") from None


_TYPE_NAMES = {
    "int_type": "int",
    "string_type": "str",
    "bool_type": "bool",
    "list_type": "list",
    "dict_type": "dict",
    "float_type": "number",
    "model_type": "object",
}


def _describe(error: ValidationError) -> str:
    """The first problem of a pydantic error as ``<where>: <problem>``, e.g. ``meta.json: missing key
    'ranks'``, ``ranks[0].pieces[1]: 'start' should be int, got str``."""
    e = error.errors()[0]
    loc = list(e["loc"])
    key = loc.pop() if loc else None
    where = "meta.json"
    if loc:
        where = "".join(f"[{x}]" if isinstance(x, int) else (f".{x}" if i else str(x)) for i, x in enumerate(loc))
    if isinstance(key, int):  # an element of a list: name the list
        where, key = f"{where}[{key}]", None
    if e["type"] == "missing":
        return f"{where}: missing key {key!r}"
    name = _TYPE_NAMES.get(e["type"])
    what = f"{key!r}" if key is not None else "value"
    if name is not None:
        return f"{where}: {what} should be {name}, got {type(e['input']).__name__}"
    return f"{where}: {what}: {e['msg']} (got {e['input']!r})"


def _first_gap(pieces: list[PieceRecord], numel: int) -> int | None:
    """First element of ``[0, numel)`` no piece covers, or None."""
    reach = 0
    for p in sorted(pieces, key=lambda p: p.start):
        if p.start > reach:
            return reach
        reach = max(reach, p.end)
    return reach if reach < numel else None


def _dump_json(v: Any, indent: str) -> str:
    """Objects whose values are all scalars or lists of scalars go on one line; others are expanded."""

    def scalars(x: Any) -> bool:
        return isinstance(x, list) and all(map(_scalar, x))

    def flat(x: Any) -> bool:
        if isinstance(x, dict):
            return all(
                _scalar(y) or scalars(y) or (isinstance(y, dict) and all(map(scalars, y.values()))) for y in x.values()
            )
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
