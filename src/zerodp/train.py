"""The per-rank worker of ``zerodp train``: train the byte-level GPT with a zerodp engine and report.

``zerodp train`` (see :mod:`zerodp.cli`) launches one process per rank through ``torch.distributed.run``;
each runs :func:`run_worker`, which

1. initialises the process group (:func:`zerodp.init_distributed`), builds the same GPT on every rank
   (seeded) and wraps it with :func:`zerodp.initialize`;
2. measures the held-out loss (nats per byte) before training;
3. trains ``steps`` optimizer steps on :class:`zerodp.data.GlobalBatches` (rank ``r`` reads rows
   ``[r*micro, (r+1)*micro)`` of every global batch) with a tqdm bar on rank 0;
4. measures the held-out loss again, generates a short sample on every rank (same seed), and prints on
   rank 0: loss before -> after, every rank's memory report, rank 0's communication report for the
   training steps, and the sample.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

import zerodp
from zerodp import accounting, data
from zerodp.config import ZeroDPConfig, load_config
from zerodp.model import GPT, GPTConfig, count_parameters, generate


@dataclass(frozen=True)
class TrainDefaults:
    """Defaults of ``zerodp train`` flags (the single place they are set; the CLI shows them).

    Sized so that 2 ranks at ZeRO stage 2 on a 2-core CPU finish in about two minutes.
    """

    nproc: int = 2
    stage: int = 2
    steps: int = 500
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 128
    micro_batch: int = 16
    grad_accum: int = 1
    lr: float = 2e-3
    seed: int = 0
    eval_batches: int = 8
    sample_tokens: int = 200
    prompt: str = "The "
    temperature: float = 0.8
    gradient_clipping: float = 1.0


DEFAULTS = TrainDefaults()


@dataclass(frozen=True)
class RunSettings:
    """Fully resolved settings of one run (flags, config file and defaults merged)."""

    engine_config: ZeroDPConfig
    model: GPTConfig
    data: Optional[str]
    steps: int
    seed: int
    eval_batches: int
    sample_tokens: int
    prompt: str
    temperature: float


def _pick(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name, None)
    return getattr(DEFAULTS, name) if value is None else value


def engine_config_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """DeepSpeed-style config dict built from ``--stage --lr --micro-batch --grad-accum --seed``."""
    return {
        "train_micro_batch_size_per_gpu": _pick(args, "micro_batch"),
        "gradient_accumulation_steps": _pick(args, "grad_accum"),
        "optimizer": {"type": "AdamW", "params": {"lr": _pick(args, "lr"), "betas": [0.9, 0.95],
                                                  "weight_decay": 0.0}},
        "zero_optimization": {"stage": _pick(args, "stage")},
        "gradient_clipping": DEFAULTS.gradient_clipping,
        "seed": _pick(args, "seed"),
    }


def resolve_settings(args: argparse.Namespace) -> RunSettings:
    """Merge flags (``None`` = not given), the ``--config`` file and :data:`DEFAULTS`.

    With ``--config``, the engine settings (stage, optimizer, batch sizes) come from the file and
    ``--stage/--lr/--micro-batch/--grad-accum`` must not be given; ``--seed`` defaults to the file's
    ``seed`` if it has one.

    Raises:
        ValueError: ``--config`` combined with an engine flag, or an invalid model shape.
        zerodp.ConfigError: invalid config file.
    """
    config_path = getattr(args, "config", None)
    if config_path is not None:
        clash = [f"--{n.replace('_', '-')}" for n in ("stage", "lr", "micro_batch", "grad_accum")
                 if getattr(args, n, None) is not None]
        if clash:
            raise ValueError(f"--config sets the engine; do not combine it with {', '.join(clash)} "
                             f"(put those values in the config file instead)")
        engine_config = load_config(config_path)
        seed = args.seed if getattr(args, "seed", None) is not None else (
            engine_config.seed if engine_config.seed is not None else DEFAULTS.seed)
    else:
        engine_config = load_config(engine_config_from_flags(args))
        seed = _pick(args, "seed")
    prompt = _pick(args, "prompt")
    if not prompt:
        raise ValueError("--prompt must not be empty")
    model = GPTConfig(n_layer=_pick(args, "n_layer"), n_head=_pick(args, "n_head"),
                      d_model=_pick(args, "d_model"), seq_len=_pick(args, "seq_len"))
    return RunSettings(
        engine_config=engine_config, model=model, data=getattr(args, "data", None),
        steps=_pick(args, "steps"), seed=seed, eval_batches=_pick(args, "eval_batches"),
        sample_tokens=_pick(args, "sample_tokens"), prompt=prompt,
        temperature=_pick(args, "temperature"),
    )


def evaluate(engine: Any, batches: list[data.Batch]) -> float:
    """Mean held-out loss (nats per byte) over ``batches`` of global size ``micro * world_size``.

    Like training, rank ``r`` evaluates its :func:`zerodp.data.rank_slice` of every batch (so every rank
    runs the same number of forwards) and the per-rank means are averaged: the result equals a
    single-process evaluation of the whole batches, whatever the world size.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    engine.eval()
    total = 0.0
    with torch.no_grad():
        for batch in batches:
            x, y = data.rank_slice(batch, rank, world)
            _, loss = engine(x, y)
            total += loss.item()
    engine.train()
    return _global_mean(total / len(batches))


def _global_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


class _LineStream:
    """File-like wrapper turning tqdm's ``\\r`` redraws into one plain line per refresh (for logs)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, s: str) -> None:
        s = s.replace("\r", "").strip()
        if s:
            self.stream.write(s + "\n")

    def flush(self) -> None:
        self.stream.flush()


def _progress_bar(total: int, enabled: bool) -> tqdm:
    """tqdm on stderr. When stderr is not a TTY (a log file, CI), it refreshes at most every 10 s and
    each refresh is a separate line instead of a carriage-return redraw."""
    tty = sys.stderr.isatty()
    return tqdm(total=total, disable=not enabled, desc="train", unit="step", dynamic_ncols=tty,
                mininterval=0.2 if tty else 10.0, ascii=not tty,
                file=sys.stderr if tty else _LineStream(sys.stderr))


def run_worker(args: argparse.Namespace) -> int:
    """Train and report on this rank (run under ``torch.distributed.run``; see the module docstring).

    Args:
        args: the namespace of ``zerodp train`` (unset flags are ``None`` and take :data:`DEFAULTS`).

    Returns:
        0 on success (errors raise).

    Raises:
        ValueError: invalid settings or data (see :func:`resolve_settings`, :func:`zerodp.data.load_text`).
    """
    t_start = time.perf_counter()
    zerodp.init_distributed()
    try:
        _run(resolve_settings(args), t_start)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _run(s: RunSettings, t_start: float) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mcfg, ecfg = s.model, s.engine_config
    micro, accum = ecfg.train_micro_batch_size_per_gpu, ecfg.gradient_accumulation_steps

    text = data.load_text(s.data, min_bytes=data.min_corpus_bytes(mcfg.seq_len))
    train_tokens, heldout_tokens = data.split(data.encode(text))
    batches = data.GlobalBatches(train_tokens, mcfg.seq_len, micro, world, seed=s.seed)
    eval_set = data.heldout_batches(heldout_tokens, mcfg.seq_len, micro * world, s.eval_batches)

    torch.manual_seed(s.seed)  # identical initial weights on every rank (the engine also broadcasts)
    model = GPT(mcfg)
    engine = zerodp.initialize(model, ecfg)
    engine.train()

    loss_before = evaluate(engine, eval_set)
    tokens_per_step = micro * accum * world * mcfg.seq_len
    if rank == 0:
        print(f"zerodp train: {world} ranks, ZeRO stage {ecfg.zero_optimization.stage}, "
              f"GPT {mcfg.n_layer} layers x d_model {mcfg.d_model} ({count_parameters(mcfg):,} params), "
              f"corpus {len(train_tokens):,} train + {len(heldout_tokens):,} held-out bytes, "
              f"{s.steps} steps x {tokens_per_step:,} tokens", flush=True)

    engine.reset_comm_report()
    bar = _progress_bar(s.steps, enabled=rank == 0)
    t_train = time.perf_counter()
    for step in range(s.steps):
        step_loss = 0.0
        for m in range(accum):
            x, y = data.rank_slice(batches.batch(step * accum + m), rank, world)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / accum
        step_loss = _global_mean(step_loss)
        elapsed = time.perf_counter() - t_train
        bar.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{(step + 1) * tokens_per_step / elapsed:,.0f}",
                        refresh=False)
        bar.update(1)
    bar.close()
    train_s = time.perf_counter() - t_train

    comm_table = engine.comm_report().format()  # before evaluation: training collectives only
    loss_after = evaluate(engine, eval_set)
    memory = engine.memory_report().format()
    gathered: Optional[list] = [None] * world if rank == 0 else None
    dist.gather_object(memory, gathered, dst=0)

    engine.eval()
    prompt = data.encode(s.prompt).long()[None, :]
    sample = generate(engine, prompt, s.sample_tokens, temperature=s.temperature,
                      generator=torch.Generator().manual_seed(s.seed), seq_len=mcfg.seq_len)

    if rank == 0:
        total_s = time.perf_counter() - t_start
        rule = "-" * 72
        print(rule)
        print(f"trained {s.steps} steps ({s.steps * tokens_per_step:,} tokens) in {train_s:.1f} s, "
              f"{s.steps * tokens_per_step / train_s:,.0f} tokens/s; worker wall time {total_s:.1f} s")
        print(f"held-out loss (nats/byte): {loss_before:.3f} -> {loss_after:.3f}")
        print(rule)
        print("model-state memory per rank (measured from the engine's tensors vs the ZeRO paper formula)")
        for table in gathered or []:
            print(table)
        print(rule)
        psi_per_step = accounting.comm_elements_per_step(ecfg.zero_optimization.stage, 1)
        print(f"communication of rank 0 over the {s.steps} training steps "
              f"(ZeRO formula: {psi_per_step} Psi per step)")
        print(comm_table)
        print(rule)
        print(f"sample ({s.sample_tokens} bytes, temperature {s.temperature}, seed {s.seed}):")
        print(data.decode(sample[0]))
        print(rule, flush=True)
