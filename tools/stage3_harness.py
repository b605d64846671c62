"""Shared set-up of the stage-3 measurement tools (``stage3_collectives.py``, ``stage3_waits.py``):
the bench's small GPT on 2 ranks, and collective counters installed by patching ``torch.distributed``'s
all-gather / reduce-scatter entry points and its coalescing manager (a coalesced group counts once, as
the backend sees it; the single collectives inside it are not counted)."""

import collections
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import zerodp
from zerodp.app.bench_systems import loss_of
from zerodp.app.model import GPT, GPTConfig
from zerodp.runtime import comm

counts: collections.Counter = collections.Counter()
_in_group = [False]


def _counted(name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        if not _in_group[0]:
            counts[name] += 1
        return fn(*args, **kwargs)

    return wrapper


class _Group:
    original = c10d._coalescing_manager

    def __init__(self, *args, **kwargs):
        self.cm = _Group.original(*args, **kwargs)

    def __enter__(self):
        _in_group[0] = True
        return self.cm.__enter__()

    def __exit__(self, *exc):
        _in_group[0] = False
        counts["coalesced groups"] += 1
        return self.cm.__exit__(*exc)


def count_collectives() -> None:
    """From now on ``counts`` records ``all_gather`` / ``reduce_scatter`` singles and coalesced groups."""
    comm._all_gather_single = _counted("all_gather", comm._all_gather_single)
    comm._reduce_scatter_single = _counted("reduce_scatter", comm._reduce_scatter_single)
    dist._coalescing_manager = _Group


def small_gpt_engine(stage: int):
    """(engine, rank, one training step) for the bench's small GPT at ``stage`` (fp32 AdamW,
    ``stage3_param_persistence_threshold`` 1000, micro-batch 8 x 128, a per-rank batch)."""
    zerodp.init_distributed()
    r = dist.get_rank()
    cfg = GPTConfig(n_layer=4, n_head=4, d_model=256, seq_len=128)
    torch.manual_seed(0)
    eng = zerodp.initialize(
        GPT(cfg),
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000},
        },
    )
    x = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(r))

    def step() -> None:
        loss = loss_of(eng(x[:, :-1])[0], x[:, 1:])
        eng.backward(loss)
        eng.step()

    return eng, r, step
