"""Sharded checkpoints that do not depend on the world size or the ZeRO stage.

Modules: :mod:`~zerodp.checkpoint.format` (file names, tensor names, tags, the error type),
:mod:`~zerodp.checkpoint.meta` (``meta.json``'s pydantic schema), :mod:`~zerodp.checkpoint.protocol`
(what is needed of an engine), :mod:`~zerodp.checkpoint.engine_state` (what is read off it),
:mod:`~zerodp.checkpoint.layout` (per-stage placement), :mod:`~zerodp.checkpoint.save`,
:mod:`~zerodp.checkpoint.reader`, :mod:`~zerodp.checkpoint.load` (resharding N -> M ranks, any stage),
:mod:`~zerodp.checkpoint.consolidation`, :mod:`~zerodp.checkpoint.integrity` (CRC-32 per tensor),
:mod:`~zerodp.checkpoint.collective` and
:mod:`~zerodp.checkpoint.durable` (failure agreement, fsync).

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
  Since version 2 also ``ranks[r].crc32`` and ``extra_crc32``: the CRC-32 of every tensor of every
  file (see :mod:`zerodp.checkpoint.integrity`).

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
rank's shard, and a sharded parameter holds no values (it keeps the slot's shape, not its storage). The
pieces are the optimizer's, exactly as at stages 1-2; loading fills each slot's intersection with this
rank's shard (frozen slots from ``model_extra``); frozen parameters are gathered unit by unit to be
saved, and full values are read unit by unit under ``zero.GatheredParameters``. Loading releases units
left gathered but unused (e.g. prefetched) first, and afterwards re-gathers the persistent unit and any
unit still in use, so no gathered copy is stale. The format is the same at every stage.

[Note: optimizer parameter] The value saved for a piece, and the tensor its optimizer state is keyed
by, is :func:`~zerodp.checkpoint.engine_state.piece_value` (an fp32 ``master`` when the piece has one, else the piece's
view of the flat buffer). Loading writes it and, separately, the flat buffer (cast with ``copy_``), so a bf16/fp16
module's parameters are its masters rounded, as after an optimizer step. Full values
(:func:`module_state_dict`) of trained parameters are the masters, assembled across ranks.

[Note: precision] Pieces are fp32 whatever the precision, so a checkpoint loads into an engine of
another precision (fp32 <-> bf16 <-> fp16) without losing trained values; frozen parameters and buffers
are cast to the engine's module dtype. Refused: a finite saved value that would overflow to inf in the
engine's dtype (``load._check_representable``). The loss scaler state is restored only between dynamic
fp16 scalers (a static scale stays as configured; a non-fp16 engine has none); the LR scheduler's only
into a scheduler of the same class (otherwise the configured one starts afresh; the param groups' lr is
restored either way).
"""

from zerodp.checkpoint.consolidation import consolidate, load_full_state_dict
from zerodp.checkpoint.format import EXTRA_FILE, LATEST_FILE, META_FILE, CheckpointError, check_tag
from zerodp.checkpoint.layout import (
    LAYOUTS,
    CheckpointLayout,
    ReplicatedParamsLayout,
    ShardedParamsLayout,
    module_state_dict,
)
from zerodp.checkpoint.load import load_checkpoint
from zerodp.checkpoint.meta import CheckpointMeta, read_meta
from zerodp.checkpoint.reader import CheckpointReader, resolve_checkpoint
from zerodp.checkpoint.safetensors_dir import load_safetensors_weights
from zerodp.checkpoint.save import save_checkpoint
from zerodp.checkpoint.sharded_export import export_sharded_safetensors

__all__ = [
    "CheckpointError",
    "CheckpointMeta",
    "CheckpointLayout",
    "CheckpointReader",
    "ReplicatedParamsLayout",
    "ShardedParamsLayout",
    "LAYOUTS",
    "EXTRA_FILE",
    "LATEST_FILE",
    "META_FILE",
    "save_checkpoint",
    "load_checkpoint",
    "module_state_dict",
    "consolidate",
    "load_full_state_dict",
    "resolve_checkpoint",
    "read_meta",
    "check_tag",
    "load_safetensors_weights",
    "export_sharded_safetensors",
]
