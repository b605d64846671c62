"""Time one stage-3 prefetch group's all-gather on gloo three ways (2 ranks, one thread each; rank 0
prints wall and process CPU ms per call, 20 calls after one warm-up, each case three times): torch's
coalesced ``all_gather_into_tensor`` (what stage 3 issues), one ``all_to_all_single`` whose send buffer
holds this rank's shards once per destination rank and whose receive rows are copied into each unit's
full buffer, with the send and receive buffers reused between calls, and the same with fresh ones.
Checks that the all-to-all's results equal the all-gather's. Used for docs/benchmarks/2026-12-01-bench.md ("All-gather
by all-to-all on gloo").

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 tools/gloo_allgather.py
"""

import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
r, W = dist.get_rank(), dist.get_world_size()


def timed(f, reps):
    for _ in range(3):
        dist.barrier()
        f()
        t, c = time.perf_counter(), time.process_time()
        for _ in range(reps):
            f()
        if r == 0:
            print(
                f"{f.__name__:>12} {(time.perf_counter() - t) / reps * 1e3:.2f} ms wall "
                f"{(time.process_time() - c) / reps * 1e3:.2f} ms cpu",
                flush=True,
            )


sizes = [196608, 65536, 262144, 262144, 196608, 262144, 262144]  # seven units of the small GPT
shards = [torch.randn(s // W) for s in sizes]
fulls = [torch.empty(s) for s in sizes]
G = sum(sizes) // W
send, received = torch.empty(W * G), torch.empty(W * G)


def coalesced():
    with dist._coalescing_manager(async_ops=True) as cm:
        for sh, f in zip(shards, fulls, strict=True):
            dist.all_gather_into_tensor(f, sh)
    cm.works[-1].wait()


def _by_all_to_all(snd, rcv):
    rows, at = snd.view(W, G), 0
    for sh in shards:
        rows[:, at : at + sh.numel()].copy_(sh.unsqueeze(0).expand(W, -1))
        at += sh.numel()
    dist.all_to_all_single(rcv, snd)
    rows, at = rcv.view(W, G), 0
    for sh, f in zip(shards, fulls, strict=True):
        f.view(W, -1).copy_(rows[:, at : at + sh.numel()])
        at += sh.numel()


def a2a_reused():
    _by_all_to_all(send, received)


def a2a_fresh():
    _by_all_to_all(torch.empty(W * G), torch.empty(W * G))


for f in (coalesced, a2a_reused, a2a_fresh):
    timed(f, 20)
coalesced()
ref = [f.clone() for f in fulls]
for f in fulls:
    f.zero_()
a2a_reused()
assert all(torch.equal(a, b) for a, b in zip(ref, fulls, strict=True)), "the all-to-all gathered other values"
if r == 0:
    print("all-to-all results equal the all-gather's")
dist.destroy_process_group()
