"""Reading weights saved the way HF transformers saves them: one ``*.safetensors`` file, or a directory
with ``model.safetensors`` or shards listed by ``model.safetensors.index.json`` (``weight_map``: tensor
name -> shard file). The result is a plain state dict for :meth:`zerodp.engine.Engine.load_module_state_dict`.
Only safetensors are read (nothing is unpickled).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from zerodp.checkpoint.format import CheckpointError, PathLike

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def load_safetensors_weights(path: PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or of a directory holding ``model.safetensors`` or the shards
    of ``model.safetensors.index.json``, by name (CPU tensors in their stored dtype).

    Raises:
        CheckpointError: ``path`` is neither; the index is not JSON or has no ``weight_map``; a shard it
            names is missing or does not hold the tensors the index assigns to it; a shard is unreadable.
    """
    p = Path(path)
    if p.is_file():
        return _load(p)
    if not p.is_dir():
        raise CheckpointError(f"{p} does not exist")
    index = p / INDEX_FILE
    if not index.is_file():
        if (p / SINGLE_FILE).is_file():
            return _load(p / SINGLE_FILE)
        raise CheckpointError(f"{p} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a safetensors index (a JSON object with 'weight_map'): {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if "/" in shard or shard.startswith("."):
            raise CheckpointError(f"{index} names shard {shard!r}, which is not a file name in {p}")
        tensors = _load(p / shard)
        wanted = [k for k, v in weight_map.items() if v == shard]
        absent = [k for k in wanted if k not in tensors]
        if absent:
            raise CheckpointError(f"shard {p / shard} lacks {absent[:5]} which {INDEX_FILE} assigns to it")
        out.update({k: tensors[k] for k in wanted})
    return out


def _load(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise CheckpointError(f"safetensors file {file} is missing")
    try:
        return load_file(str(file))
    except Exception as e:  # safetensors raises its own error types on truncated/corrupt files
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None
