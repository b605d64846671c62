"""Streaming consolidation into HF-style sharded safetensors: ``model-0000k-of-0000n.safetensors`` files
plus ``model.safetensors.index.json``, written tensor by tensor so that the whole model is never held
in memory (a model larger than RAM can be exported).

The shard plan comes from ``meta.json`` alone (names, shapes, dtypes): tensors are assigned to shards
in ``state_dict`` order, a new shard starting when the next tensor would push the current one past
``max_shard_size`` (HF ``save_pretrained``'s rule; a tensor larger than the limit gets a shard of its
own). Each shard's safetensors header is therefore known before any value is read; the file is written
as the header followed by each tensor's bytes, every tensor assembled from the checkpoint's pieces,
written and dropped before the next is read. Peak memory: about two copies of the largest tensor
(its assembled fp32 values and the piece being read), independent of the model and shard sizes.

The values are those of :func:`zerodp.checkpoint.consolidate` (fp32 trained parameters, i.e. the
masters of a bf16/fp16 run; frozen parameters and buffers cast up to fp32 if floating; every tied name
as its own tensor), so the directory loads with :func:`zerodp.checkpoint.load_safetensors_weights`,
``safetensors.torch.load_file`` per shard, or HF ``from_pretrained`` (with the model's
``config.json`` next to it).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerodp.checkpoint.durable import fsync, fsync_dir, write_text
from zerodp.checkpoint.format import CheckpointError, PathLike, parse_dtype, prod, value_dtype
from zerodp.checkpoint.reader import CheckpointReader, resolve_checkpoint
from zerodp.checkpoint.safetensors_dir import INDEX_FILE

#: HF ``save_pretrained``'s default ``max_shard_size``
DEFAULT_MAX_SHARD_SIZE = "5GB"
SHARD_NAME = "model-{k:05d}-of-{n:05d}.safetensors"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like HF's ``"5GB"`` (10^9), ``"500MiB"`` (2^20), ``"40KB"``.

    Raises:
        ValueError: not a positive size in one of those forms.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if not m or m.group(2) not in _UNITS:
            raise ValueError(
                f"max shard size {size!r}: give bytes or a number with KB, MB, GB, TB (powers of "
                "1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '5GB'"
            )
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n <= 0:
        raise ValueError(f"max shard size must be positive, got {size!r}")
    return n


@dataclass
class PlannedTensor:
    """One output tensor: its state_dict name, shape, output dtype and byte range in its shard's data."""

    key: str
    shape: list[int]
    dtype: torch.dtype
    begin: int
    end: int


@dataclass
class Shard:
    file: str
    tensors: list[PlannedTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.tensors[-1].end if self.tensors else 0


def output_dtype(stored: str) -> torch.dtype:
    """dtype a tensor is exported in: floating -> fp32 (fp64 stays), others as stored.

    Raises:
        CheckpointError: the dtype has no safetensors name here (complex, float8, unsigned > 8 bit).
    """
    dtype = parse_dtype(stored)
    out = value_dtype(dtype) if dtype.is_floating_point else dtype
    if out not in _ST_DTYPES:
        raise CheckpointError(
            f"cannot export a tensor of dtype {stored} to safetensors here "
            f"(supported: {', '.join(str(d).removeprefix('torch.') for d in _ST_DTYPES)})"
        )
    return out


def plan_shards(reader: CheckpointReader, max_shard_bytes: int) -> list[Shard]:
    """Assign every state_dict entry of the checkpoint to a shard (see the module docstring)."""
    shards: list[Shard] = []
    current: list[PlannedTensor] = []
    size = 0
    for key in reader.meta.state_dict_keys:
        rec = reader.record(key)
        if rec.name in reader.excluded:  # a frozen parameter left out of the checkpoint
            continue
        dtype = output_dtype(rec.dtype)
        nbytes = prod(rec.shape) * torch.empty(0, dtype=dtype).element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(Shard("", current))
            current, size = [], 0
        current.append(PlannedTensor(key, list(rec.shape), dtype, size, size + nbytes))
        size += nbytes
    if current or not shards:
        shards.append(Shard("", current))
    for k, s in enumerate(shards, start=1):
        s.file = SHARD_NAME.format(k=k, n=len(shards))
    return shards


def _header(shard: Shard) -> bytes:
    head: dict = {"__metadata__": {"format": "pt"}}
    for t in shard.tensors:
        head[t.key] = {"dtype": _ST_DTYPES[t.dtype], "shape": t.shape, "data_offsets": [t.begin, t.end]}
    raw = json.dumps(head, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes with spaces
    return len(raw).to_bytes(8, "little") + raw


def _write_shard(reader: CheckpointReader, shard: Shard, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_header(shard))
        for t in shard.tensors:
            rec = reader.record(t.key)
            values = reader.read_values(t.key, 0, rec.numel).to(t.dtype).contiguous()
            data = values.reshape(-1).view(torch.uint8)
            if data.numel() != t.end - t.begin:
                raise CheckpointError(f"{t.key}: read {data.numel()} bytes, meta.json implies {t.end - t.begin}")
            f.write(memoryview(data.numpy()))  # type: ignore[arg-type]  # numpy arrays are buffers; typeshed's Buffer misses it
            del values, data
    fsync(tmp)
    os.replace(tmp, path)


def write_safetensors_streaming(reader: CheckpointReader, out_path: Path) -> None:
    """The whole state dict as one safetensors file, written tensor by tensor (header first) as the
    shards are: memory stays at about two copies of the largest tensor. ``out_path`` is written as
    ``out_path.tmp``, fsynced and renamed."""
    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; exporting on a big-endian host is not supported")
    whole = plan_shards(reader, max_shard_bytes=2**63)[0]
    _write_shard(reader, whole, out_path)


def export_sharded_safetensors(
    checkpoint_dir: PathLike,
    out_dir: PathLike,
    tag: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    verify: bool = True,
) -> Path:
    """Write a checkpoint's full state dict as HF-style sharded safetensors in ``out_dir``, streaming.

    Pure function: no process group, CPU only, reads only the checkpoint's files. Shards are written
    as ``*.tmp`` and renamed; the index is written last (atomically); shard files of an earlier export
    with another shard count (``model-*-of-*.safetensors`` not in the new index) are removed.

    Args:
        checkpoint_dir: a ``save_dir`` (its ``latest`` or ``tag`` is used) or a checkpoint directory.
        out_dir: output directory (created).
        tag: checkpoint within ``checkpoint_dir``; default ``latest``.
        max_shard_size: bytes per shard at most (unless one tensor is larger), int or e.g. ``"5GB"``.
        verify: first check every file and tensor checksum of the checkpoint (one streaming pass,
            optimizer state included), as :func:`zerodp.checkpoint.consolidate` does.

    Returns:
        the index file's path (``out_dir/model.safetensors.index.json``).

    Warns:
        AbsentParametersWarning: naming frozen parameters saved with ``exclude_frozen_parameters=True``
            (not in the output).

    Raises:
        CheckpointError: the checkpoint cannot be read or is corrupt; ``out_dir`` is a file.
        ValueError: ``max_shard_size`` is not a positive size.
    """
    limit = parse_size(max_shard_size)
    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; exporting on a big-endian host is not supported")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory (sharded output needs a directory)")
    with CheckpointReader(resolve_checkpoint(checkpoint_dir, tag)) as reader:
        if verify:
            reader.verify_all()  # streams: one tensor at a time
        shards = plan_shards(reader, limit)
        reader.warn_absent()
        out.mkdir(parents=True, exist_ok=True)
        for shard in shards:
            _write_shard(reader, shard, out / shard.file)
    index = {
        "metadata": {"total_size": sum(s.nbytes for s in shards)},
        "weight_map": {t.key: s.file for s in shards for t in s.tensors},
    }
    write_text(out / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    keep = {s.file for s in shards}
    for stale in out.iterdir():
        if _SHARD_RE.fullmatch(stale.name) and stale.name not in keep:
            stale.unlink()
    fsync_dir(out)
    return out / INDEX_FILE
