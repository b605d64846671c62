"""The engine's device (config key ``device``, zerodp.runtime.device), its placement of the model, the
gloo side group for control tensors (zerodp.runtime.control) and the host-sync count of a training step.

No GPU here: the CUDA decisions are tested with ``torch.cuda`` and the process group's backend patched,
and the move with ``module.to`` mocked (nothing is really moved to a GPU)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerodp
from distributed import run_python
from zerodp.entry import place_on_engine_device
from zerodp.runtime import control, device
from zerodp.runtime.device import DeviceError, check_module_device, resolve_device


@pytest.fixture
def cuda_machine(monkeypatch: pytest.MonkeyPatch):
    """A machine with 2 CUDA devices (patched), current device 0; returns the set_device mock."""
    current = {"index": 0}
    set_device = mock.Mock(side_effect=lambda i: current.__setitem__("index", i))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return set_device


def backend(monkeypatch: pytest.MonkeyPatch, config: str) -> None:
    """The (patched) backend config of every group, as torch spells it."""
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: config.split(",")[-1].split(":")[-1])


@pytest.mark.parametrize(
    "config,expected",
    [
        ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
        ("cuda:nccl", {"cuda": "nccl"}),
        ("nccl", {"cuda": "nccl"}),
        ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
    ],
)
def test_group_device_backends_parses_torch_backend_config(monkeypatch, config, expected):
    backend(monkeypatch, config)
    assert device.group_device_backends(None) == expected


def test_auto_is_local_rank_cuda_device_with_nccl(monkeypatch, cuda_machine):
    backend(monkeypatch, "cpu:gloo,cuda:nccl")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cuda", 1)
    cuda_machine.assert_called_once_with(1)  # as DeepSpeed: set_device(LOCAL_RANK) when not current
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert cuda_machine.call_count == 1  # already current: not set again


def test_auto_without_local_rank_takes_the_current_device(monkeypatch, cuda_machine):
    backend(monkeypatch, "cuda:nccl")
    assert resolve_device("auto") == torch.device("cuda", 0)
    cuda_machine.assert_not_called()


def test_auto_is_cpu_without_cuda_or_without_a_cuda_backend(monkeypatch, cuda_machine):
    backend(monkeypatch, "cpu:gloo")
    assert resolve_device("auto") == torch.device("cpu")  # CUDA present, group on gloo only
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend(monkeypatch, "cpu:gloo,cuda:nccl")
    assert resolve_device("auto") == torch.device("cpu")


def test_cpu_forced_on_a_cuda_machine(monkeypatch, cuda_machine):
    backend(monkeypatch, "cpu:gloo,cuda:nccl")
    assert resolve_device("cpu") == torch.device("cpu")
    cuda_machine.assert_not_called()


def test_cuda_refused_without_cuda_or_nccl(monkeypatch, cuda_machine):
    backend(monkeypatch, "cpu:gloo")
    with pytest.raises(DeviceError, match=r"backend \(gloo\) takes no CUDA tensors"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="torch.cuda.is_available\\(\\) is False"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda; got 'gpu'"):
        resolve_device("gpu")


def test_local_rank_beyond_the_devices_is_refused(monkeypatch, cuda_machine):
    backend(monkeypatch, "cuda:nccl")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(DeviceError, match="LOCAL_RANK is 2, but this machine has 2 CUDA device"):
        resolve_device("auto")


def test_config_key_device():
    assert zerodp.load_config({}).device == "auto"
    assert zerodp.load_config({"device": "cpu"}).device == "cpu"
    with pytest.raises(zerodp.ConfigError, match="'device'"):
        zerodp.load_config({"device": "gpu"})


def test_deepspeed_config_keeps_device_auto():
    from zerodp.deepspeed.config import resolve_deepspeed_config

    cfg = resolve_deepspeed_config({"train_micro_batch_size_per_gpu": 1, "device": "auto"})
    assert zerodp.load_config(cfg).device == "auto"


def _fake_module(*devices: torch.device) -> SimpleNamespace:
    tensors = [(f"w{i}", SimpleNamespace(device=d)) for i, d in enumerate(devices)]
    return SimpleNamespace(named_parameters=lambda: tensors, named_buffers=lambda: [])


def test_module_on_another_gpu_is_refused_naming_both():
    with pytest.raises(DeviceError, match=r"'w1' is on cuda:1, but this rank's engine device is cuda:0"):
        check_module_device(_fake_module(torch.device("cuda", 0), torch.device("cuda", 1)), torch.device("cuda", 0))


def test_module_already_there_stays_and_cpu_or_meta_moves():
    cuda0 = torch.device("cuda", 0)
    assert check_module_device(_fake_module(cuda0, cuda0), cuda0) is False
    assert check_module_device(_fake_module(torch.device("cpu"), torch.device("meta")), cuda0) is True
    assert check_module_device(nn.Linear(2, 2), torch.device("cpu")) is False


def test_initialize_moves_the_module_to_the_chosen_device(monkeypatch, cuda_machine):
    backend(monkeypatch, "cpu:gloo,cuda:nccl")
    monkeypatch.setenv("LOCAL_RANK", "1")
    model = nn.Linear(3, 2)
    moved = mock.Mock()
    monkeypatch.setattr(model, "to", moved)  # nothing can really go to a GPU here
    got = place_on_engine_device(model, zerodp.load_config({}), None)
    assert got == torch.device("cuda", 1)
    moved.assert_called_once_with(torch.device("cuda", 1))
    moved.reset_mock()
    assert place_on_engine_device(model, zerodp.load_config({"device": "cpu"}), None) == torch.device("cpu")
    moved.assert_not_called()  # already on the CPU


@pytest.mark.parametrize(
    "zc", [{"stage": 2, "offload_optimizer": {"device": "cpu"}}, {"stage": 3, "offload_param": {"device": "cpu"}}]
)
def test_offload_on_a_gpu_places_the_module_there(monkeypatch, cuda_machine, zc):
    """Offload with the engine on a GPU is no longer refused: the module goes to cuda:LOCAL_RANK (its
    host partition / shard homes are made by the offloads, tests/unit/test_offload_device.py)."""
    backend(monkeypatch, "cpu:gloo,cuda:nccl")
    model = nn.Linear(2, 2)
    moved = mock.Mock()
    monkeypatch.setattr(model, "to", moved)
    assert place_on_engine_device(model, zerodp.load_config({"zero_optimization": zc}), None) == torch.device("cuda", 0)
    moved.assert_called_once_with(torch.device("cuda", 0))


# ---- control group ---------------------------------------------------------------------------------


@pytest.fixture
def fake_world(monkeypatch: pytest.MonkeyPatch):
    """dist's group queries patched for a world of 4 ranks; new_group mocked (returns a new marker)."""
    control.forget()
    world = object()
    monkeypatch.setattr(dist, "group", SimpleNamespace(WORLD=world))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [4, 5, 6, 7])
    new_group = mock.Mock(side_effect=lambda **kw: SimpleNamespace(side_of=kw))
    monkeypatch.setattr(dist, "new_group", new_group)
    yield new_group
    control.forget()


def test_nccl_only_group_gets_one_gloo_side_group(monkeypatch, fake_world):
    backend(monkeypatch, "cuda:nccl")
    dp = object()
    side = control.control_group(dp)
    fake_world.assert_called_once_with(ranks=[4, 5, 6, 7], backend="gloo", use_local_synchronization=True)
    assert control.control_group(dp) is side and fake_world.call_count == 1  # built once
    assert control.route(torch.zeros(1), dp) is side  # host tensor: the side group
    assert control.route(torch.zeros(1, device="meta"), dp) is dp  # device tensor: the group itself
    world_side = control.control_group(None)  # the world: every rank builds it
    assert fake_world.call_args.kwargs == {"ranks": [0, 1, 2, 3], "backend": "gloo", "use_local_synchronization": False}
    assert world_side is not side and len(control.SIDE_GROUPS_BUILT) == 2


@pytest.mark.parametrize("config", ["cpu:gloo,cuda:nccl", "gloo"])
def test_group_that_takes_host_tensors_is_used_itself(monkeypatch, fake_world, config):
    backend(monkeypatch, config)
    dp = object()
    assert control.control_group(dp) is dp
    assert control.control_group(None) is None
    fake_world.assert_not_called()


def test_comm_all_reduce_of_a_host_tensor_goes_to_the_side_group(monkeypatch, fake_world):
    from zerodp.runtime import comm

    backend(monkeypatch, "cuda:nccl")
    issued = mock.Mock(return_value=None)
    monkeypatch.setattr(dist, "all_reduce", issued)
    dp = object()
    comm.all_reduce(torch.zeros(2), dp, comm.CommLedger(), "flags")
    assert issued.call_args.kwargs["group"] is control.control_group(dp) is not dp


# ---- host syncs ------------------------------------------------------------------------------------


def test_synchronize_counts_and_returns_host_values():
    device.reset_host_syncs()
    t = torch.ones(3)
    assert device.synchronize("a", t) is t  # already on the host: no copy
    device.synchronize("a")
    device.synchronize("b", device=torch.device("cpu"))  # torch.cpu.synchronize: a no-op
    assert dict(device.HOST_SYNCS) == {"a": 2, "b": 1} and device.host_syncs() == 3
    device.reset_host_syncs()
    assert device.host_syncs() == 0


def test_cpu_device_handle_streams_are_no_ops():
    cpu = torch.device("cpu")
    assert device.device_handle(cpu) is torch.cpu
    s = device.new_stream(cpu)
    device.wait_stream(device.current_stream(cpu), s)
    e = device.new_event(cpu)
    e.record()
    with device.use_stream(cpu, s):
        x = torch.ones(2) * 2
    assert e.query() and x.sum().item() == 4


# the host syncs of a training step at stages 0-3 x fp32/bf16/fp16: tests/unit/test_host_syncs.py


# ---- on a GPU (skipped here: no CUDA) ---------------------------------------------------------------

NCCL_ONLY_SCRIPT = r"""
import json, os, socket, torch, torch.distributed as dist, zerodp
from zerodp.runtime import control, device
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)  # NCCL only: no CPU backend
out = {}
for stage in (0, 1, 2, 3):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model.load_state_dict(ref.state_dict())
    ref = ref.cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)  # the config's AdamW: DeepSpeed's 0
    engine = zerodp.initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                       "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}})
    device.reset_host_syncs()
    errs = []
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g).cuda(), torch.randn(8, 4, generator=g).cuda()
        opt.zero_grad()
        want = torch.nn.functional.mse_loss(ref(x), y)
        want.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        got = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(got)
        engine.step()
        errs.append(abs(got.item() - want.item()) / abs(want.item()))
    with zerodp.zero.GatheredParameters(list(model.parameters())):
        perr = max(((a - b).abs().max() / (1e-6 + b.abs().max())).item()
                   for a, b in zip(model.parameters(), ref.parameters()))
    out[stage] = {"device": str(engine.device), "param_device": str(next(model.parameters()).device),
                  "loss_err": max(errs), "param_err": perr, "syncs": dict(device.HOST_SYNCS)}
out["side_groups"] = len(control.SIDE_GROUPS_BUILT)
zerodp.shutdown_distributed()
print(json.dumps(out))
"""


@pytest.mark.cuda
def test_nccl_only_group_trains_on_the_gpu_like_pytorch():
    """A user's init_process_group("nccl"): the engine puts the model on cuda:0, its control tensors go
    over one gloo side group, and every stage equals plain PyTorch on the GPU."""
    proc = run_python(NCCL_ONLY_SCRIPT, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["side_groups"] == 1
    for stage in ("0", "1", "2", "3"):
        r = res[stage]
        assert r["device"] == "cuda:0" and r["param_device"] == "cuda:0", r
        assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
        assert r["syncs"].get("grad_norm") == 5, r  # one host sync per step for the global norm


@pytest.mark.cuda
def test_auto_device_is_the_local_gpu():
    proc = run_python(
        "import zerodp, torch, json\n"
        "e = zerodp.initialize(torch.nn.Linear(4, 4), {})\n"
        "print(json.dumps([str(e.device), str(e.module.weight.device)]))\n"
        "zerodp.shutdown_distributed()"
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["cuda:0", "cuda:0"]
