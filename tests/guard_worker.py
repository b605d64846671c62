"""Per-rank worker for tests/test_collective_guard.py: ranks that disagree about collectives.

Launched as plain processes (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment, no torchrun
agent, so a killed rank does not take the others down with it). ``--group mismatch`` runs every
divergence scenario in sequence, each on a fresh engine (a detected mismatch leaves the job's process
group unused, so the next scenario starts clean), and records per scenario the exception type and
message or the compared values. ``--group kill_train`` / ``kill_save``: rank 1 is killed with SIGKILL;
rank 0 records what it raised and how long it took.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from zerodp.app.model import GPT, GPTConfig

TIMEOUT_S = 20.0  # the guard's timeout in these tests (default 60 s); a peer's death is seen at once
SHORT_TIMEOUT_S = 3.0  # the timeout scenario's (a healthy run on a busy machine needs more)


def config(stage: int, timeout_s: float = TIMEOUT_S) -> dict:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "collective_guard": {"timeout_s": timeout_s},
    }


class Blocks(nn.Module):
    """Four linear blocks; ``skip`` / ``repeat`` make this rank's forward diverge."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.skip: set[int] = set()
        self.repeat: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            if i in self.skip:
                continue
            x = torch.tanh(b(x))
            if i in self.repeat:
                x = torch.tanh(b(x))
        return x


def train_step(engine: zerodp.Engine) -> None:
    loss = engine(torch.randn(4, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()


def outcome(fn: Callable[[], Any]) -> dict:
    t0 = time.monotonic()
    try:
        value = fn()
        return {"error": None, "value": value, "seconds": time.monotonic() - t0}
    except Exception as exc:  # recorded for the test to assert on
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - t0,
            "traceback": traceback.format_exc()[-3000:],
        }


# ---- the mismatch group ------------------------------------------------------------------------------
def save_on_rank0_only(stage: int, ckpt: Path) -> Callable[[], Any]:
    def run() -> None:
        torch.manual_seed(0)
        engine = zerodp.initialize(Blocks(), config(stage))
        train_step(engine)
        if dist.get_rank() == 0:
            engine.save_checkpoint(ckpt / f"s{stage}")
        train_step(engine)  # rank 1 trains on (rank 0 would too, after saving)

    return run


def diverge(skip: set[int], repeat: set[int]) -> Callable[[], Any]:
    def run() -> None:
        torch.manual_seed(0)
        model = Blocks()
        engine = zerodp.initialize(model, config(3))
        if dist.get_rank() == 1:
            model.skip, model.repeat = skip, repeat
        train_step(engine)

    return run


def diverge_traced(skip: set[int], repeat: set[int]) -> Callable[[], Any]:
    """As :func:`diverge`, at the third step: the module trace is recorded and agreed by then, so the
    forward's fetches are agreed by asynchronous tags (zerodp.runtime.forward_agreement). The engine
    gets a process group of its own: a rank that detects the divergence only at its next tag check may
    have launched prefetch all-gathers that its peers never launch, which leaves the engine's group
    unusable (the job must restart after any guard error); the next scenarios use the default group."""

    def run() -> None:
        torch.manual_seed(0)
        model = Blocks()
        engine = zerodp.initialize(model, config(3), process_group=dist.new_group(backend="gloo"))
        train_step(engine)
        train_step(engine)
        if dist.get_rank() == 1:
            model.skip, model.repeat = skip, repeat
        train_step(engine)

    return run


def swap_blocks_traced() -> None:
    """Rank 1 runs the tiny GPT's two (same-size) blocks in the other order at the third step: the
    all-gathers would pair up without error and silently exchange the blocks' parameters."""
    model = tiny_gpt()
    engine = zerodp.initialize(model, config(3), process_group=dist.new_group(backend="gloo"))
    idx = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        _, loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()

    step()
    step()
    if dist.get_rank() == 1:
        blocks = model.blocks._modules
        blocks["0"], blocks["1"] = blocks["1"], blocks["0"]  # iteration order only: names stay
    step()


def forward_tag_counts() -> dict:
    """Per training step of a healthy stage-3 run: synchronous agreements, forward fetch tags posted and
    blocking waits for them (the first step records the module trace: one agreement per fetch)."""
    torch.manual_seed(0)
    engine = zerodp.initialize(Blocks(), config(3))
    guard, tags = engine.collective_guard, engine.collective_guard.forward_tags
    per_step = []
    for _ in range(3):
        a, t, w = guard.agreements, tags.tags_total, tags.sync_waits
        train_step(engine)
        per_step.append(
            {"agreements": guard.agreements - a, "tags": tags.tags_total - t, "tag_waits": tags.sync_waits - w}
        )
    return {"per_step": per_step}


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=16, vocab_size=32))


def greedy(model_callable: Callable, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits, _ = model_callable(idx)
    return torch.cat([idx, logits[:, -1:].argmax(-1)], dim=1)


def reference_tokens(prompt: torch.Tensor, n: int) -> list[int]:
    model = tiny_gpt().eval()
    idx = prompt
    for _ in range(n):
        idx = greedy(model, idx)
    return idx[0].tolist()


def generation(lengths: list[int], synced: bool) -> Callable[[], Any]:
    """Greedy generation at stage 3, ``lengths[rank]`` new tokens per rank (0: the rank only serves)."""

    def run() -> dict:
        rank = dist.get_rank()
        engine = zerodp.initialize(tiny_gpt(), config(3)).eval()
        prompt = torch.tensor([[1 + rank, 2, 3]])
        state = {"idx": prompt}
        n = lengths[rank]
        if synced:

            def step(i: int, active: bool) -> bool:
                if active and n > 0:
                    state["idx"] = greedy(engine, state["idx"])
                else:
                    greedy(engine, torch.zeros(1, 1, dtype=torch.long))  # serve the gathers
                return state["idx"].shape[1] - prompt.shape[1] >= n

            zerodp.zero.synced_generate(engine, step, max_steps=max(lengths))
        else:
            for _ in range(n):
                state["idx"] = greedy(engine, state["idx"])
            engine.module_state_dict()  # the next collective call of a rank that finished early
        return {"tokens": state["idx"][0].tolist(), "reference": reference_tokens(prompt, n)}

    return run


def timeout_scenario() -> None:
    """Rank 1 is busy outside zerodp longer than the guard's timeout while rank 0 saves."""
    engine = zerodp.initialize(Blocks(), config(2, SHORT_TIMEOUT_S))
    if dist.get_rank() == 1:
        time.sleep(SHORT_TIMEOUT_S + 1.0)
    engine.module_state_dict()


def uneven_steps() -> None:
    """Rank 0 trains three steps, rank 1 two, then shuts down (an uneven data loader)."""
    engine = zerodp.initialize(Blocks(), config(0))
    for _ in range(3 if dist.get_rank() == 0 else 2):
        train_step(engine)
    results = {"steps": engine.global_steps, "micro_steps": engine.micro_steps}
    zerodp.shutdown_distributed()
    raise AssertionError(f"shutdown_distributed returned after {results}")


def mismatch_group(ckpt: Path) -> dict:
    results: dict[str, dict] = {}
    for stage in (0, 1, 2, 3):
        results[f"save_rank0_stage{stage}"] = outcome(save_on_rank0_only(stage, ckpt))
    results["skip_module"] = outcome(diverge(skip={1}, repeat=set()))
    results["call_twice"] = outcome(diverge(skip=set(), repeat={2}))
    results["skip_module_traced"] = outcome(diverge_traced(skip={1}, repeat=set()))
    results["call_twice_traced"] = outcome(diverge_traced(skip=set(), repeat={2}))
    results["skip_last_traced"] = outcome(diverge_traced(skip={3}, repeat=set()))
    results["swap_blocks_traced"] = outcome(swap_blocks_traced)
    results["forward_tag_counts"] = outcome(forward_tag_counts)
    results["unequal_generation_unsynced"] = outcome(generation([3, 2], synced=False))
    results["unequal_generation_synced"] = outcome(generation([3, 5], synced=True))
    results["rank0_only_generation"] = outcome(generation([4, 0], synced=True))
    results["timeout"] = outcome(timeout_scenario)
    results["uneven_steps"] = outcome(uneven_steps)
    zerodp.initialize(Blocks(), config(0))  # a healthy engine: its guard agrees on the shutdown
    results["shutdown"] = outcome(zerodp.shutdown_distributed)
    return results


# ---- kill groups -------------------------------------------------------------------------------------
def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_during_training() -> dict:
    engine = zerodp.initialize(Blocks(), config(2))
    for i in range(3):
        if i == 2 and dist.get_rank() == 1:
            kill_self()
        train_step(engine)
    return {}


def kill_during_save(ckpt: Path) -> dict:
    engine = zerodp.initialize(Blocks(), config(2))
    train_step(engine)
    engine.save_checkpoint(ckpt, tag="good")
    train_step(engine)
    if dist.get_rank() == 1:  # die while writing this rank's file of the next checkpoint
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith(("zerodp", "safetensors")) and hasattr(mod, "save_file"):
                mod.save_file = lambda *a, **k: kill_self()
    engine.save_checkpoint(ckpt, tag="broken")
    return {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out, rank = Path(args.out), int(os.environ["RANK"])
    dist.init_process_group("gloo")
    ckpt = out / "ckpt"
    if args.group == "mismatch":
        results = mismatch_group(ckpt)
    elif args.group == "kill_train":
        results = {"kill_train": outcome(kill_during_training)}
    else:
        results = {"kill_save": outcome(lambda: kill_during_save(ckpt))}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    if any(r["error"] for r in results.values()) and args.group != "mismatch":
        sys.exit(1)  # a lost rank: exit non-zero (without a teardown that would wait for it)


if __name__ == "__main__":
    main()
