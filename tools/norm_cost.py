"""Cost and accuracy of the gradient norm's sum of squares on the bench's small GPT (52 random fp32
gradients, 3.26 M elements; one thread, 20 calls after one, twice): the former fp64 conversion, one
fp32 norm per tensor, and zerodp's fp32 norms of 64 K-element chunks
(``zerodp.runtime.topology._sum_of_squares``), each with its relative error against the fp64 sum.
Used for docs/benchmarks/2026-12-01-bench.md ("Gradient norm").

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 python tools/norm_cost.py
"""

import time

import torch

from zerodp.app.bench_args import PRESETS
from zerodp.app.model import GPT, GPTConfig
from zerodp.runtime.topology import _sum_of_squares

n_layer, n_head, d_model, seq_len, micro = PRESETS["small"]
m = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=seq_len))
gs = [torch.randn_like(p) for p in m.parameters()]


def fp64():
    return sum((g.double().pow(2).sum() for g in gs), torch.zeros((), dtype=torch.float64))


def per_tensor():
    return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in gs]).double().pow(2).sum()


def chunked():
    return _sum_of_squares(gs)


ref = sum(float((g.double() ** 2).sum()) for g in gs)
for f in (fp64, per_tensor, chunked) * 2:
    f()
    t = time.perf_counter()
    for _ in range(20):
        r = f()
    print(f"{f.__name__:>10} {(time.perf_counter() - t) / 20 * 1e3:.2f} ms  rel err {abs(float(r) - ref) / ref:.1e}")
