"""What the per-tensor CRC-32 checksums cost when saving and verifying a checkpoint.

Builds ``--layers`` x Linear(``--width``, ``--width``) (fp32, AdamW, ZeRO stage 1, one rank), takes one
step, then times ``engine.save_checkpoint`` (which computes the checksums while writing) and, separately,
the checksum pass alone over the same tensors (:func:`zerodp.checkpoint.integrity.checksums`), and
``zerodp verify``'s full read. Prints medians of ``--repeat`` runs and the checksum share of a save.

    .venv/bin/python tools/checkpoint_save_cost.py --layers 4 --width 2048 --dir /tmp/ckcost
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import zerodp
from zerodp.checkpoint import CheckpointReader, integrity, resolve_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/zerodp-checkpoint-cost")
    args = ap.parse_args()
    zerodp.init_distributed()
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    engine = zerodp.initialize(
        model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
    )
    engine.backward(engine(torch.randn(4, args.width)).pow(2).mean())
    engine.step()
    d = Path(args.dir)
    saves, crcs, verifies = [], [], []
    for _ in range(args.repeat):
        shutil.rmtree(d, ignore_errors=True)
        t0 = time.perf_counter()
        engine.save_checkpoint(d)
        saves.append(time.perf_counter() - t0)
        tensors = {f"p{i}": p.detach() for i, p in enumerate(engine.module.parameters())}
        tensors.update({f"s{i}/{k}": v for i, st in enumerate(engine.optimizer.state.values()) for k, v in st.items()})
        t0 = time.perf_counter()
        integrity.checksums(tensors)
        crcs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with CheckpointReader(resolve_checkpoint(d)) as reader:
            _, _, nbytes = reader.verify_all()
        verifies.append(time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    save, crc, verify = (statistics.median(x) for x in (saves, crcs, verifies))
    print(f"checkpoint: {size / 2**20:.1f} MiB on disk ({nbytes / 2**20:.1f} MiB of tensor data)")
    print(
        f"save_checkpoint: {save:.3f} s (median of {args.repeat}); checksum pass alone: {crc:.3f} s "
        f"({nbytes / 2**20 / crc:.0f} MiB/s) = {100 * crc / save:.1f}% of the save"
    )
    print(f"verify (read + check every tensor): {verify:.3f} s ({nbytes / 2**20 / verify:.0f} MiB/s)")
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
