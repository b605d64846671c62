"""Per-rank worker for tests/test_param_offload.py, launched by torchrun (see tests/distributed.py).

Each scenario trains one model at stage 3 several times on the same batches: without parameter offload,
with ``offload_param.device = "cpu"`` and with ``"nvme"`` (two 4096-byte pool buffers, so every step
reuses them many times), and records whether losses and final parameters are bitwise equal (fp32), the
live storage of the swapped-out shards, the swapper's counters, and (prefetch scenario) the order of
read and forward-done events. Results: ``OUT/rank{r}.json``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zerodp  # noqa: E402
from dist_worker import ParentReads, TiedLM, TwiceBlock, Wide, Zoo, make_batch, mse, token_xent  # noqa: E402
from distributed import run_selected, worker_args  # noqa: E402

STEPS = 3
MICRO = 2  # rows per rank and micro-step
NVME = ""  # set from --nvme
CKPT = ""


def place(device: str) -> dict | None:
    if device == "none":
        return None
    if device == "cpu":
        return {"device": "cpu"}
    return {
        "device": "nvme",
        "nvme_path": NVME,
        "buffer_count": 2,
        "buffer_size": 4096,
        "max_in_cpu": 6 * 4096,
        "prefetch_depth": 3,
    }


def config(device: str, optimizer_device: str = "none", **zero: Any) -> dict:
    zc: dict = {"stage": 3, "stage3_param_persistence_threshold": 4, "reduce_bucket_size": 50, **zero}
    if place(device) is not None:
        zc["offload_param"] = place(device)
    if optimizer_device != "none":
        # cpu_adam "same": the non-offloaded engine's Adam kernel, so the comparisons stay bitwise
        zc["offload_optimizer"] = {"device": optimizer_device, "nvme_path": NVME, "buffer_count": 3, "cpu_adam": "same"}
        zc["sub_group_size"] = 60
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": zc,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.1}},
        "aio": {"block_size": 4096, "queue_depth": 2, "thread_count": 2},
    }


class Spec:
    """A stage-3 scenario: model, batches, forward and what to do before training."""

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        kind: str = "zoo",
        vocab: int = 11,
        forward: Callable[[Any, torch.Tensor, int], Any] = lambda m, x, step: m(x),
        loss: Callable = mse,
        prepare: Callable[[nn.Module], None] | None = None,
        between: Callable[[int, nn.Module], dict] | None = None,
    ) -> None:
        self.model_fn, self.kind, self.vocab = model_fn, kind, vocab
        self.forward, self.loss, self.prepare, self.between = forward, loss, prepare, between


def _freeze(m: nn.Module) -> None:
    m.fc1.weight.requires_grad_(False)
    m.fc1.bias.requires_grad_(False)


def _edit(step: int, model: nn.Module) -> dict:
    """Step 1: rank 0 edits weights under GatheredParameters(modifier_rank=0) (other ranks' edits are
    discarded); step 2: the fp32 accessors read and set full parameters."""
    if step == 1:
        with zerodp.zero.GatheredParameters([model.fc1.weight, model.fc2.bias], modifier_rank=0):
            with torch.no_grad():
                if dist.get_rank() == 0:
                    model.fc1.weight[0].fill_(0.5)
                    model.fc2.bias.mul_(-1.0)
                else:
                    model.fc1.weight.fill_(123.0)
    if step == 2:
        w = zerodp.zero.safe_get_full_fp32_param(model.fc2.weight)
        zerodp.zero.safe_set_full_fp32_param(model.fc2.weight, w * 0.5)
        return {"fc1_fp32": zerodp.zero.safe_get_full_fp32_param(model.fc1.weight), "fc2_fp32": w}
    return {}


SPECS = {
    "tied": Spec(TiedLM, kind="tokens", loss=token_xent),
    "reused": Spec(TwiceBlock),
    "external": Spec(ParentReads, prepare=lambda m: zerodp.zero.register_external_parameter(m, m.side.weight)),
    "skipped": Spec(Zoo, forward=lambda m, x, step: m(x, step % 2 == 0)),
    "frozen": Spec(Zoo, prepare=_freeze),
    "wide": Spec(Wide),
    "edit": Spec(Zoo, between=_edit),
}


def train(engine: Any, spec: Spec, steps: range, seen: dict | None = None) -> list[float]:
    """Train on ``steps``; values returned by ``spec.between`` go into ``seen`` (by step and name)."""
    r, n = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        x, y = make_batch(step, MICRO * n, spec.kind, spec.vocab)
        loss = spec.loss(spec.forward(engine, x[r * MICRO : (r + 1) * MICRO], step), y[r * MICRO : (r + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if spec.between is not None:
            for k, v in spec.between(step, engine.module).items():
                (seen if seen is not None else {})[f"{k}@{step}"] = v
    return losses


def build(spec: Spec, cfg: dict, under_init: bool = False, seed: int = 1234) -> Any:
    torch.manual_seed(seed)
    if under_init:
        with zerodp.zero.Init(config=cfg):
            model = spec.model_fn()
    else:
        model = spec.model_fn()
    if spec.prepare is not None:
        spec.prepare(model)
    return zerodp.initialize(model, cfg)


def swap_facts(engine: Any) -> dict:
    po = engine.param_offload
    if po is None or po.swapper is None:
        return {}
    sw = po.swapper
    return {
        "shards": len(sw.shards),
        "live_shard_bytes": sum(s.storage_bytes() for s in sw.shards),
        "chunk_reads": sw.counters.chunk_reads,
        "chunk_writes": sw.counters.chunk_writes,
        "reads_ahead": sw.counters.reads_ahead,
        "pool": len(sw.pool),
        "multi_chunk": any(s.nbytes > sw.chunk for s in sw.shards),
    }


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def same_run(a: tuple, b: tuple) -> bool:
    """Two runs' ``(losses, tensors read, state dict, *rest)`` bitwise equal (rest compared with ==)."""
    return (
        a[0] == b[0]
        and len(a[1]) == len(b[1])
        and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
        and same(a[2], b[2])
        and a[3:] == b[3:]
    )


def equality(name: str, under_init: bool = False) -> dict:
    """Losses and final parameters of none / cpu / nvme, bitwise."""
    spec = SPECS[name]
    runs: dict[str, tuple[list[float], dict]] = {}
    facts: dict[str, dict] = {}
    for device in ("none", "cpu", "nvme"):
        engine = build(spec, config(device), under_init)
        seen: dict = {}
        losses = train(engine, spec, range(STEPS), seen)
        facts[device] = swap_facts(engine)
        runs[device] = (losses, {**engine.module_state_dict(), **seen})
        engine.close()
    base = runs["none"]
    return {
        "equal": {d: runs[d][0] == base[0] and same(runs[d][1], base[1]) for d in ("cpu", "nvme")},
        "compared": len(base[1]),
        "nvme": facts["nvme"],
        "steps": STEPS,
    }


def optimizer_combos() -> dict:
    """offload_param nvme with offload_optimizer cpu and nvme equals no offload at all."""
    spec = SPECS["frozen"]
    base = build(spec, config("none"))
    want = (train(base, spec, range(STEPS)), base.module_state_dict())
    out = {}
    for opt in ("cpu", "nvme"):
        engine = build(spec, config("nvme", opt))
        got = (train(engine, spec, range(STEPS)), engine.module_state_dict())
        out[opt] = got[0] == want[0] and same(got[1], want[1])
        engine.close()
    return {"equal": out}


def mixed_nvme_step() -> dict:
    """offload_param nvme + offload_optimizer nvme, bf16 and fp16 (loss scaling), 2 micro-steps per step,
    clipping active: losses and final fp32 masters equal plain stage 3 bitwise. Also, from live storage:
    the NVMe optimizer offload holds no fp32 gradient copy per piece (CPU gradients are held once), and
    the parameter shards resident during each sub-group's update (summed storage sizes, read in
    ``_update``) stay within the shards of two consecutive sub-groups plus the read-ahead budget."""
    out: dict = {}
    n, r = dist.get_world_size(), dist.get_rank()
    for prec in ("bf16", "fp16"):
        runs, facts = {}, {}
        for mode in ("none", "nvme", "overlap"):  # overlap: nvme with offload_optimizer.overlap_step
            dev = "none" if mode == "none" else "nvme"
            torch.manual_seed(7)
            layers: list[nn.Module] = []
            for _ in range(5):
                layers += [nn.Linear(48, 48), nn.Tanh()]
            model = nn.Sequential(*layers)
            cfg = config(dev, dev)
            if mode == "overlap":
                cfg["zero_optimization"]["offload_optimizer"]["overlap_step"] = True
            cfg.update(
                {
                    prec: {"enabled": True, **({"initial_scale_power": 8} if prec == "fp16" else {})},
                    "gradient_accumulation_steps": 2,
                    "gradient_clipping": 0.05,
                }
            )
            if dev == "nvme":
                cfg["zero_optimization"]["sub_group_size"] = 1000  # rank 1: a unit spans two sub-groups
                cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = 4096
            engine = zerodp.initialize(model, cfg)
            peaks: list[int] = []
            if dev == "nvme":
                off, sw = engine.optimizer_offload, engine.param_offload.swapper
                real = off._update
                off._update = lambda sg, buf, opt, peaks=peaks, sw=sw, real=real: (
                    peaks.append(sum(s.storage_bytes() for s in sw.shards)),
                    real(sg, buf, opt),
                )[1]
            losses, norms = [], []
            for step in range(3):
                for micro in range(2):
                    g = torch.Generator().manual_seed(100 * step + micro)
                    x, y = torch.randn(MICRO * n, 48, generator=g), torch.randn(MICRO * n, 48, generator=g)
                    sl = slice(r * MICRO, (r + 1) * MICRO)
                    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[prec])
                    loss = nn.functional.mse_loss(engine(x[sl].to(dtype)).float(), y[sl])
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
                norms.append(engine.get_global_grad_norm())
            runs[mode] = (losses, engine.module_state_dict())
            if mode == "nvme":
                home = {id(u.group): u.home.nbytes for u in engine.param_offload.units}
                need = [{id(off._group_of[i]) for i in sg.pieces} for sg in off.subgroups]
                pairs = [need[k] | (need[k + 1] if k + 1 < len(need) else set()) for k in range(len(need))]
                facts = {
                    "peaks": peaks,
                    "total": sum(home.values()),
                    "subgroups": len(need),
                    "bound": max(sum(home.get(gid, 0) for gid in p) for p in pairs) + 4096,
                    "spans": any(len(a & b) for a, b in zip(need, need[1:], strict=False)),
                    "grad_buffer_max": max(t.numel() for t in off.grad_buffers),
                    "grad_host": off.host_bytes(engine.optimizer)["gradients"],
                    # the gradient swap file's read buffers (zerodp.offload.grad_swap), page-sized here
                    "grad_reads": off.spill.host_bytes() if off.spill is not None else 0,
                    "reducer_grads": engine.memory_report().measured["gradients"],
                    "owned": sum(p.hi - p.lo for gr in engine.groups for p in gr.pieces),
                    "live_after": sum(s.storage_bytes() for s in sw.shards),
                    "norms": norms,
                    "skipped": engine.skipped_steps,
                }
            engine.close()
        out[prec] = {
            "equal": all(
                runs[m][0] == runs["none"][0] and same(runs[m][1], runs["none"][1]) for m in ("nvme", "overlap")
            ),
            **facts,
        }
    return out


def checkpoints() -> dict:
    """An nvme-offloaded run's checkpoint loads into a non-offloaded engine (and back): training
    continues bitwise the same."""
    spec = SPECS["wide"]
    d = tempfile.mkdtemp(dir=CKPT) if dist.get_rank() == 0 else ""
    box = [d]
    dist.broadcast_object_list(box)
    d = box[0]
    a = build(spec, config("nvme"))
    train(a, spec, range(2))
    a.save_checkpoint(d, tag="a")
    b = build(spec, config("none"), seed=99)
    b.load_checkpoint(d, tag="a")
    to_plain = same(a.module_state_dict(), b.module_state_dict())
    la, lb = train(a, spec, range(2, 4)), train(b, spec, range(2, 4))
    b.save_checkpoint(d, tag="b")
    c = build(spec, config("nvme"), seed=7)
    c.load_checkpoint(d, tag="b")
    back = same(b.module_state_dict(), c.module_state_dict())
    lb2, lc = train(b, spec, range(4, 6)), train(c, spec, range(4, 6))
    out = {
        "nvme->none": to_plain and la == lb,
        "none->nvme": back and lb2 == lc,
        "continued": same(b.module_state_dict(), c.module_state_dict()),
        "live_shard_bytes": swap_facts(c)["live_shard_bytes"],
    }
    for e in (a, b, c):
        e.close()
    return out


class Chain(nn.Module):
    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def reads_beyond_gathers() -> dict:
    """All-gathers prefetched 4 layers ahead, shard reads 2 modules ahead (``prefetch_depth``): the reads
    must go beyond the layers already being gathered, or every gather's shard is read on demand.
    Demand reads during the third forward (the trace is recorded by then)."""
    cfg = config("nvme", stage3_prefetch_bucket_size=4 * 1056)
    cfg["zero_optimization"]["offload_param"].update(prefetch_depth=2, buffer_count=4)
    torch.manual_seed(0)
    engine = zerodp.initialize(Chain(12), cfg)
    sw = engine.param_offload.swapper
    for _step in range(3):
        d0, a0 = sw.counters.demand_reads, sw.counters.reads_ahead
        out = engine(torch.randn(MICRO, 32))
        demand, ahead = sw.counters.demand_reads - d0, sw.counters.reads_ahead - a0
        engine.backward(out.square().mean())
        engine.step()
    engine.close()
    return {"demand": demand, "ahead": ahead}


def prefetch_order() -> dict:
    """Events of the third iteration's forward: ("read", unit) as a shard's read is submitted and
    ("done", module) as a module's forward returns. Counts reads of module k + j (j >= 2) submitted
    before module k was done."""
    cfg = config("nvme", stage3_prefetch_bucket_size=1056)  # all-gathers prefetch one layer ahead
    torch.manual_seed(0)
    model = Chain()
    engine = zerodp.initialize(model, cfg)
    events: list[tuple[str, str]] = []
    engine.param_offload.swapper.events = events
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: events.append(("done", f"layers.{i}")))
    for _step in range(3):
        events.clear()
        x = torch.randn(MICRO, 32)
        engine.backward(engine(x).square().mean())
        engine.step()
    forward = events[: events.index(("done", "layers.5")) + 1]
    ahead = []
    for k in range(6):
        done = forward.index(("done", f"layers.{k}"))
        for j in range(2, 6 - k):
            if ("read", f"layers.{k + j}") in forward[:done]:
                ahead.append([k, k + j])
    engine.close()
    return {"ahead": ahead, "events": [list(e) for e in forward]}


def overlap_step() -> dict:
    """``offload_optimizer.overlap_step``: with a warmup scheduler (the lr changes every step), clipping
    active, a GatheredParameters read and an eval forward right after a step, losses, gathered values,
    eval outputs and final parameters equal plain stage 3 and the loop run inside step(), bitwise. Also
    whether each step returned with sub-groups left to update and whether the next forward finished them."""
    runs: dict[str, tuple] = {}
    deferred: list[list] = []
    n, r = dist.get_world_size(), dist.get_rank()
    for mode in ("none", "nvme", "overlap"):
        torch.manual_seed(3)
        model = Chain()
        dev = "none" if mode == "none" else "nvme"
        cfg = config(dev, dev, stage3_param_persistence_threshold=64)  # the biases stay gathered
        cfg["gradient_clipping"] = 0.05
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 5, "warmup_type": "linear"},
        }
        if dev == "nvme":
            cfg["zero_optimization"]["offload_optimizer"]["overlap_step"] = mode == "overlap"
        engine = zerodp.initialize(model, cfg)
        losses, seen = [], []
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(MICRO * n, 32, generator=g)[r * MICRO : (r + 1) * MICRO]
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            off = engine.optimizer_offload
            left = (
                (off.pending is not None, off.stats.updated_in_step, off.stats.subgroups)
                if off.device != "none"
                else None
            )
            if step == 1:
                with zerodp.zero.GatheredParameters([model.layers[3].weight]):
                    seen.append(model.layers[3].weight.detach().clone())
            elif step == 2:
                with torch.no_grad():
                    seen.append(engine(x + 1.0))
            if mode == "overlap":
                deferred.append([*left, off.pending is None])
        runs[mode] = (losses, seen, engine.module_state_dict(), engine.get_lr())
        engine.close()

    return {
        "equal": {"nvme": same_run(runs["nvme"], runs["none"]), "overlap": same_run(runs["overlap"], runs["none"])},
        "deferred": deferred,
        "lrs": runs["none"][3],
    }


def init_straight_to_nvme() -> dict:
    """Under zero.Init with offload_param nvme every new shard is in the swap file at once: live
    storage of the shards after construction is 0 bytes."""
    cfg = config("nvme")
    torch.manual_seed(1234)
    with zerodp.zero.Init(config=cfg) as zi:
        model = Wide()
    live = sum(s.storage_bytes() for s in zi.swapper.shards)
    # live storage of the children's parameters (a partitioned parameter keeps its full shape, no storage)
    held = sum(p.untyped_storage().nbytes() for m in model.children() for p in m.parameters(recurse=True))
    engine = zerodp.initialize(model, cfg)
    adopted = engine.param_offload.swapper is zi.swapper
    engine.close()
    return {
        "init_shards": len(zi.swapper.shards),
        "init_live_bytes": live,
        "held_by_children": held,
        "adopted": adopted,
        "largest_shard": zi.swapper.largest,
        "pool_bytes": zi.swapper.cfg.buffer_count * zi.swapper.chunk,
    }


def main() -> None:
    global NVME, CKPT
    args = worker_args("--nvme", "--ckpt")
    NVME, CKPT = args.nvme, args.ckpt
    scenarios: dict[str, Callable[[], dict]] = {name: (lambda name=name: equality(name)) for name in SPECS}
    scenarios.update(
        init_equal=lambda: equality("wide", under_init=True),
        combos=optimizer_combos,
        ckpt=checkpoints,
        prefetch=prefetch_order,
        init=init_straight_to_nvme,
        mixed=mixed_nvme_step,
        overlap=overlap_step,
        beyond=reads_beyond_gathers,
    )
    run_selected(args, scenarios)


if __name__ == "__main__":
    main()
