"""Worker for tests/test_comm.py: zerodp's reduce-scatter of host tensors on gloo (an all-to-all and a
local sum, see [Note: gloo reduce-scatter] in zerodp.runtime.comm) against torch's own reduce-scatter,
on the same inputs; each rank writes what it saw to ``--out/rank{r}.json``."""

import json
from pathlib import Path

import torch
import torch.distributed as dist

import zerodp
from distributed import worker_args
from zerodp.runtime import comm

a = worker_args()
rank, world = dist.get_rank(), dist.get_world_size()
ledger = comm.CommLedger()
res: dict = {"all_to_all_path": comm.sums_by_all_to_all(torch.zeros(1), None), "cases": []}
for dtype in (torch.float32, torch.bfloat16, torch.float64):
    for chunk in (1, 7, 4096):
        g = torch.Generator().manual_seed(1000 * rank + chunk)
        # random values (sums may round differently in another order) and small integers (exact)
        for kind, x in (
            ("random", torch.randn(world * chunk, generator=g).to(dtype)),
            ("integers", torch.randint(-50, 50, (world * chunk,), generator=g).to(dtype)),
        ):
            ref = torch.empty(chunk, dtype=dtype)
            comm._torch_reduce_scatter_single(ref, x.clone())
            out_sync, out_async, out_scratch = (torch.full((chunk,), 7.0, dtype=dtype) for _ in range(3))
            before = x.clone()
            comm.reduce_scatter(out_sync, x, None, ledger, "test")
            w = comm.reduce_scatter(out_async, x, None, ledger, "test", async_op=True)
            scratch = torch.empty_like(x)
            w2 = comm.reduce_scatter(out_scratch, x, None, ledger, "test", async_op=True, received=scratch)
            comm.AllOf([w, w2]).wait()
            res["cases"].append(
                {
                    "dtype": str(dtype),
                    "chunk": chunk,
                    "kind": kind,
                    "input_unchanged": bool(torch.equal(x, before)),
                    "equal": [bool(torch.equal(o, ref)) for o in (out_sync, out_async, out_scratch)],
                    "max_err": max(
                        float((o.double() - ref.double()).abs().max()) for o in (out_sync, out_async, out_scratch)
                    ),
                    "scale": float(ref.double().abs().max()),
                }
            )
try:
    comm.reduce_scatter(torch.empty(2), torch.zeros(2 * world), None, ledger, "test", received=torch.empty(3))
    res["bad_scratch"] = None
except ValueError as exc:
    res["bad_scratch"] = str(exc)
try:  # N x 2 elements for an output of 1: torch's reduce-scatter refuses it, so must this one
    comm.reduce_scatter(torch.empty(1), torch.zeros(2 * world), None, ledger, "test")
    res["bad_sizes"] = None
except ValueError as exc:
    res["bad_sizes"] = str(exc)
# a 2-D output (2, 3) of a (2N, 3) input, as torch's accepts: same values, the caller's shape kept
x2d = (torch.arange(world * 6, dtype=torch.float32) + 100 * rank).view(world * 2, 3)
ref2d, out2d = torch.empty(2, 3), torch.zeros(2, 3)
comm._torch_reduce_scatter_single(ref2d, x2d.clone())
comm.reduce_scatter(out2d, x2d, None, ledger, "test")
res["two_d"] = {"shape": list(out2d.shape), "equal": bool(torch.equal(out2d, ref2d))}
res["ledger_reduce_scatter"] = [r.count for r in ledger.records() if r.op == "reduce_scatter"]
Path(a.out, f"rank{rank}.json").write_text(json.dumps(res))
dist.barrier()
zerodp.shutdown_distributed()
