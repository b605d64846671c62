"""Per-rank worker for tests/test_save_16bit.py: zerodp's own ``Engine.save_16bit_model`` (fresh-user
report F2) at each stage of ``--stages``, fp32 and bf16.

Each job trains 2 steps on the global batch split across ranks, then ``save_16bit_model(dir)``: rank 0
reads the file back and compares it with plain PyTorch trained the same 2 steps on the whole batch (the
file in the module's dtype: bf16 holds the cast of the fp32 weights), and with the engine's own fp32
values cast. At stage 3 the refusal of ``torch.save(module.state_dict())`` is followed to the letter:
the method it names exists and works; without ``stage3_gather_16bit_weights_on_model_save`` it is
refused naming the key.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import zerodp  # noqa: E402
from distributed import run_scenarios, worker_args  # noqa: E402

MICRO = 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Net(nn.Module):
    """Two linears and a buffer (saved as it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.register_buffer("shift", torch.arange(3, dtype=torch.float32) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) + self.shift.to(x.dtype)


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    n = MICRO * dist.get_world_size()
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch in fp32 on the whole global batch, 2 SGD steps."""
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(2):
        x, y = batch(step)
        opt.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        opt.step()
    return {k: v.detach() for k, v in m.state_dict().items()}


def save_job(stage: int, precision: str, out_dir: str) -> dict:
    zero = {
        "stage": stage,
        "reduce_bucket_size": 16,
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": zero,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "bf16": {"enabled": precision == "bf16"},
    }
    e = zerodp.initialize(net(), cfg)
    lo, dtype = dist.get_rank() * MICRO, DTYPES[precision]
    for step in range(2):
        x, y = batch(step)
        e.backward(((e(x[lo : lo + MICRO].to(dtype)).float() - y[lo : lo + MICRO]) ** 2).mean())
        e.step()
    hint = ""
    if stage == 3:
        try:
            torch.save(e.module.state_dict(), io.BytesIO())
        except Exception as err:  # the stage-3 refusal: what it tells the user to call
            hint = str(err)
    d = Path(out_dir) / f"stage{stage}-{precision}"
    returned = e.save_16bit_model(d, "model16.bin")
    masters = e.module_state_dict()
    e.close()
    out: dict = {"returned": returned, "hint_names_method": "engine.save_16bit_model(save_dir)" in hint}
    if dist.get_rank() == 0:
        saved, want = torch.load(d / "model16.bin", weights_only=True), reference()
        out["keys_equal"] = list(saved) == list(want)
        out["dtypes"] = sorted({str(saved[k].dtype) for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")})
        out["buffer_equal"] = torch.equal(saved["shift"], want["shift"].to(saved["shift"].dtype))
        out["masters_cast_equal"] = all(torch.equal(saved[k], v.to(saved[k].dtype)) for k, v in masters.items())
        out["ref_err"] = max((saved[k].float() - want[k].to(dtype).float()).abs().max().item() for k in want)
    return out


def refused_without_gather_key(out_dir: str) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    e = zerodp.initialize(net(), cfg)
    message = ""
    try:
        e.save_16bit_model(Path(out_dir) / "refused")
    except ValueError as err:
        message = str(err)
    e.close()
    return {"message": message, "nothing_written": not (Path(out_dir) / "refused").exists()}


def main() -> None:
    args = worker_args("--out-dir")
    jobs: list = [
        (f"stage{s}:{p}", (lambda s=s, p=p: save_job(s, p, args.out_dir)))
        for s in map(int, args.stages.split(","))
        for p in DTYPES
    ]
    jobs.append(("refused", lambda: refused_without_gather_key(args.out_dir)))
    run_scenarios(args.out, jobs)


if __name__ == "__main__":
    main()
