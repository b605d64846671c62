"""``zerodp bench``: step time of zerodp's stages against torch DDP and FSDP2, in one run.

Every system trains the same GPT on the same batches, on the same ranks, one after another, and the
table gives the median step time (forward + backward + optimizer step, seconds) and its ratio to DDP's.
DeepSpeed is measured too when it is installed (``pip install zerodp[bench]``); it is never imported
by the library itself.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from zerodp.app import bench_offload
from zerodp.app.model import GPT, GPTConfig

Step = Callable[[torch.Tensor, torch.Tensor], float]


def _batches(cfg: GPTConfig, micro: int, n: int, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size, (micro * world, cfg.seq_len + 1), generator=g)
        x = x[rank * micro : (rank + 1) * micro]
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _torch_step(model: torch.nn.Module, lr: float) -> Step:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = _loss(model(x)[0], y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _ddp(cfg: GPTConfig, lr: float) -> Step:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    return _torch_step(DistributedDataParallel(GPT(cfg)), lr)


def _fsdp2(cfg: GPTConfig, lr: float) -> Step:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return _torch_step(model, lr)


def _engine_step(engine) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = _loss(engine(x)[0], y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step


def _zerodp(stage: int) -> Callable[[GPTConfig, float], Step]:
    def build(cfg: GPTConfig, lr: float) -> Step:
        torch.manual_seed(0)
        engine = zerodp.initialize(GPT(cfg), {
            "optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000}})
        return _engine_step(engine)

    return build


def _deepspeed(stage: int) -> Callable[[GPTConfig, float], Step]:
    def build(cfg: GPTConfig, lr: float) -> Step:
        import deepspeed  # optional extra

        torch.manual_seed(0)
        model = GPT(cfg)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
            "zero_optimization": {"stage": stage}})
        return _engine_step(engine)

    return build


def run(args: argparse.Namespace) -> None:
    zerodp.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, seq_len=args.seq_len)
    systems: dict[str, Callable[[GPTConfig, float], Step]] = {"DDP": _ddp, "FSDP2": _fsdp2}
    for s in (0, 1, 2, 3):
        systems[f"zerodp stage {s}"] = _zerodp(s)
    nvme_dir = args.nvme_path or tempfile.mkdtemp(prefix="zerodp_bench_")
    if args.offload:
        systems.update(bench_offload.offload_builders(nvme_dir, args.sub_group_size, lambda: GPT(cfg), _engine_step))
    try:
        import deepspeed  # noqa: F401

        for s in (1, 2, 3):
            systems[f"DeepSpeed stage {s}"] = _deepspeed(s)
    except ImportError:
        pass
    batches = _batches(cfg, args.micro_batch, args.warmup + args.steps, rank, world)
    results: dict[str, float] = {}
    for rnd in range(args.rounds):  # interleave systems over rounds so drift hits all alike
        for name, build in systems.items():
            try:
                step = build(cfg, 1e-3)
            except Exception as exc:  # e.g. FSDP2 unavailable on this backend
                if rank == 0 and rnd == 0:
                    print(f"{name}: skipped ({type(exc).__name__}: {exc})")
                continue
            times = []
            for i, (x, y) in enumerate(batches):
                dist.barrier()
                t0 = time.perf_counter()
                step(x, y)
                dist.barrier()
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            results.setdefault(name, [])
            results[name].extend(times)  # type: ignore[union-attr]
    if rank == 0:
        base = statistics.median(results["DDP"])  # type: ignore[arg-type]
        params = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"GPT {params:,} parameters, {world} ranks ({dist.get_backend()}), micro-batch "
              f"{args.micro_batch} x {cfg.seq_len} tokens, median of {args.steps * args.rounds} steps")
        print(f"{'system':<30}{'step (s)':>12}{'vs DDP':>10}")
        for name, ts in results.items():
            med = statistics.median(ts)  # type: ignore[arg-type]
            print(f"{name:<30}{med:>12.4f}{med / base:>9.2f}x")
        if args.offload:
            print(bench_offload.swap_report(nvme_dir))
            print(bench_offload.adam_kernels(params // world))
    for engine in bench_offload.NVME_ENGINES:
        engine.close()
    if not args.nvme_path and rank == 0:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    zerodp.shutdown_distributed()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--nvme-path", default=None)
    p.add_argument("--sub-group-size", type=int, default=1_000_000)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap)
    run(ap.parse_args())
