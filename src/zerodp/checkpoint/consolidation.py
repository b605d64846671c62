"""Consolidation: a checkpoint's full state dict, keyed like ``model.state_dict()``, read or written to
one file loadable without zerodp. Pure: no process group, CPU only."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from zerodp.checkpoint.durable import fsync
from zerodp.checkpoint.format import CheckpointError, PathLike, value_dtype
from zerodp.checkpoint.reader import CheckpointReader, resolve_checkpoint
from zerodp.checkpoint.sharded_export import write_safetensors_streaming


def load_full_state_dict(checkpoint_dir: PathLike, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The full state dict stored in a checkpoint (see :meth:`CheckpointReader.full_state_dict`); needs
    no process group. Frozen parameters saved with ``exclude_frozen_parameters=True`` are absent, with an
    :class:`~zerodp.checkpoint.reader.AbsentParametersWarning` naming them.

    Raises:
        CheckpointError: as :func:`resolve_checkpoint`, :func:`read_meta` and
            :meth:`CheckpointReader.verify_all` (a tensor whose bytes do not match its checksum).
    """
    with CheckpointReader(resolve_checkpoint(checkpoint_dir, tag)) as reader:
        reader.verify_all()  # every tensor of every file, optimizer state included: a corrupt checkpoint
        reader.warn_absent()  # is refused even where the weights happen to be intact
        return reader.full_state_dict()


def consolidate(checkpoint_dir: PathLike, out_path: PathLike, tag: str | None = None) -> Path:
    """Write a checkpoint's full state dict, keyed like ``model.state_dict()`` (every tied name, as its
    own tensor; buffers included; floating tensors fp32 (fp64 stays fp64): trained parameters are the
    fp32 master values of a bf16/fp16 run, its frozen parameters and buffers are cast up), to one file
    loadable without zerodp. Frozen parameters saved with ``exclude_frozen_parameters=True`` are not in
    it; an :class:`~zerodp.checkpoint.reader.AbsentParametersWarning` names them.

    Pure function: no process group, CPU only, reads only the checkpoint's files.

    Args:
        checkpoint_dir: a ``save_dir`` (its ``latest`` or ``tag`` is used) or a checkpoint directory.
        out_path: ``*.safetensors`` (``safetensors.torch.load_file``; written tensor by tensor, so the
            whole model is never in memory, see :mod:`zerodp.checkpoint.sharded_export`) or
            ``*.pt``/``*.pth`` (``torch.load(weights_only=True)``; built in memory first); written
            atomically, parent directories created.
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
    if out.suffix == ".safetensors":  # streamed: never more than about two copies of the largest tensor
        with CheckpointReader(resolve_checkpoint(checkpoint_dir, tag)) as reader:
            reader.verify_all()
            reader.warn_absent()
            out.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors_streaming(reader, out)
        return out
    sd = {
        k: (v.to(value_dtype(v.dtype)) if v.is_floating_point() else v).contiguous()
        for k, v in load_full_state_dict(checkpoint_dir, tag).items()
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(sd, tmp)
    fsync(tmp)
    os.replace(tmp, out)
    return out
