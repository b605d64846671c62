"""Finding and reading a checkpoint without a process group: resolving ``latest`` (and a save killed
mid-rename), checking every file against ``meta.json``, and reading ranges of saved tensors."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from zerodp.checkpoint import integrity
from zerodp.checkpoint.format import (
    EXTRA_FILE,
    LATEST_FILE,
    META_FILE,
    OLD_PREFIX,
    PARAM_KEY,
    RNG_PREFIX,
    TMP_PREFIX,
    CheckpointError,
    PathLike,
    check_tag,
    parse_dtype,
    value_dtype,
)
from zerodp.checkpoint.meta import PieceRecord, RankRecord, TensorRecord, read_meta


def resolve_checkpoint(checkpoint_dir: PathLike, tag: str | None = None) -> Path:
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
            raise CheckpointError(
                f"no checkpoint in {d}: it has neither a {LATEST_FILE!r} file nor a "
                f"{META_FILE}; name one with a tag (--tag in the CLI)" + foreign_format_hint(d)
            )
    path = d / check_tag(tag)
    if (path / META_FILE).is_file():
        return path
    # A save replacing ``tag`` was killed between moving the old directory aside and renaming the new
    # one into place: the new one is complete once its meta.json exists (written last), else the old one.
    for candidate in [d / f"{TMP_PREFIX}{tag}", *sorted(d.glob(f"{OLD_PREFIX}{tag}-*"))]:
        if not path.exists() and (candidate / META_FILE).is_file():
            return candidate
    raise CheckpointError(f"checkpoint {path} does not exist or has no {META_FILE}" + foreign_format_hint(path))


#: file names DeepSpeed's engine writes into a checkpoint tag directory (not zerodp's format)
DEEPSPEED_FILE_PATTERNS = ("mp_rank_*_model_states.pt", "*zero_pp_rank_*_optim_states.pt", "zero_to_fp32.py")


def foreign_format_hint(path: Path) -> str:
    """A sentence for a directory that holds a DeepSpeed checkpoint instead of zerodp's; "" otherwise."""
    if not path.is_dir() or not any(next(path.glob(pat), None) is not None for pat in DEEPSPEED_FILE_PATTERNS):
        return ""
    return (
        f": {path} holds a DeepSpeed checkpoint ({', '.join(DEEPSPEED_FILE_PATTERNS[:2])}), which zerodp "
        "cannot read (its format pickles DeepSpeed's own objects). Convert it to full weights with the "
        "zero_to_fp32.py script DeepSpeed saves next to it, load them into the model before "
        "zerodp.initialize, and save a zerodp checkpoint from there"
    )


class AbsentParametersWarning(UserWarning):
    """A full state dict read from a checkpoint lacks frozen parameters that were saved with
    ``exclude_frozen_parameters=True``."""


def absent_message(absent: list[str], path: Path) -> str:
    """What to tell the user about the ``absent`` state_dict keys of checkpoint ``path``."""
    return (
        f"{len(absent)} frozen parameter(s) are absent from checkpoint {path} (saved with "
        f"exclude_frozen_parameters=True, only trained parameters and their optimizer states): "
        f"{', '.join(absent)}. Load them from their own source (e.g. the base model's weights)"
    )


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
        # (file, tensor) -> CRC-32 recorded in meta.json (version >= 2); verified on first read
        self._crc32: dict[tuple[str, str], int] = {}
        for rr in self.meta.ranks:
            self._crc32.update({(rr.file, k): v for k, v in (rr.crc32 or {}).items()})
        self._crc32.update({(EXTRA_FILE, k): v for k, v in (self.meta.extra_crc32 or {}).items()})
        self._verified: set[tuple[str, str]] = set()
        self.excluded: set[str] = set(self.meta.excluded_frozen)  # frozen parameters not saved

    def absent_keys(self) -> list[str]:
        """The state_dict keys (every alias) whose values the checkpoint does not hold: frozen
        parameters saved with ``exclude_frozen_parameters=True``; [] otherwise."""
        return [k for k in self.meta.state_dict_keys if self.canonical[k] in self.excluded]

    def warn_absent(self) -> None:
        """Warn (:class:`AbsentParametersWarning`) naming the frozen parameters the checkpoint does not
        hold, if any: a consolidated or exported state dict lacks them."""
        absent = self.absent_keys()
        if absent:
            warnings.warn(AbsentParametersWarning(absent_message(absent, self.path)), stacklevel=3)

    def _in_extra(self, rec: TensorRecord) -> bool:
        return not rec.trained and rec.name not in self.excluded

    def __enter__(self) -> CheckpointReader:
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
            expected: dict[str, list[int] | None] = {RNG_PREFIX + k: None for k in rr.rng}
            for p in rr.pieces:
                expected[p.key(PARAM_KEY)] = [p.numel]
                expected.update({p.key(k): shape for k, shape in p.state.items()})
            self._check_file(rr.file, expected)
        extras: dict[str, list[int] | None] = {r.name: r.shape for r in self.records.values() if self._in_extra(r)}
        self._check_file(EXTRA_FILE, extras)

    def _check_file(self, name: str, expected: Mapping[str, list[int] | None]) -> None:
        f = self._open(name)
        try:
            actual = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:
            raise CheckpointError(f"checkpoint file {self.path / name} is corrupt: {e}") from None
        missing, unexpected = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint file {self.path / name} does not match {META_FILE}: missing "
                f"tensors {missing[:5]}, unexpected tensors {unexpected[:5]}"
            )
        for k, shape in expected.items():
            if shape is not None and actual[k] != shape:
                raise CheckpointError(
                    f"checkpoint file {self.path / name}: tensor {k!r} has shape {actual[k]}, {META_FILE} says {shape}"
                )

    def _read(self, file: str, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        try:
            f = self._open(file)
            expected = self._crc32.get((file, key))
            if expected is None or (file, key) in self._verified:
                return f.get_tensor(key) if lo is None else f.get_slice(key)[lo:hi]
            full = f.get_tensor(key)  # read whole once, to check its checksum
            integrity.check(str(self.path / file), key, full, expected)
            self._verified.add((file, key))
            return full if lo is None else full[lo:hi]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read {key!r} from {self.path / file}: {e}") from None

    def verify_all(self) -> tuple[int, int, int]:
        """Check every file against ``meta.json`` and every tensor against its recorded checksum
        (version >= 2; a version-1 checkpoint has none, so only names and shapes are checked).

        Returns:
            (files, tensors, bytes of tensor data read).

        Raises:
            CheckpointError: the first problem found, naming the file (and tensor).
        """
        self.validate_files()
        files = [(rr.file, rr.tensor_names()) for rr in self.meta.ranks]
        files.append((EXTRA_FILE, [r.name for r in self.records.values() if self._in_extra(r)]))
        tensors = nbytes = 0
        for file, names in files:
            for key in names:
                t = self._read(file, key)
                tensors += 1
                nbytes += t.numel() * t.element_size()
        return len(files), tensors, nbytes

    @property
    def has_checksums(self) -> bool:
        """Whether ``meta.json`` records checksums (format version >= 2)."""
        return self.meta.version >= 2

    def record(self, name: str) -> TensorRecord:
        """The record of the tensor that state_dict name ``name`` (any alias) refers to."""
        return self.records[self.canonical[name]]

    def read_values(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of flattened tensor ``name`` (any alias): fp32 for trained
        parameters (assembled from the overlapping pieces), the stored dtype otherwise. 1-D.

        Raises:
            CheckpointError: ``name`` is a frozen parameter left out of the checkpoint.
        """
        rec = self.record(name)
        if rec.name in self.excluded:
            raise CheckpointError(
                f"frozen parameter {rec.name!r} is not in checkpoint {self.path}: it was saved "
                "with exclude_frozen_parameters=True (only trained parameters)"
            )
        if not rec.trained:
            return self._read(EXTRA_FILE, rec.name).reshape(-1)[start:end]
        return self.read_range(PARAM_KEY, rec.name, start, end, value_dtype(parse_dtype(rec.dtype)))

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
        values = [
            self._read(rr.file, p.key(kind))
            for rr, p in self.pieces.get(name, [])
            if max(start, p.start) < min(end, p.end)
        ]
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
        trained parameters in fp32, frozen parameters and buffers in their dtype. Frozen parameters
        left out of the checkpoint (:meth:`absent_keys`) are absent."""
        full = {
            r.name: r.unflatten(self.read_values(r.name, 0, r.numel))
            for r in self.records.values()
            if r.name not in self.excluded
        }
        out: dict[str, torch.Tensor] = {}
        for k in self.meta.state_dict_keys:
            name = self.canonical[k]
            if name in self.excluded:
                continue
            out[k] = full[name] if k == name else full[name].clone()
        return out
