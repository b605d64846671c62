"""The on-disk vocabulary of a checkpoint: file names, tensor-name scheme, dtypes, tags, the error type.

See :mod:`zerodp.checkpoint` ([Note: format]) for the layout of a checkpoint directory. Everything
here is pure (no engine, no process group), so the reader and consolidation share it with saving.
"""

from __future__ import annotations

import os
from typing import Union

import torch

FORMAT = "zerodp-checkpoint"
VERSION = 2  # 2: per-tensor CRC-32 checksums (see zerodp.checkpoint.integrity)
#: versions this zerodp reads (1: no checksums, loaded unverified).
READABLE_VERSIONS = (1, 2)
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


def value_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype in which trained parameter values are stored and consolidated: fp32 (fp64 stays fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; an unknown name reads as fp32."""
    d = getattr(torch, name, None)
    return d if isinstance(d, torch.dtype) else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (as stored in ``meta.json``)."""
    return str(dtype).removeprefix("torch.")


def prod(shape: list[int]) -> int:
    """Number of elements of a tensor of ``shape`` (1 for ``[]``)."""
    n = 1
    for s in shape:
        n *= s
    return n


def check_tag(tag: str) -> str:
    """Return ``tag`` if it can name a checkpoint directory.

    Raises:
        CheckpointError: empty, a path (contains a separator), ``.``/``..``, starts with ``.``, or is
            ``latest``.
    """
    if (
        not isinstance(tag, str)
        or not tag
        or tag in (".", "..", LATEST_FILE)
        or tag.startswith(".")
        or "/" in tag
        or os.sep in tag
        or (os.altsep and os.altsep in tag)
        or "\n" in tag
    ):
        raise CheckpointError(
            f"invalid checkpoint tag {tag!r}: use a plain directory name (not starting with '.', not {LATEST_FILE!r})"
        )
    return tag


def rank_file(rank: int) -> str:
    """File name of data-parallel rank ``rank``'s pieces: ``rank{r}.safetensors``."""
    return f"rank{rank}.safetensors"


def piece_key(kind: str, name: str, start: int, end: int) -> str:
    """Tensor name in a rank file: ``<kind>/<name>/<start>-<end>`` (kind ``param`` or a state key)."""
    return f"{kind}/{name}/{start}-{end}"


def parse_key(key: str) -> tuple[str, str, int, int]:
    """``<kind>/<name>/<start>-<end>`` -> (kind, name, start, end); the name may contain '/'.

    Raises:
        CheckpointError: ``key`` does not have that form.
    """
    try:
        kind, rest = key.split("/", 1)
        name, span = rest.rsplit("/", 1)
        start, end = (int(x) for x in span.split("-"))
    except ValueError:
        raise CheckpointError(f"unexpected tensor name {key!r} in a rank file") from None
    return kind, name, start, end
