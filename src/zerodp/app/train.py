"""The per-rank worker of ``zerodp train``: train the byte-level GPT with a zerodp engine and report.

``zerodp train`` (see :mod:`zerodp.app.cli`) launches one process per rank through ``torch.distributed.run``;
each runs :func:`run_worker`, which

1. initialises the process group (:func:`zerodp.init_distributed`), builds the same GPT on every rank
   (seeded) and wraps it with :func:`zerodp.initialize`;
2. measures the held-out loss (nats per byte) before training;
   With ``--resume`` it instead loads ``latest`` from ``--save-dir`` (see :func:`check_resume`) and
   takes the loss before training from the checkpoint's ``client_state``;
3. trains up to ``steps`` optimizer steps on :class:`zerodp.app.data.GlobalBatches` (rank ``r`` reads rows
   ``[r*micro, (r+1)*micro)`` of every global batch; optimizer step ``k`` uses micro-steps
   ``k*accum ... k*accum + accum - 1``, so a resumed run reads exactly the batches an uninterrupted one
   would) with a progress display on rank 0 (:mod:`zerodp.app.progress`), saving a checkpoint every
   ``--save-every`` steps and at the end. A non-finite training loss (fp32/bf16; fp16's loss scaler
   skips such steps) stops the run at the step where it first appears with :class:`TrainingDiverged`
   naming the step and the ranks, before that step's checkpoint is written; no checkpoint is written
   from non-finite parameters either;
4. measures the held-out loss again, generates a short sample on every rank (same seed), and prints on
   rank 0: loss before -> after, every rank's memory report, rank 0's communication report for the
   training steps, and the sample.
"""

from __future__ import annotations

import argparse
import math
import time
import zlib
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zerodp
from zerodp.app import data
from zerodp.app.model import GPT, GPTConfig, count_parameters, generate
from zerodp.app.progress import progress_bar
from zerodp.app.train_settings import (  # re-exported: the public names of zerodp.app.train
    DEFAULTS,
    ENGINE_FLAGS,
    RunSettings,
    TrainDefaults,
    engine_config_from_flags,
    resolve_settings,
)
from zerodp.runtime import accounting

# ---- checkpoints -----------------------------------------------------------------------------------

#: ``client_state["zerodp_train"]`` of checkpoints written by ``zerodp train`` (format version).
CLIENT_STATE_VERSION = 1


def corpus_fingerprint(tokens: torch.Tensor) -> dict[str, int]:
    """Length and CRC-32 of the encoded corpus (identifies the data whatever path it was read from)."""
    return {"bytes": int(tokens.numel()), "crc32": zlib.crc32(tokens.numpy().tobytes())}


def client_state(s: RunSettings, corpus: dict[str, int], world: int, loss_before: float) -> dict[str, Any]:
    """What ``zerodp train`` stores in each checkpoint's ``client_state`` (JSON)."""
    ecfg = s.engine_config
    return {
        "zerodp_train": CLIENT_STATE_VERSION,
        "seed": s.seed,
        "model": asdict(s.model),
        "corpus": corpus,
        "micro_batch": ecfg.train_micro_batch_size_per_gpu,
        "grad_accum": ecfg.gradient_accumulation_steps,
        "world_size": world,
        "loss_before": loss_before,
    }


def check_resume(s: RunSettings, corpus: dict[str, int] | None = None) -> tuple[Path, dict[str, Any], int]:
    """Find the checkpoint ``--resume`` loads (``latest`` in ``--save-dir``) and check that it fits.

    Args:
        s: this run's settings.
        corpus: :func:`corpus_fingerprint` of this run's corpus (``None``: not checked).

    Returns:
        (checkpoint directory, its ``client_state``, its global step).

    Raises:
        ValueError: no checkpoint (or an unreadable one); one not written by ``zerodp train``; a
            different seed, model shape or corpus than this run's; or a global step not below
            ``--steps`` (nothing left to train).
    """
    from zerodp import checkpoint

    d = Path(s.save_dir)
    if s.resume_tag is None and not (d / checkpoint.LATEST_FILE).is_file() and not (d / checkpoint.META_FILE).is_file():
        raise ValueError(
            f"--resume: no checkpoint in {d} (no '{checkpoint.LATEST_FILE}' file); save one "
            "with --save-every N first, or point --save-dir at the directory holding it"
        )
    path = checkpoint.resolve_checkpoint(d, s.resume_tag)  # CheckpointError is a ValueError
    meta = checkpoint.read_meta(path)
    cs = meta.client_state
    if not isinstance(cs, dict) or cs.get("zerodp_train") != CLIENT_STATE_VERSION:
        raise ValueError(
            f"cannot resume from {path}: it was not written by `zerodp train` (no zerodp_train client_state)"
        )
    diffs = []
    if cs.get("seed") != s.seed:
        diffs.append(f"seed {cs.get('seed')} (this run: {s.seed})")
    saved_model = cs.get("model")
    if saved_model != asdict(s.model):
        try:
            shown = str(GPTConfig.from_dict(saved_model)) if isinstance(saved_model, dict) else repr(saved_model)
        except (TypeError, ValueError):
            shown = repr(saved_model)
        diffs.append(f"model {shown} (this run: {s.model})")
    if corpus is not None and cs.get("corpus") != corpus:
        c = cs.get("corpus") or {}
        diffs.append(
            f"corpus of {c.get('bytes')} bytes, crc32 {c.get('crc32')} (this run: "
            f"{corpus['bytes']} bytes, crc32 {corpus['crc32']})"
        )
    if diffs:
        raise ValueError(
            f"cannot resume from {path}: it was trained with "
            + "; ".join(diffs)
            + ". Use the same --seed/model flags/--data, or another --save-dir"
        )
    if meta.global_steps >= s.steps:
        raise ValueError(
            f"cannot resume from {path}: it is at step {meta.global_steps}, and --steps is "
            f"{s.steps}; pass a larger --steps to train further"
        )
    return path, cs, meta.global_steps


def evaluate(engine: Any, batches: list[data.Batch]) -> float:
    """Mean held-out loss (nats per byte) over ``batches`` of global size ``micro * world_size``.

    Like training, rank ``r`` evaluates its :func:`zerodp.app.data.rank_slice` of every batch (so every rank
    runs the same number of forwards) and the per-rank means are averaged: the result equals a
    single-process evaluation of the whole batches, whatever the world size.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    engine.eval()
    total = 0.0
    with torch.no_grad():
        for batch in batches:
            x, y = (t.to(engine.device) for t in data.rank_slice(batch, rank, world))
            _, loss = engine(x, y)
            total += loss.item()
    engine.train()
    return _global_mean(total / len(batches))


def _global_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


class TrainingDiverged(RuntimeError):
    """The training loss or the parameters became non-finite (inf/nan); nothing was saved from that
    state."""


def _step_losses(value: float) -> list[float]:
    """Every rank's loss of this step (one all-gather of one float64 per rank), in rank order."""
    t = torch.tensor([value], dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [float(x) for x in out]


def _diverged(what: str, step: int, last_saved: Path | None) -> TrainingDiverged:
    kept = f"the last checkpoint, {last_saved}, was kept" if last_saved is not None else "no checkpoint was written"
    return TrainingDiverged(
        f"{what} at step {step}; training stopped and {kept}. Lower the learning rate "
        "(--lr, optimizer.params.lr), or set gradient_clipping in a --config file"
    )


def run_worker(args: argparse.Namespace) -> int:
    """Train and report on this rank (run under ``torch.distributed.run``; see the module docstring).

    Args:
        args: the namespace of ``zerodp train`` (unset flags are ``None`` and take :data:`DEFAULTS`).

    Returns:
        0 on success (errors raise).

    Raises:
        ValueError: invalid settings or data (see :func:`resolve_settings`, :func:`zerodp.app.data.load_text`).
    """
    t_start = time.perf_counter()
    zerodp.init_distributed()
    try:
        _run(resolve_settings(args), t_start)
    except BaseException:
        if dist.is_initialized():  # other ranks may never reach a barrier: tear down at once
            dist.destroy_process_group()
        raise
    zerodp.shutdown_distributed()
    return 0


def _device_text(device: torch.device | None, world: int) -> str:
    """Where the ranks train: ``cpu``, ``cuda:0`` (one rank), or ``cuda:LOCAL_RANK`` (None: cpu)."""
    if device is None:
        return "cpu"
    if device.type == "cpu" or world == 1:
        return str(device)
    return f"{device.type}:LOCAL_RANK"


def _precision_text(s: RunSettings) -> str:
    e = s.engine_config
    if e.bf16.enabled:
        return "bf16 (fp32 master weights)"
    if e.fp16.enabled:
        scale = (
            f"static loss scale {e.fp16.loss_scale:g}"
            if e.fp16.loss_scale > 0
            else f"dynamic loss scale from 2^{e.fp16.initial_scale_power}"
        )
        return f"fp16 ({scale}, fp32 master weights)"
    return "fp32"


def _run(s: RunSettings, t_start: float) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    # the batch keys resolved for this world size (a file may give train_batch_size alone)
    s = replace(s, engine_config=s.engine_config.for_world_size(world))
    mcfg, ecfg = s.model, s.engine_config
    micro, accum = ecfg.train_micro_batch_size_per_gpu, ecfg.gradient_accumulation_steps

    text = data.load_text(s.data, min_bytes=data.min_corpus_bytes(mcfg.seq_len))
    tokens = data.encode(text)
    corpus = corpus_fingerprint(tokens)
    train_tokens, heldout_tokens = data.split(tokens)
    batches = data.GlobalBatches(train_tokens, mcfg.seq_len, micro, world, seed=s.seed)
    eval_set = data.heldout_batches(heldout_tokens, mcfg.seq_len, micro * world, s.eval_batches)
    if s.resume:
        check_resume(s, corpus)  # a clear error before any engine is built

    torch.manual_seed(s.seed)  # identical initial weights on every rank (the engine also broadcasts)
    model = GPT(mcfg)
    engine = zerodp.initialize(model, ecfg)
    engine.train()

    start, saved, path = 0, None, None
    if s.resume:
        path, saved = engine.load_checkpoint(s.save_dir, tag=s.resume_tag)
        loss_before = float(saved["loss_before"])  # of the original run, before its first step
        start = engine.global_steps
    else:
        loss_before = evaluate(engine, eval_set)
    state = client_state(s, corpus, world, loss_before)
    tokens_per_step = micro * accum * world * mcfg.seq_len
    if rank == 0:
        schedule = f", {ecfg.scheduler.type} schedule" if ecfg.scheduler is not None else ""
        print(
            f"zerodp train: {world} rank{'s' if world != 1 else ''} on {_device_text(engine.device, world)}, "
            f"ZeRO stage {ecfg.zero_optimization.stage}, "
            f"{_precision_text(s)}{schedule}, "
            f"GPT {mcfg.n_layer} layers x d_model {mcfg.d_model} ({count_parameters(mcfg):,} params), "
            f"corpus {len(train_tokens):,} train + {len(heldout_tokens):,} held-out bytes, "
            f"{s.steps} steps x {tokens_per_step:,} tokens",
            flush=True,
        )
        if saved is not None:
            print(f"resumed from {path} at step {start} (data continues at micro-step {start * accum})", flush=True)
            if (saved.get("micro_batch", 0) * saved.get("world_size", 0), saved.get("grad_accum")) != (
                micro * world,
                accum,
            ):  # GlobalBatches depend on micro * world only
                print(
                    f"note: the checkpoint was trained with {saved.get('world_size')} ranks x micro-batch "
                    f"{saved.get('micro_batch')} x {saved.get('grad_accum')} accumulation steps; this run's "
                    f"batches differ from what an uninterrupted run would have read",
                    flush=True,
                )

    saved_paths: list[Path] = []
    save_s = 0.0
    check_loss = not ecfg.fp16.enabled  # fp16: a non-finite loss is an overflow, skipped by the scaler

    def save(step: int) -> None:
        nonlocal save_s
        if not engine.parameters_finite():
            raise _diverged(
                "the parameters became non-finite (inf/nan) in the update",
                step,
                saved_paths[-1] if saved_paths else path,
            )
        t0 = time.perf_counter()
        saved_paths.append(Path(engine.save_checkpoint(s.save_dir, client_state=state)))
        save_s += time.perf_counter() - t0

    engine.reset_comm_report()
    bar = progress_bar(s.steps, enabled=rank == 0, initial=start)
    t_train = time.perf_counter()
    for step in range(start, s.steps):
        step_loss = 0.0
        for m in range(accum):
            x, y = (t.to(engine.device) for t in data.rank_slice(batches.batch(step * accum + m), rank, world))
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / accum
        losses = _step_losses(step_loss)
        step_loss = sum(losses) / world
        if check_loss and not math.isfinite(step_loss):
            bad = [r for r, v in enumerate(losses) if not math.isfinite(v)]
            raise _diverged(
                f"the training loss is {losses[bad[0]]} on rank{'s' if len(bad) > 1 else ''} "
                f"{', '.join(map(str, bad))}",
                step + 1,
                saved_paths[-1] if saved_paths else path,
            )
        if s.save_every and (step + 1) % s.save_every == 0:
            save(step + 1)
        elapsed = time.perf_counter() - t_train - save_s
        postfix = {"loss": f"{step_loss:.3f}", "tok_s": f"{(step + 1 - start) * tokens_per_step / elapsed:,.0f}"}
        if engine.lr_scheduler is not None:
            postfix["lr"] = f"{engine.get_lr()[0]:.2e}"
        if engine.loss_scaler is not None:
            postfix["scale"] = f"{engine.loss_scale:g}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
    if s.save_every and s.steps % s.save_every != 0:
        save(s.steps)  # the final state, unless the last step already saved it
    bar.close()
    train_s = time.perf_counter() - t_train - save_s
    n_steps = s.steps - start

    comm_table = engine.comm_report().format()  # before evaluation: training collectives only
    loss_after = evaluate(engine, eval_set)
    memory = engine.memory_report().format()
    offload = engine.offload_report()
    if offload is not None:
        memory += "\n" + offload.format()
    param_line = engine.param_offload.format(engine.rank, n_steps)
    if param_line is not None:
        memory += "\n" + param_line
    gathered: list | None = [None] * world if rank == 0 else None
    dist.gather_object(memory, gathered, dst=0)

    engine.eval()
    prompt = data.encode(s.prompt).long()[None, :].to(engine.device)
    sample = _synced_sample(engine, prompt, s, mcfg.seq_len).cpu()

    if rank == 0:
        total_s = time.perf_counter() - t_start
        rule = "-" * 72
        print(rule)
        which = f"steps {start + 1}-{s.steps} ({n_steps} steps, " if start else f"{n_steps} steps ("
        print(
            f"trained {which}{n_steps * tokens_per_step:,} tokens) in {train_s:.1f} s, "
            f"{n_steps * tokens_per_step / max(train_s, 1e-9):,.0f} tokens/s; worker wall time {total_s:.1f} s"
        )
        print(f"held-out loss (nats/byte): {loss_before:.6f} -> {loss_after:.6f}")
        if ecfg.fp16.enabled:
            print(
                f"fp16 loss scale at the end {engine.loss_scale:g}; {engine.skipped_steps} of "
                f"{engine.global_steps} steps skipped (gradient overflow)"
            )
        if saved_paths:
            print(
                f"checkpoints saved in {s.save_dir}: "
                + ", ".join(p.name for p in saved_paths)
                + f" ({save_s:.1f} s, not counted above; continue with --resume, export with "
                f"`zerodp consolidate {s.save_dir} model.safetensors`)"
            )
        print(rule)
        print("model-state memory per rank (measured from the engine's tensors vs the ZeRO paper formula)")
        for table in gathered or []:
            print(table)
        print(rule)
        psi_per_step = accounting.comm_elements_per_step(
            ecfg.zero_optimization.stage, 1, ecfg.gradient_accumulation_steps
        )
        print(f"communication of rank 0 over the {n_steps} training steps (ZeRO formula: {psi_per_step} Psi per step)")
        print(comm_table)
        print(rule)
        print(f"sample ({s.sample_tokens} bytes, temperature {s.temperature}, seed {s.seed}):")
        print(data.decode(sample[0]))
        print(rule, flush=True)


def _synced_sample(engine: zerodp.Engine, prompt: torch.Tensor, s: RunSettings, seq_len: int) -> torch.Tensor:
    """One token per :func:`zerodp.zero.synced_generate` step, so a rank that finishes first (every
    rank here generates the same length, but a stop condition could end them apart) keeps serving the
    other ranks' stage-3 gathers."""
    gen = torch.Generator().manual_seed(s.seed)
    state = {"idx": prompt}

    def step(i: int, active: bool) -> bool:
        nxt = generate(engine, state["idx"], 1, temperature=s.temperature, generator=gen, seq_len=seq_len)
        if active:
            state["idx"] = nxt
        return state["idx"].shape[1] - prompt.shape[1] >= s.sample_tokens

    zerodp.zero.synced_generate(engine, step, max_steps=s.sample_tokens)
    return state["idx"]


__all__ = [
    "CLIENT_STATE_VERSION",
    "DEFAULTS",
    "ENGINE_FLAGS",
    "RunSettings",
    "TrainDefaults",
    "TrainingDiverged",
    "check_resume",
    "client_state",
    "corpus_fingerprint",
    "engine_config_from_flags",
    "evaluate",
    "resolve_settings",
    "run_worker",
]
