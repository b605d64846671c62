"""Where each system's resident set goes, phase by phase, as ``zerodp bench`` measures its peak RSS:
the bench's builders and batches (small preset unless ``PRESET=medium``), one forked child per
system from a process with only torch and zerodp imported (``zerodp.app.bench_rss.measure``), 3
steps. At the end of every block's forward and backward, after each backward and each step, each
child records (MiB) ``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile`` (``/proc/self/status``) and glibc's
in-use bytes (``mallinfo2()``: ``uordblks + hblkhd``, all arenas). Rank 0 prints the systems side by
side; ``OUT=dir`` also keeps each child's rows (JSON) and ``/proc/self/smaps`` after its last step.
Systems: ``ddp`` or a zerodp stage, comma-separated (docs/benchmarks/2026-12-01-bench.md, "Where stage 0's extra peak
RSS came from").

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 python -m torch.distributed.run --standalone \
        --nproc-per-node 2 tools/rss_breakdown.py ddp,0
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist  # noqa: F401  (imported before the fork, as in the bench)

from zerodp.app import bench_rss
from zerodp.app.bench import LR, _build, make_batches  # noqa: F401
from zerodp.app.bench_args import PRESETS
from zerodp.app.bench_systems import SYSTEMS
from zerodp.app.model import GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mallinfo import malloc_in_use  # noqa: E402  (tools/, next to this file)

STEPS = 3
KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "malloc")


def sample(rows: list, name: str) -> None:
    row = {"point": name}
    for line in open("/proc/self/status"):
        key = line.split(":")[0]
        if key in KEYS:
            row[key] = int(line.split()[1]) / 1024
    row["malloc"] = malloc_in_use() / 2**20
    rows.append(row)


def instrumented(name: str, cfg: GPTConfig, rows: list, out: str):
    def build():
        system, reason = _build(SYSTEMS[name], cfg, probe=False)
        if system is None:
            return None, reason
        sample(rows, "built")
        step = [0]

        def on_block(i):
            def hook(mod, inp, output):
                t = output[0] if isinstance(output, tuple) else output
                sample(rows, f"s{step[0]} fwd b{i}")
                if t.requires_grad:
                    t.register_hook(lambda g: sample(rows, f"s{step[0]} bwd b{i}"))

            return hook

        for i, block in enumerate(system.module.blocks):
            block.register_forward_hook(on_block(i))
        fb, st = system.forward_backward, system.step

        def forward_backward(x, y):
            loss = fb(x, y)
            sample(rows, f"s{step[0]} after bwd")
            return loss

        def do_step():
            st()
            sample(rows, f"s{step[0]} after step")
            step[0] += 1
            if step[0] == STEPS:
                rank = dist.get_rank()
                path = os.path.join(out, f"{name.replace(' ', '_')}_r{rank}")
                if out:
                    shutil.copy("/proc/self/smaps", path + ".smaps")
                with open(path + ".json" if out else os.devnull, "w") as f:
                    json.dump(rows, f)
                if rank == 0:  # the child reports through the shared file below
                    with open(f"/tmp/rss_breakdown_{os.getppid()}_{name.replace(' ', '_')}.json", "w") as f:
                        json.dump(rows, f)

        system.forward_backward, system.step = forward_backward, do_step
        return system, None

    return build


def main() -> None:
    names = ["DDP" if s == "ddp" else f"zerodp stage {s}" for s in sys.argv[1].split(",")]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    n_layer, n_head, d_model, seq_len, micro = PRESETS[os.environ.get("PRESET", "small")]
    cfg = GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=seq_len)
    out = os.environ.get("OUT", "")
    if out:
        os.makedirs(out, exist_ok=True)
    tables = {}
    for k, name in enumerate(names):
        result = bench_rss.measure(
            k, instrumented(name, cfg, [], out), lambda: make_batches(cfg, micro, STEPS, rank, world)
        )
        peak = result.get("peak_rss", 0) / 2**20
        print(f"{name} rank {rank}: peak {peak:.1f} MiB {result.get('error', '')}", flush=True)
        path = f"/tmp/rss_breakdown_{os.getpid()}_{name.replace(' ', '_')}.json"
        if rank == 0 and os.path.exists(path):
            with open(path) as f:
                tables[name] = json.load(f)
            os.remove(path)
    if rank == 0 and tables:
        print(f"rank 0, MiB, {' | '.join(names)} per column: " + " ".join(KEYS))
        for i, row in enumerate(next(iter(tables.values()))):
            cells = ["/".join(f"{t[i][k]:.1f}" for t in tables.values()) for k in KEYS]
            print(f"{row['point']:16} " + "  ".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
