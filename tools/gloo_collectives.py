"""Time torch's gloo collectives alone (2 ranks, one thread each; rank 0 prints wall and process CPU
ms per call, 10-20 calls after one warm-up, each case twice): all_reduce, reduce_scatter_tensor,
all_to_all_single + local sum and all_gather_into_tensor on 3.26 M fp32 elements, then four stage-3
sized units (196,608 + 65,536 + 262,144 + 262,144) as a coalesced reduce_scatter_tensor against four
asynchronous all_to_all_single + sums. Used for docs/benchmarks/2026-12-01-bench.md ("Reduce-scatter on gloo").

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 tools/gloo_collectives.py
"""

import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
r, W = dist.get_rank(), dist.get_world_size()


def timed(f, reps):
    for _ in range(2):
        dist.barrier()
        f()
        t, c = time.perf_counter(), time.process_time()
        for _ in range(reps):
            f()
        if r == 0:
            print(
                f"{f.__name__:>10} {(time.perf_counter() - t) / reps * 1e3:.2f} ms wall "
                f"{(time.process_time() - c) / reps * 1e3:.2f} ms cpu"
            )


n = 3_257_856 // W * W
x, out, tmp = torch.randn(n), torch.empty(n // W), torch.empty(n)


def ar():
    dist.all_reduce(x)


def rs():
    dist.reduce_scatter_tensor(out, x)


def a2a():
    dist.all_to_all_single(tmp, x)
    torch.sum(tmp.view(W, -1), dim=0, out=out)


def ag():
    dist.all_gather_into_tensor(x, out)


for f in (ar, rs, a2a, ag):
    timed(f, 10)
sizes = [196608, 65536, 262144, 262144]
bufs, outs = [torch.randn(s) for s in sizes], [torch.empty(s // W) for s in sizes]


def rs_coal():
    with dist._coalescing_manager(async_ops=True) as cm:
        for b, o in zip(bufs, outs, strict=True):
            dist.reduce_scatter_tensor(o, b)
    cm.works[-1].wait()


def a2a_each():
    ws = []
    for b, o in zip(bufs, outs, strict=True):
        t = torch.empty_like(b)
        ws.append((dist.all_to_all_single(t, b, async_op=True), t, o))
    for w, t, o in ws:
        w.wait()
        torch.sum(t.view(W, -1), dim=0, out=o)


for f in (rs_coal, a2a_each):
    timed(f, 20)
dist.destroy_process_group()
