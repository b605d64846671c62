"""Saving a checkpoint: every rank writes its pieces into ``save_dir/.tmp-<tag>``, rank 0 writes
``model_extra``, ``meta.json`` and publishes the directory with renames (see :mod:`zerodp.checkpoint`,
[Note: format] and [Note: crash safety])."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zerodp.checkpoint import integrity
from zerodp.checkpoint.collective import check_same_on_ranks, collectively
from zerodp.checkpoint.durable import fsync, fsync_dir, write_text
from zerodp.checkpoint.engine_state import (
    describe_model,
    engine_precision,
    group_records,
    loss_scaler_state,
    piece_value,
    scheduler_state,
)
from zerodp.checkpoint.format import (
    EXTRA_FILE,
    FORMAT,
    LATEST_FILE,
    META_FILE,
    OLD_PREFIX,
    PARAM_KEY,
    RNG_PREFIX,
    TMP_PREFIX,
    VERSION,
    CheckpointError,
    PathLike,
    check_tag,
    dtype_name,
    parse_key,
    rank_file,
    value_dtype,
)
from zerodp.checkpoint.layout import CheckpointLayout, layout_for
from zerodp.checkpoint.meta import CheckpointMeta, PieceRecord, RankRecord
from zerodp.checkpoint.protocol import CheckpointableEngine as Engine


def save_checkpoint(
    engine: Engine,
    save_dir: PathLike,
    tag: str | None = None,
    client_state: Mapping[str, Any] | None = None,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Write a checkpoint of ``engine`` to ``save_dir/<tag>`` and point ``save_dir/latest`` at it.

    Collective: every rank of the engine's group must call it with the same ``save_dir`` and ``tag``.
    See [Note: format] and [Note: crash safety].

    Args:
        save_dir: directory holding checkpoints (created if needed; visible to every rank).
        tag: checkpoint name; default ``global_step{engine.global_steps}``. A checkpoint with the same
            tag is replaced.
        client_state: JSON-serialisable data returned by :func:`load_checkpoint` (rank 0's is kept; it
            comes back as JSON does: tuples as lists, non-string dict keys as strings).
        exclude_frozen_parameters: leave out the values of the parameters the engine does not train
            (frozen at ``zerodp.initialize``; DeepSpeed PR 3953, for LoRA-style checkpoints): only trained
            parameters, their optimizer states and the buffers are written, and ``meta.json`` lists the
            left-out names (``excluded_frozen``). Loading keeps the loading engine's values for them;
            consolidation leaves them out and names them. At stage 3 they are then not gathered.

    Returns:
        The checkpoint directory ``save_dir/<tag>``.

    Raises:
        CheckpointError (on every rank): the ranks passed different ``save_dir``s or tags (names each
            rank's), ``client_state`` is not JSON-serialisable, the tag is not a plain
            directory name, the engine is in the middle of gradient accumulation, or a rank failed to
            write (its own rank re-raises the original error); the previous checkpoint is intact.
    """
    check_same_on_ranks(engine, "save_checkpoint", {"save_dir": Path(save_dir), "tag": tag})
    layout = layout_for(engine)
    save_dir = Path(save_dir)
    tag = f"global_step{engine.global_steps}" if tag is None else tag
    tmp = save_dir / f"{TMP_PREFIX}{tag}"
    collectively(engine, "save_checkpoint", lambda: _check_can_save(engine, tag, client_state))
    collectively(engine, "save_checkpoint", lambda: _prepare_dir(tmp) if engine.rank == 0 else None)
    extra = collectively(
        engine, "save_checkpoint", lambda: _copy_extra_values(engine, layout, exclude_frozen_parameters)
    )
    collectively(engine, "save_checkpoint", lambda: _write_rank_file(engine, layout, tmp))
    collectively(
        engine,
        "save_checkpoint",
        lambda: (
            _finish_save(engine, extra, save_dir, tag, client_state, exclude_frozen_parameters)
            if engine.rank == 0
            else None
        ),
    )
    return save_dir / tag


def _check_can_save(engine: Engine, tag: str, client_state: Any) -> None:
    check_tag(tag)
    if engine.micro_steps % engine.gradient_accumulation_steps != 0:
        raise CheckpointError(
            f"save_checkpoint at micro-step {engine.micro_steps} is inside a gradient accumulation window "
            f"of {engine.gradient_accumulation_steps}: the partial gradients would be lost; save right "
            "after the engine.step() that updates the parameters"
        )
    if client_state is not None:
        try:
            json.dumps(client_state, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"client_state must be JSON-serialisable (dicts, lists, str, numbers, bools, None): {e}"
            ) from None


def _prepare_dir(tmp: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted save
    tmp.mkdir()


def _copy_extra_values(engine: Engine, layout: CheckpointLayout, exclude_frozen: bool) -> dict[str, torch.Tensor]:
    """Every rank asks the layout (it may gather); rank 0 keeps CPU copies for ``model_extra`` (without
    the frozen parameters with ``exclude_frozen``)."""
    values = layout.extra_values(engine, frozen=not exclude_frozen)
    if engine.rank != 0:
        return {}
    left_out = set(_frozen_names(engine)) if exclude_frozen else set()
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in values.items() if k not in left_out}


def _frozen_names(engine: Engine) -> list[str]:
    """First names of the parameters the engine does not train (their values go to ``model_extra``)."""
    return [r.name for r in describe_model(engine)[0] if not r.trained]


def _write_rank_file(engine: Engine, layout: CheckpointLayout, tmp: Path) -> Path:
    """Write this rank's pieces and RNG states to ``tmp/rank{r}.safetensors`` (fsynced)."""
    if not tmp.is_dir():
        raise CheckpointError(
            f"rank {engine.rank} does not see {tmp}, which rank 0 created: save_dir must be "
            "on a filesystem shared by all ranks"
        )
    tensors: dict[str, torch.Tensor] = {}
    for piece in layout.saved_pieces(engine):
        s = piece.slot
        rec = PieceRecord(name=s.name, start=piece.lo - s.offset, end=piece.hi - s.offset)
        value = piece_value(piece)
        tensors[rec.key(PARAM_KEY)] = value.detach().to("cpu", value_dtype(value.dtype), copy=True)
        for k, v in engine.optimizer.state.get(value, {}).items():
            if not isinstance(v, torch.Tensor) or list(v.shape) not in ([], [rec.numel]):
                raise CheckpointError(
                    f"optimizer state {k!r} of {s.name!r} is {type(v).__name__} "
                    f"{list(getattr(v, 'shape', []))}; only scalar tensors and tensors "
                    "shaped like the parameter piece can be saved"
                )
            if k in (PARAM_KEY, RNG_PREFIX[:-1]) or "/" in k:
                raise CheckpointError(f"optimizer state key {k!r} collides with checkpoint tensor names")
            tensors[rec.key(k)] = v.detach().to("cpu", copy=True)
    tensors[RNG_PREFIX + "torch_cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors[RNG_PREFIX + "torch_cuda"] = torch.cuda.get_rng_state()
    path = tmp / rank_file(engine.rank)
    metadata = {
        "format": FORMAT,
        "version": str(VERSION),
        "rank": str(engine.rank),
        **integrity.encode(integrity.checksums(tensors)),
    }
    save_file(tensors, str(path), metadata=metadata)
    fsync(path)
    return path


def _scan_rank_file(path: Path, rank: int) -> RankRecord:
    """Rebuild a rank file's :class:`RankRecord` from its safetensors header (tensor names and shapes)."""
    pieces: dict[tuple[str, int, int], dict[str, list[int]]] = {}
    rng = []
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            if key.startswith(RNG_PREFIX):
                rng.append(key[len(RNG_PREFIX) :])
                continue
            kind, name, start, end = parse_key(key)
            pieces.setdefault((name, start, end), {})[kind] = list(f.get_slice(key).get_shape())
        crc32 = integrity.decode(f.metadata(), str(path))
    records = []
    for (name, start, end), kinds in sorted(pieces.items()):
        if kinds.pop(PARAM_KEY, None) is None:
            raise CheckpointError(f"{path}: piece {name!r} [{start}, {end}) has optimizer state but no values")
        records.append(PieceRecord(name=name, start=start, end=end, state=dict(sorted(kinds.items()))))
    return RankRecord(rank=rank, file=path.name, pieces=records, rng=sorted(rng), crc32=crc32)


def _finish_save(
    engine: Engine, extra: dict[str, torch.Tensor], save_dir: Path, tag: str, client_state: Any, exclude_frozen: bool
) -> None:
    """Rank 0, after every rank wrote its file: extra file, meta.json, rename, ``latest``."""
    tmp = save_dir / f"{TMP_PREFIX}{tag}"
    extra_crc32 = integrity.checksums(extra)
    save_file(extra, str(tmp / EXTRA_FILE), metadata={"format": FORMAT, "version": str(VERSION)})
    fsync(tmp / EXTRA_FILE)
    params, buffers, keys = describe_model(engine)
    ranks = []
    for r in range(engine.world_size):
        path = tmp / rank_file(r)
        if not path.is_file():
            raise CheckpointError(f"rank {r} did not write {path}")
        ranks.append(_scan_rank_file(path, r))
    meta = CheckpointMeta(
        version=VERSION,
        stage=engine.stage,
        world_size=engine.world_size,
        dtype=dtype_name(value_dtype(engine.groups[0].buffer.dtype if engine.groups else torch.float32)),
        optimizer=type(engine.optimizer).__name__,
        params=params,
        buffers=buffers,
        state_dict_keys=keys,
        groups=group_records(engine),
        ranks=ranks,
        global_steps=engine.global_steps,
        micro_steps=engine.micro_steps,
        client_state=client_state,
        precision=engine_precision(engine),
        skipped_steps=int(getattr(engine, "skipped_steps", 0)),
        loss_scaler=loss_scaler_state(engine),
        lr_scheduler=scheduler_state(engine),
        extra_crc32=extra_crc32,
        excluded_frozen=[r.name for r in params if not r.trained] if exclude_frozen else [],
    )
    write_text(tmp / META_FILE, meta.to_json())
    fsync_dir(tmp)
    _publish(save_dir, tag)


def _publish(save_dir: Path, tag: str) -> None:
    """Rename ``.tmp-<tag>`` to ``<tag>`` (moving an old ``<tag>`` aside), then replace ``latest``."""
    final, tmp = save_dir / tag, save_dir / f"{TMP_PREFIX}{tag}"
    if final.exists():
        os.replace(final, save_dir / f"{OLD_PREFIX}{tag}-{uuid.uuid4().hex[:8]}")
    os.replace(tmp, final)
    fsync_dir(save_dir)
    _write_latest(save_dir, tag)
    for old in save_dir.glob(f"{OLD_PREFIX}{tag}-*"):  # this one, and any left by a killed save
        shutil.rmtree(old, ignore_errors=True)


def _write_latest(save_dir: Path, tag: str) -> None:
    write_text(save_dir / LATEST_FILE, tag)
    fsync_dir(save_dir)
