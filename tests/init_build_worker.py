"""Worker for tests/test_init_build.py: ``zerodp.zero.Init`` on unmodified constructors (issue 9 item 4).

Scenarios (one launch per world size, every rank runs each):

- ``weights_<model>_<precision>``: the model built under ``Init`` then ``zerodp.initialize``d has
  exactly the weights of the same constructor built without ``Init`` then ``zerodp.initialize``d
  (``engine.module_state_dict()``, bit for bit), for an HF-style model with ``post_init()``, a
  nanoGPT-style ``self.apply(_init_weights)`` model, ``nn.Sequential(*layers)`` with torch's default
  Linear init (every layer built before the parent exists), a free-standing ``nn.Linear`` and a module
  registering parameters before and after building a child; fp32 and
  bf16 (Init casts once, after the values were drawn in fp32, as ``initialize`` does).
- ``build_peak``: the live heap (glibc ``mallinfo2``, tests/heap_probe.py, sampled on every Python and C
  call) while ``nn.Sequential(*[nn.Linear(H, H) ...])`` is built under ``Init`` and without it, with the
  largest layer's bytes and the bytes of the shards Init kept (read from their storages).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import zerodp
from dist_worker import held_elements
from distributed import run_selected, worker_args
from heap_probe import HeapPeak

SCENARIOS: dict[str, Callable[[], dict]] = {}


class HFBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)


class HFStyle(nn.Module):
    """HF-style: ``post_init()`` runs ``self.apply(self._init_weights)`` after every child exists."""

    def __init__(self, vocab: int = 40, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d, padding_idx=0)
        self.h = nn.ModuleList(HFBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.post_init()

    def post_init(self) -> None:
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module) -> None:
        if m is self.head:  # two in-place ops: in bf16 the draw would be rounded before the scaling
            m.weight.data.normal_(mean=0.0, std=1.0).mul_(0.02)
        elif isinstance(m, nn.Linear):
            m.weight.data.normal_(mean=0.0, std=0.02)
            if m.bias is not None:
                m.bias.data.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.data.normal_(mean=0.0, std=0.02)
            m.weight.data[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            m.bias.data.zero_()
            m.weight.data.fill_(1.0)


class NanoStyle(nn.Module):
    """nanoGPT-style: a root parameter, ``self.apply(_init_weights)`` with ``nn.init.*``, then a scaled
    init by name."""

    def __init__(self, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(24, d))  # the root's own parameter, registered first
        self.blocks = nn.ModuleList(HFBlock(d) for _ in range(layers))
        self.lm = nn.Linear(d, 30)
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / (2 * layers) ** 0.5)
        torch.nn.init.orthogonal_(self.lm.weight, gain=0.02)  # QR: not implemented for bf16 on CPU

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)


def sequential(h: int = 24, n: int = 4) -> nn.Module:
    """Every layer built in full before the parent exists; torch's default (kaiming-uniform) init."""
    return nn.Sequential(*[nn.Linear(h, h) for _ in range(n)], nn.Linear(h, 1))


def free_linear() -> nn.Module:
    """A layer attached to no parent."""
    return nn.Linear(40, 24)


class LateParam(nn.Module):
    """Registers a parameter, builds a child, registers another parameter and edits the first (its
    ``__init__`` is still running when the child registers: it stays pending)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(30, 8))
        self.sub = nn.Linear(8, 8)
        self.b = nn.Parameter(torch.empty(20, 8))
        nn.init.normal_(self.b, std=0.5)
        self.a.data.mul_(0.1)


def late_param() -> nn.Module:
    """A LateParam, then a layer and a parameter added from outside: the LateParam was partitioned when
    the layer registered, so its new parameter makes Init lay all three out as one unit again."""
    m = LateParam()
    m.head = nn.Linear(8, 8)
    m.c = nn.Parameter(torch.randn(16, 8))
    return m


MODELS: dict[str, Callable[[], nn.Module]] = {
    "hf": HFStyle,
    "nano": NanoStyle,
    "sequential": sequential,
    "free_linear": free_linear,
    "late_param": late_param,
}


def config(bf16: bool, max_live: int = 1000) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 16,
            "stage3_max_live_parameters": max_live,
        },
    }  # small: Init flushes as it goes


def weights_case(model: str, bf16: bool) -> dict:
    cfg = config(bf16)
    torch.manual_seed(7)
    plain = zerodp.initialize(MODELS[model](), cfg)  # built without Init, cast by initialize
    expected = plain.module_state_dict()
    torch.manual_seed(7)
    with zerodp.zero.Init(config=cfg) as init:
        built = MODELS[model]()
    big = [p for p in built.parameters() if p.numel() > 16]
    partitioned = sum(zerodp.zero.is_partitioned(p) for p in big)
    held = held_elements(built.parameters())
    units = len(init.units)
    engine = zerodp.initialize(built, cfg)
    adopted = sum(any(u is v for v in init.units) for u in engine.sharding.units)  # not re-laid out
    got = engine.module_state_dict()
    std = {k: v.float().std().item() for k, v in expected.items() if k.endswith("weight") and v.dim() == 2}
    return {
        "keys": sorted(expected),
        "identical": sorted(k for k in expected if torch.equal(got[k], expected[k])),
        "dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
        "weight_std_max": max(std.values()),
        "touch_gathers": init._touch_gathers,
        "big": len(big),
        "partitioned": partitioned,
        "init_units": units,
        "adopted": adopted,
        "held_after_init": held,
        "full_elements": sum(v.numel() for v in expected.values()),
    }


for _m in MODELS:
    for _prec in ("fp32", "bf16"):
        SCENARIOS[f"weights_{_m}_{_prec}"] = lambda m=_m, b=_prec == "bf16": weights_case(m, b)

#: build_peak's model: 8 x Linear(H, H) + Linear(H, 1), each weight 1 MiB in fp32
H, LAYERS = 512, 8


def build_peak() -> dict:
    cfg = config(bf16=False, max_live=H * H)  # window: one layer's weight
    layers = lambda: nn.Sequential(*[nn.Linear(H, H) for _ in range(LAYERS)], nn.Linear(H, 1))  # noqa: E731
    torch.manual_seed(1)
    with HeapPeak() as plain_probe:
        plain = layers()
    del plain
    torch.manual_seed(1)
    with zerodp.zero.Init(config=cfg) as init:
        with HeapPeak() as init_probe:
            model = layers()
    shards = {u.shard.untyped_storage().data_ptr(): u.shard.untyped_storage().nbytes() for u in init.units}
    return {
        "init_peak": init_probe.peak,
        "plain_peak": plain_probe.peak,
        "samples": init_probe.samples,
        "largest_layer_bytes": (H * H + H) * 4,
        "window_bytes": H * H * 4,
        "shard_bytes": sum(shards.values()),
        "model_bytes": sum(p.numel() * 4 for p in model.parameters()),
        "held_after_init": held_elements(model.parameters()),
    }


SCENARIOS["build_peak"] = build_peak


def main() -> None:
    run_selected(worker_args(), SCENARIOS)


if __name__ == "__main__":
    main()
