"""``zerodp consolidate`` (a checkpoint's full state dict to one file or HF-style shards,
:func:`zerodp.checkpoint.consolidate`, :func:`zerodp.checkpoint.sharded_export.export_sharded_safetensors`)
and ``zerodp verify`` (a checkpoint's files and per-tensor checksums, :mod:`zerodp.checkpoint.integrity`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from zerodp.app.model import GPTConfig
from zerodp.runtime import accounting


def run_consolidate(args: argparse.Namespace) -> int:
    """``zerodp consolidate CHECKPOINT_DIR OUT``: one file, or HF-style shards when OUT is a directory;
    returns 1 with one error line for a bad checkpoint or OUT."""
    from zerodp import checkpoint
    from zerodp.checkpoint import sharded_export
    from zerodp.checkpoint.reader import AbsentParametersWarning, absent_message

    # a directory: an existing one, a name ending in a separator, or a name without an extension; any
    # other name is a file (an unknown extension such as .bin is refused by consolidate)
    single = not (os.path.isdir(args.out) or args.out.endswith(os.sep) or not os.path.splitext(args.out)[1])
    if single and args.max_shard_size is not None:
        print(
            f"zerodp consolidate: error: --max-shard-size applies to a directory OUT (sharded output); "
            f"{args.out} names one file",
            file=sys.stderr,
        )
        return 1
    try:
        src = checkpoint.resolve_checkpoint(args.checkpoint_dir, args.tag)
        with checkpoint.CheckpointReader(src) as reader:
            absent = reader.absent_keys()  # said below, not as a warning
        warnings.filterwarnings("ignore", category=AbsentParametersWarning)
        if single:
            out = checkpoint.consolidate(args.checkpoint_dir, args.out, args.tag)
            size, what = out.stat().st_size, ""
        else:
            limit = args.max_shard_size or sharded_export.DEFAULT_MAX_SHARD_SIZE
            out = sharded_export.export_sharded_safetensors(args.checkpoint_dir, args.out, args.tag, limit)
            index = json.loads(out.read_text(encoding="utf-8"))
            size = index["metadata"]["total_size"]
            what = f", {len(set(index['weight_map'].values()))} shards of at most {limit}"
        meta = checkpoint.read_meta(src)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError
        print(f"zerodp consolidate: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {out} ({len(meta.state_dict_keys) - len(absent)} tensors, {accounting.human_bytes(size)}{what}) "
        f"from {src} (step {meta.global_steps}, saved by {meta.world_size} ranks at ZeRO stage {meta.stage})"
    )
    if absent:
        print(f"absent: {absent_message(absent, src)}")
    cs = meta.client_state
    if isinstance(cs, dict) and isinstance(cs.get("model"), dict):
        try:
            print(f"model: {GPTConfig.from_dict(cs['model'])} (load it into zerodp.app.model.GPT of this config)")
        except (TypeError, ValueError):
            pass
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """``zerodp verify CHECKPOINT_DIR``: check files and checksums; returns 1 with one error line if not intact."""
    from zerodp import checkpoint

    try:
        src = checkpoint.resolve_checkpoint(args.checkpoint_dir, args.tag)
        with checkpoint.CheckpointReader(src) as reader:
            files, tensors, nbytes = reader.verify_all()
            checked = (
                "checksums match"
                if reader.has_checksums
                else "names and shapes match (format version 1 has no checksums)"
            )
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError
        print(f"zerodp verify: error: {exc}", file=sys.stderr)
        return 1
    print(f"{src}: intact: {files} files, {tensors} tensors, {accounting.human_bytes(nbytes)} read; {checked}")
    return 0


__all__ = ["run_consolidate", "run_verify"]
