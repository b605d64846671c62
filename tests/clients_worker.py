"""Patterns of public DeepSpeed clients (DeepSpeedExamples, DeepSpeed-Chat, transformers), written here
and run against ``zerodp.deepspeed`` on 2 gloo ranks (launched by tests/test_clients.py).

Each scenario writes what it saw into ``OUT/rank{r}.json``; the test asserts on it.
"""

from __future__ import annotations

import os
import random
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerodp.deepspeed as deepspeed  # was: import deepspeed
from distributed import run_selected, worker_args
from zerodp.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # was: from deepspeed...


def stage3_config(**extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10},
        **extra,
    }


class Tower(nn.Module):
    """Several parameters of equal shapes, so a mis-paired gather would not fail on sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _all(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gathered_order() -> dict:
    """transformers' from_pretrained passes GatheredParameters a list built from a set (order differs per
    rank): each rank passes the parameters in its own order, duplicates included, rank 0 edits."""
    rank = dist.get_rank()
    cfg = stage3_config()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = Tower()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    statuses_outside = {n: p.ds_status.name for n, p in model.named_parameters()}
    order = list(range(len(params)))
    random.Random(rank + 1).shuffle(order)  # a different order on each rank
    mine = [params[i] for i in order] + [params[order[0]]]  # and a duplicate
    expected = {}
    with deepspeed.zero.GatheredParameters(mine, modifier_rank=0):
        inside = {n: p.ds_status.name for n, p in model.named_parameters()}
        with torch.no_grad():
            for i, (n, p) in enumerate(model.named_parameters()):
                expected[n] = p.detach().clone() * 0 + (i + 1 if rank == 0 else -100.0)
                p.copy_(expected[n])
    with deepspeed.zero.GatheredParameters(list(set(model.parameters()))):  # set order: differs per rank
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
    ok = all(torch.equal(after[n], expected[n] if rank == 0 else expected[n] * 0 + i + 1) for i, n in enumerate(names))
    # a rank passing other parameters is refused by name, not mis-paired
    refused = ""
    try:
        with deepspeed.zero.GatheredParameters(params[:2] if rank == 0 else params[2:4]):
            pass
    except ValueError as e:
        refused = str(e)
    sd = engine.state_dict()
    return {
        "ds_ids": [int(p.ds_id) for p in params],
        "all_ds_ids": _all([int(p.ds_id) for p in params]),
        "outside": statuses_outside,
        "inside": inside,
        "edits_ok": ok,
        "refused": refused,
        "state_dict_ok": all(torch.equal(sd[n], after[n]) for n in names),
    }


def gathered_before_initialize() -> dict:
    """transformers' from_pretrained between zero.Init and initialize: GatheredParameters(list(set(...)),
    modifier_rank=0) over partitioned and persistent (below the threshold, still plain) parameters, in
    a different order on each rank; every rank must end with rank 0's values in every parameter."""
    rank = dist.get_rank()
    cfg = stage3_config()
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 8  # the 8-element biases stay plain
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = Tower()
    params = list(model.parameters())
    order = list(range(len(params)))
    random.Random(rank + 7).shuffle(order)
    with deepspeed.zero.GatheredParameters([params[i] for i in order], modifier_rank=0):
        with torch.no_grad():
            for i, p in enumerate(params):
                p.fill_(float(i + 1) if rank == 0 else -100.0)
    # transformers 4.57's _initialize_missing_keys passes list({v for v in state_dict().values()}): detached
    # tensors, not parameters (DeepSpeed drops them: no ds_id); zerodp leaves them alone too
    views = list(set(model.state_dict().values()))
    random.Random(rank).shuffle(views)
    with deepspeed.zero.GatheredParameters(views, modifier_rank=0):
        pass
    plain = [n for n, p in model.named_parameters() if not hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(params):
        got = [float(p.detach().float().mean()) for p in params]
    return {
        "plain": plain,
        "orders_differ": _all(order)[0] != _all(order)[1],
        "got": got,
        "want": [float(i + 1) for i in range(len(params))],
    }


def save_dir_mismatch() -> dict:
    """HelloDeepSpeed names its run folder from each rank's own clock: the ranks pass different save_dirs."""
    rank = dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    model = nn.Linear(4, 2)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    base = tempfile.mkdtemp(prefix=f"zerodp-clients-r{rank}-")
    out = {}
    for key, kwargs in (
        ("dir", {"save_dir": os.path.join(base, f"run-{rank}")}),
        ("tag", {"save_dir": _all(base)[0], "tag": f"step{rank}"}),
    ):
        try:
            engine.save_checkpoint(**kwargs)
            out[key] = ""
        except Exception as e:  # CheckpointError
            out[key] = f"{type(e).__name__}: {e}"
    same = _all(base)[0]
    engine.save_checkpoint(same, tag="t")  # the same arguments still save
    out["same_ok"] = os.path.isdir(os.path.join(same, "t"))
    return out


# ---- DeepSpeedExamples training/cifar/cifar10_deepspeed.py, its shape ---------------------------------
from zerodp.deepspeed.accelerator import get_accelerator  # noqa: E402  (as the script imports them)
from zerodp.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402


def cifar_ds_config(stage: int, dtype: str) -> dict[str, Any]:
    """The script's own config, key for key (batch sizes scaled down): Adam with weight_decay and no
    adam_w_mode, prescale_gradients false, cpu_offload false, fp16_master_weights_and_grads false."""
    return {
        "train_batch_size": 8,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {
            "enabled": dtype == "fp16",
            "fp16_master_weights_and_grads": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 5e7,
            "overlap_comm": True,
            "reduce_bucket_size": 5e7,
            "contiguous_gradients": True,
            "cpu_offload": False,
        },
    }


class CifarNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(6 * 3 * 3, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


def cifar_run(stage: int, dtype: str) -> dict[str, Any]:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args([])
    torch.manual_seed(0)
    net = CifarNet()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    parameters = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(parameters), "name": "parameters"}
    )
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 3, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g)
    )
    engine, optimizer, loader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=[parameters], training_data=data, config=cifar_ds_config(stage, dtype)
    )
    local_device = get_accelerator().device_name(engine.local_rank)
    target_dtype = {"bf16": torch.bfloat16, "fp16": torch.half}.get(dtype)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _epoch in range(2):
        for inputs, labels in loader:
            inputs, labels = inputs.to(local_device), labels.to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = engine(inputs)
            loss = criterion(outputs, labels)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    return {
        "losses": losses,
        "optimizer": type(optimizer).__name__,
        "weight_decay": optimizer.param_groups[0]["weight_decay"],
    }


def cifar() -> dict:
    return {f"{stage}-{dtype}": cifar_run(stage, dtype) for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16", "fp16")}


# ---- DeepSpeed-Chat step 1 / an HF config with "auto" values -----------------------------------------
from zerodp.deepspeed.compression.helper import recursive_getattr  # noqa: E402
from zerodp.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam  # noqa: E402


class TinyCausalLM(nn.Module):
    """An HF-shaped model: ``config.hidden_size``, a ``.model`` body, ``.lm_head``."""

    def __init__(self, hidden: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.config = type("Cfg", (), {"hidden_size": hidden})()
        self.model = nn.ModuleDict({"embed": nn.Embedding(vocab, hidden), "proj": nn.Linear(hidden, hidden)})
        self.lm_head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.model["proj"](self.model["embed"](ids)))
        return self.lm_head(h)


def chat_config(stage: int, offload: bool = False) -> dict[str, Any]:
    """DeepSpeed-Chat's get_train_ds_config shape: disabled hybrid_engine/tensorboard, bfloat16 alias,
    memory_efficient_linear false, prescale_gradients false, HF-style "auto" thresholds."""
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "offload_param": {"device": "none"},
            "offload_optimizer": {"device": "none"},
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": "auto",
            "reduce_bucket_size": "auto",
            "memory_efficient_linear": False,
        },
        "bfloat16": {"enabled": True},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {
            "enabled": False,
            "max_out_tokens": 512,
            "inference_tp_size": 1,
            "release_inference_cache": False,
            "pin_parameters": True,
            "tp_gather_partition_size": 8,
        },
        "tensorboard": {
            "enabled": False,
            "output_path": "step1_tensorboard/ds_tensorboard_logs/",
            "job_name": "step1_model_tensorboard",
        },
    }


def chat_run(stage: int, opt_cls: Any) -> dict[str, Any]:
    cfg = chat_config(stage)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg, enabled=stage == 3):
        model = TinyCausalLM()
    groups = [
        {"params": [p for n, p in model.named_parameters() if "bias" not in n], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if "bias" in n], "weight_decay": 0.0},
    ]
    optimizer = opt_cls(groups, lr=1e-2, betas=(0.9, 0.95))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, dist_init_required=True)
    g = torch.Generator().manual_seed(2 + dist.get_rank())
    losses = []
    for _ in range(8):
        ids = torch.randint(0, 32, (2, 5), generator=g)
        logits = engine(ids)
        loss = nn.functional.cross_entropy(logits.float().view(-1, 32), ids.view(-1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    out = {
        "losses": losses,
        "optimizer": type(engine.optimizer).__name__,
        "decoupled": bool(engine.optimizer.defaults.get("decoupled_weight_decay")),
        "model_attr": engine.model is model.model,
        "head_attr": recursive_getattr(engine, "module.lm_head") is model.lm_head,
        "tput_steps": engine.tput_timer.global_step_count,
        "config_is_dict": isinstance(engine.config, dict),
        "hidden_auto": engine.engine.config.zero_optimization.stage3_param_persistence_threshold,
    }
    # DeepSpeed-Chat's save_zero_three_model: fetch what ds_status says is not here, one parameter at a time
    saved = {}
    for k, v in engine.module.named_parameters():
        if hasattr(v, "ds_id"):
            fetch = [v] if v.ds_status == ZeroParamStatus.NOT_AVAILABLE else []
            with deepspeed.zero.GatheredParameters(fetch, enabled=stage == 3):
                saved[k] = v.data.detach().clone().cpu()
        else:
            saved[k] = v.detach().clone().cpu()
    full = engine.state_dict()
    out["save_ok"] = all(torch.equal(saved[k], full[k].to(saved[k].dtype)) for k in saved) and sorted(saved) == sorted(
        n for n, _ in model.named_parameters()
    )
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    out["consolidated"] = (
        (consolidated is None)
        if dist.get_rank()
        else all(torch.equal(consolidated[k], full[k].to(consolidated[k].dtype)) for k in full)
    )
    # the HF Trainer's PEFT save: exclude_frozen_parameters=True leaves out what requires no grad
    frozen_name, frozen = next(iter(engine.module.named_parameters()))
    frozen.requires_grad_(False)
    trained_only = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    frozen.requires_grad_(True)
    out["excluded_frozen"] = (
        (trained_only is None)
        if dist.get_rank()
        else (
            sorted(trained_only) == sorted(k for k in full if k != frozen_name)
            and all(torch.equal(trained_only[k], consolidated[k]) for k in trained_only)
        )
    )
    return out


def chat() -> dict:
    return {
        f"{stage}-{cls.__name__}": chat_run(stage, cls)
        for stage in (0, 1, 2, 3)
        for cls in (FusedAdam, DeepSpeedCPUAdam)
    }


# ---- DeepSpeedExamples training/offload_states: offload between phases, reload, train on ----------------
from zerodp.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum  # noqa: E402


def offload_round_trip() -> dict:
    out = {}
    for offload in (False, True):
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "bf16": {"enabled": True},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10},
        }
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = Tower()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        g = torch.Generator().manual_seed(3 + dist.get_rank())
        batches = [torch.randn(2, 8, generator=g) for _ in range(6)]
        losses = []
        for i, x in enumerate(batches):
            if offload and i == 3:
                before = {
                    id(t): t.clone()
                    for st in engine.optimizer.state.values()
                    for t in st.values()
                    if isinstance(t, torch.Tensor)
                }
                masters = [p.master.clone() for gr in engine.engine.groups for p in gr.pieces]
                engine.offload_states(
                    include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params],
                    device=OffloadDeviceEnum.cpu,
                    pin_memory=True,
                    non_blocking=False,
                )
                out["on_host"] = all(
                    t.device.type == "cpu"
                    for st in engine.optimizer.state.values()
                    for t in st.values()
                    if isinstance(t, torch.Tensor)
                )
                engine.reload_states()
                after = [
                    t for st in engine.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)
                ]
                out["states_equal"] = len(after) == len(before) and all(
                    any(torch.equal(a, b) for b in before.values()) for a in after
                )
                pieces = [p for gr in engine.engine.groups for p in gr.pieces]
                out["masters_equal"] = all(torch.equal(m, p.master) for m, p in zip(masters, pieces, strict=True))
                try:
                    engine.offload_states(device="nvme")
                    out["nvme"] = ""
                except NotImplementedError as e:
                    out["nvme"] = str(e)
                engine.offload_states()  # every state (default include) and back
                engine.reload_states()
            loss = engine(x.to(torch.bfloat16)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        out["losses_offload" if offload else "losses_plain"] = losses
    return out


SCENARIOS = {
    "gathered_order": gathered_order,
    "gathered_before_initialize": gathered_before_initialize,
    "save_dir_mismatch": save_dir_mismatch,
    "cifar": cifar,
    "chat": chat,
    "offload_round_trip": offload_round_trip,
}

if __name__ == "__main__":
    run_selected(worker_args(), SCENARIOS)
