"""Per-rank worker for tests/test_chat_save.py: DeepSpeed-Chat step 1's final save at ZeRO stage 3, in
its smallest form (written here; the client's own code is in DeepSpeedExamples'
applications/DeepSpeed-Chat/dschat/utils/utils.py).

After training, DS-Chat's main.py runs, on rank 0 only, ``save_hf_format``: ``torch.save`` of
``model.module.state_dict()`` (its "lora" keys dropped) to ``OUTPUT/pytorch_model.bin``; then, on every
rank, ``save_zero_three_model``: each parameter that has a ``ds_id`` and whose ``ds_status`` is
``NOT_AVAILABLE`` is gathered alone under ``deepspeed.zero.GatheredParameters`` and read as
``v.data.cpu()``, and rank 0 saves those tensors to the same file. Under zerodp's DeepSpeed drop-in the
first save writes placeholders with one PartitionedSaveWarning (DeepSpeed writes empty tensors), and
the second overwrites them with the weights. Each run trains a small OPT-shaped model with
``zerodp.deepspeed`` and, in the same process, with plain PyTorch on the same global batch.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import zerodp  # noqa: E402
import zerodp.deepspeed as deepspeed  # noqa: E402  (was: import deepspeed)
from dist_worker import MixedReference, err, make_batch, token_xent  # noqa: E402
from distributed import run_selected, worker_args  # noqa: E402
from zerodp.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402
from zerodp.stage3.placeholder import PartitionedSaveWarning  # noqa: E402
from zerodp.stage3.sharded_param import PartitionedParameterError  # noqa: E402

VOCAB, MICRO, STEPS = 11, 2, 4
SAVE_WORDS = ("save_16bit_model", "GatheredParameters", "zerodp consolidate")


class TinyOPT(nn.Module):
    """OPT's parameter names (``model.decoder.embed_tokens.weight`` first, ``lm_head.weight``); the
    final layer norm (16 elements) stays below the persistence threshold: never partitioned."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.decoder = nn.Module()
        self.model.decoder.embed_tokens = nn.Embedding(VOCAB, d)
        self.model.decoder.fc = nn.Linear(d, d)
        self.model.decoder.final_layer_norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        dec = self.model.decoder
        h = dec.embed_tokens(ids)
        return self.lm_head(dec.final_layer_norm(h + torch.tanh(dec.fc(h))))


def save_hf_format(model: Any, path: str) -> None:
    """DS-Chat's ``save_hf_format`` (weights part): the module's state_dict as it is, on rank 0."""
    model_to_save = model.module if hasattr(model, "module") else model
    save_dict = model_to_save.state_dict()
    for key in list(save_dict.keys()):
        if "lora" in key:
            del save_dict[key]
    torch.save(save_dict, path)


def save_zero_three_model(model: Any, global_rank: int, path: str) -> None:
    """DS-Chat's ``save_zero_three_model`` at stage 3: gather each parameter alone, rank 0 saves."""
    model_to_save = model.module if hasattr(model, "module") else model
    output_state_dict = {}
    for k, v in model_to_save.named_parameters():
        if hasattr(v, "ds_id"):
            fetch = [v] if v.ds_status == ZeroParamStatus.NOT_AVAILABLE else []
            with deepspeed.zero.GatheredParameters(fetch, enabled=True):
                v_p = v.data.cpu()
        else:
            v_p = v.cpu()
        if global_rank == 0 and "lora" not in k:
            output_state_dict[k] = v_p
    if global_rank == 0:
        torch.save(output_state_dict, path)


def _load_error(path: str, weights_only: bool) -> str:
    try:
        torch.load(path, weights_only=weights_only)
    except Exception as e:  # noqa: BLE001  (its class and message are asserted on)
        return f"{type(e).__name__}: {e}"
    return "loaded"


def ds_chat_run(dtype: str, offload: bool, under_init: bool) -> dict:
    """Train STEPS steps with ``zerodp.deepspeed`` (and plain PyTorch), then DS-Chat's two saves."""
    rank, world = dist.get_rank(), dist.get_world_size()
    zc: dict = {"stage": 3, "stage3_param_persistence_threshold": 16}
    if offload:
        zc["offload_param"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": 0.02}},
        "zero_optimization": zc,
        **({"bf16": {"enabled": True}} if dtype == "bf16" else {}),
    }
    torch.manual_seed(0)
    base = TinyOPT()
    low = torch.bfloat16 if dtype == "bf16" else torch.float32
    ref = MixedReference(copy.deepcopy(base), low, torch.optim.Adam, {"lr": 0.02})
    if under_init:  # DS-Chat builds the model under zero.Init (HfDeepSpeedConfig + from_pretrained)
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = TinyOPT()
    else:
        model = copy.deepcopy(base)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for step in range(STEPS):
        x, y = make_batch(step, MICRO * world, "tokens", VOCAB)
        ref.step(token_xent(ref.model(x).float(), y))
        lo = rank * MICRO
        engine.backward(token_xent(engine(x[lo : lo + MICRO]).float(), y[lo : lo + MICRO]))
        engine.step()
    out: dict = {}
    path = os.path.join(_shared_dir(), "pytorch_model.bin")
    if rank == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            save_hf_format(engine, path)
        out["warnings"] = [
            (w.category.__name__, str(w.message), os.path.basename(w.filename))
            for w in caught
            if issubclass(w.category, PartitionedSaveWarning)
        ]
        out["file_written"] = os.path.getsize(path) > 0
        out["load_weights_only"] = _load_error(path, True)
        out["load_full"] = _load_error(path, False)
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DS-Chat's v.data.cpu() is a view on CPU: kept, with a warning
        save_zero_three_model(engine, rank, path)
    with zerodp.zero.GatheredParameters(list(model.parameters())):
        own = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["partitioned"] = [n for n, p in model.named_parameters() if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if rank == 0:
        got = torch.load(path, weights_only=True)
        want = dict(ref.model.named_parameters())
        out["keys_equal"] = sorted(got) == sorted(want)
        out["dtypes"] = sorted({str(t.dtype) for t in got.values()})
        out["equal_own"] = all(torch.equal(got[k], own[k]) for k in own)
        out["err"] = max(err(got[k].float(), want[k].float()) for k in want)  # fp32: <= 1 is 1e-5 relative
        out["norm_err"] = max(((got[k].float() - w.float()).norm() / w.float().norm()).item() for k, w in want.items())
        out["moved"] = max((got[k].float() - v.float()).abs().max().item() for k, v in base.state_dict().items())
    dist.barrier()
    return out


def _shared_dir() -> str:
    """A fresh directory, named by rank 0 (DS-Chat's --output_dir is the same path on every rank)."""
    name = [tempfile.mkdtemp(prefix="dschat_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def native_refuses() -> dict:
    """zerodp's own API keeps refusing the first save: PartitionedParameterError naming the parameter."""
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": 0.02}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 16},
    }
    torch.manual_seed(0)
    engine = zerodp.initialize(TinyOPT(), cfg)
    try:
        save_hf_format(engine, os.path.join(tempfile.mkdtemp(), "pytorch_model.bin"))
        return {"refused": ""}
    except PartitionedParameterError as e:
        return {"refused": str(e)}


RUNS = {
    "fp32_init": ("fp32", False, True),
    "fp32_plain": ("fp32", False, False),
    "fp32_init_offload": ("fp32", True, True),
    "bf16_init": ("bf16", False, True),
    "bf16_plain_offload": ("bf16", True, False),
}
SCENARIOS = {name: (lambda a=args: ds_chat_run(*a)) for name, args in RUNS.items()}
SCENARIOS["native_refuses"] = native_refuses

if __name__ == "__main__":
    run_selected(worker_args(), SCENARIOS)
