"""Model, data and CLI tests (single process, fast), plus three tiny end-to-end ``zerodp train`` runs
(save every 3 steps, resume, uninterrupted) shared by the checkpoint, resume and consolidate tests."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

import zerodp
from zerodp.app import cli, data
from zerodp.app.model import GPT, GPTConfig, count_parameters, generate
from zerodp.runtime import accounting

CONFIGS = [
    GPTConfig(),
    GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=16),
    GPTConfig(n_layer=3, n_head=3, d_model=48, seq_len=20, vocab_size=100, tie_embeddings=False),
    GPTConfig(n_layer=2, n_head=1, d_model=8, seq_len=7, tie_embeddings=False, dropout=0.1),
]


# ---- model -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"L{c.n_layer}D{c.d_model}tie{c.tie_embeddings}")
def test_count_parameters_matches_module(cfg: GPTConfig) -> None:
    model = GPT(cfg)
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())


def test_tied_head_shares_storage_with_token_embedding() -> None:
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8))
    assert model.head.weight is model.tok_emb.weight
    assert model.head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    untied = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, tie_embeddings=False))
    assert untied.head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()


def test_forward_shapes_and_loss() -> None:
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=12)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, 256, (3, 10))
    logits, loss = model(idx)
    assert logits.shape == (3, 10, 256) and logits.dtype == torch.float32 and loss is None
    logits, loss = model(idx, idx)
    assert loss is not None and loss.shape == () and abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 13, dtype=torch.long))


def test_forward_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8)).eval()
    a = torch.randint(0, 256, (1, 8))
    b = a.clone()
    b[0, 5:] = (b[0, 5:] + 1) % 256
    la, _ = model(a)
    lb, _ = model(b)
    torch.testing.assert_close(la[:, :5], lb[:, :5])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"d_model": 30, "n_head": 4}, "n_head"),
        ({"n_layer": 0}, "n_layer"),
        ({"seq_len": -1}, "seq_len"),
        ({"vocab_size": 2.5}, "vocab_size"),
        ({"dropout": 1.0}, "dropout"),
        ({"tie_embeddings": "yes"}, "tie_embeddings"),
    ],
)
def test_config_validation_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        GPTConfig(**kwargs)


def test_config_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="allowed fields"):
        GPTConfig.from_dict({"n_layers": 2})


def test_generate_with_callable_crops_context_and_is_seeded() -> None:
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=6)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    seen: list[int] = []

    def call(idx: torch.Tensor):
        seen.append(idx.shape[1])
        return model(idx)

    prompt = torch.tensor([[1, 2, 3]])
    out1 = generate(call, prompt, 10, top_k=5, generator=torch.Generator().manual_seed(1), seq_len=6)
    out2 = generate(model, prompt, 10, top_k=5, generator=torch.Generator().manual_seed(1))
    assert out1.shape == (1, 13) and out1.dtype == torch.long
    assert torch.equal(out1, out2) and torch.equal(out1[:, :3], prompt)
    assert max(seen) == 6
    greedy = generate(model, prompt, 4, temperature=0)
    assert torch.equal(greedy, generate(model, prompt, 4, temperature=0))


# ---- data ------------------------------------------------------------------------------------------


def test_default_corpus_is_large_and_round_trips() -> None:
    text = data.load_text(None)
    tokens = data.encode(text)
    assert tokens.dtype == torch.uint8 and tokens.numel() > 100_000
    assert data.decode(tokens) == text
    assert data.decode(data.encode("héllo ✓").long()) == "héllo ✓"
    assert data.decode(torch.tensor([0xE2, 0x9C])) == "\ufffd"  # cut multi-byte char is replaced


def test_load_text_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        data.load_text(tmp_path / "missing.txt")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok" * 1000 + b"\xff\xfe")
    with pytest.raises(ValueError, match="not UTF-8"):
        data.load_text(bad)
    short = tmp_path / "short.txt"
    short.write_text("tiny", encoding="utf-8")
    with pytest.raises(ValueError, match="at least"):
        data.load_text(short)
    good = tmp_path / "good.txt"
    good.write_text("abc " * 500, encoding="utf-8")
    assert data.load_text(good) == "abc " * 500


def test_split_is_contiguous() -> None:
    tokens = torch.arange(100, dtype=torch.uint8)
    train, held = data.split(tokens, 0.1)
    assert train.numel() == 90 and held.numel() == 10
    assert torch.equal(torch.cat([train, held]), tokens)


def test_global_batches_deterministic_and_rank_slices_partition() -> None:
    tokens = data.encode(data.default_text()[:20_000])
    world, micro, T = 4, 3, 16
    a = data.GlobalBatches(tokens, T, micro, world, seed=7)
    b = data.GlobalBatches(tokens, T, micro, world, seed=7)
    x, y = a.batch(5)
    assert x.shape == (micro * world, T) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, b.batch(5)[0]) and torch.equal(y, b.batch(5)[1])
    assert not torch.equal(x, a.batch(6)[0])
    assert not torch.equal(x, data.GlobalBatches(tokens, T, micro, world, seed=8).batch(5)[0])
    slices = [data.rank_slice((x, y), r, world) for r in range(world)]
    assert all(sx.shape == (micro, T) for sx, _ in slices)
    assert torch.equal(torch.cat([sx for sx, _ in slices]), x)
    assert torch.equal(torch.cat([sy for _, sy in slices]), y)
    with pytest.raises(ValueError):
        data.rank_slice(x, world, world)


def test_heldout_batches_deterministic() -> None:
    held = data.encode(data.default_text()[-5_000:])
    b1 = data.heldout_batches(held, 32, 4, 3)
    b2 = data.heldout_batches(held, 32, 4, 3)
    assert len(b1) == 3 and all(x.shape == (4, 32) for x, _ in b1)
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(b1, b2, strict=True))
    with pytest.raises(ValueError, match="seq_len"):
        data.heldout_batches(held[:10], 32, 1, 1)


# ---- estimate CLI ----------------------------------------------------------------------------------


def test_estimate_reproduces_paper_table(capsys) -> None:
    assert cli.main(["estimate", "--params", "7.5e9", "--dp", "64"]) == 0
    out = capsys.readouterr().out
    for want in ("120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB"):
        assert want in out
    assert cli.main(["estimate", "--params", "7500000000", "--dp", "64"]) == 0
    assert capsys.readouterr().out == out


def test_estimate_counts_the_fp32_accumulation_buffer(capsys) -> None:
    """Mixed precision with accumulation: 4-byte gradients (fp32 buffer) unless told bf16."""
    psi, n = 7.5e9, 64
    cli.main(["estimate", "--params", "7.5e9", "--dp", "64", "--grad-accum", "4"])
    out = capsys.readouterr().out
    assert "grad 4" in out
    for total in ((2 + 4 + 12) * psi, (2 + 4) * psi + 12 * psi / n, 2 * psi + 16 * psi / n):  # stages 0, 1, 2
        assert accounting.human_bytes(total) in out, accounting.human_bytes(total)
    assert f"2 Psi = {accounting.human_bytes(2 * 4 * psi)}" in out  # stage 0 all-reduces the fp32 buffer
    cli.main(["estimate", "--params", "7.5e9", "--dp", "64", "--grad-accum", "4", "--grad-accum-dtype", "bf16"])
    low = capsys.readouterr().out
    assert "grad 2" in low and "120.0 GB" in low  # the paper's 16 Psi at stage 0
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--params", "7.5e9", "--dp", "64", "--fp32", "--grad-accum-dtype", "bf16"])
    assert "allowed with --fp32: fp32" in capsys.readouterr().err


def test_estimate_gpt_spec_and_json_file(capsys, tmp_path) -> None:
    cfg = GPTConfig(n_layer=12, d_model=768, n_head=12, seq_len=1024)
    cli.main(["estimate", "--params", "gpt:n_layer=12,d_model=768,n_head=12,seq_len=1024", "--dp", "8"])
    out = capsys.readouterr().out
    assert f"Psi = {count_parameters(cfg):,}" in out
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"n_layer": 2, "d_model": 64, "n_head": 4, "tie_embeddings": False}))
    cli.main(["estimate", "--params", str(path), "--dp", "2", "--fp32"])
    out = capsys.readouterr().out
    n = count_parameters(GPTConfig(n_layer=2, d_model=64, n_head=4, tie_embeddings=False))
    assert f"Psi = {n:,}" in out and "K = 8" in out


@pytest.mark.parametrize(
    "params", ["abc", "1.5", "0", "-3", "gpt:n_layer", "gpt:d_model=30,n_head=4", "gpt:layers=2", "missing.json"]
)
def test_estimate_bad_params_errors(params: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["estimate", "--params", params, "--dp", "8"])
    assert exc.value.code == 2
    assert "--params" in capsys.readouterr().err


def test_train_flag_errors(capsys, tmp_path, monkeypatch) -> None:
    def no_launch(*a, **k):
        raise AssertionError("invalid flags must be refused before launching workers")

    monkeypatch.setattr(subprocess, "run", no_launch)
    monkeypatch.setattr(cli.launch, "run_torchrun", no_launch)
    for argv, needle in [
        (["--stage", "9"], "--stage"),
        (["--steps", "x"], "--steps"),
        (["--config", "c.json", "--stage", "1"], "--config"),
        (["--config", "c.json", "--bf16"], "--bf16"),
        (["--bf16", "--fp16"], "not allowed with argument --bf16"),
        (["--save-every", "-1"], "--save-every"),
        (["--resume", "--save-dir", str(tmp_path / "none")], "no checkpoint in"),
        (["--n-head", "3"], "n_head"),
        (["--data", str(tmp_path / "none")], "cannot read"),
        (["--seq-len", "100000"], "smaller --seq-len"),  # the stdlib corpus is too short for it: say which flag
    ]:
        with pytest.raises(SystemExit) as exc:
            cli.main(["train", *argv])
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err


def test_launcher_command() -> None:
    args = cli.build_parser().parse_args(["train", "--nproc", "3", "--steps", "5", "--prompt=-x"])
    cmd = cli.launcher_command(args)
    assert cmd[:5] == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3"]
    assert "--standalone" in cmd and cmd[cmd.index("-m", 3) :][:3] == ["-m", "zerodp.app.cli", "train"]
    assert "--steps=5" in cmd and "--prompt=-x" in cmd and not any(c.startswith("--stage") for c in cmd)
    args = cli.build_parser().parse_args(
        ["train", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500"]
    )
    cmd = cli.launcher_command(args)
    assert "--standalone" not in cmd
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--master-addr") + 1] == "10.0.0.1"
    args = cli.build_parser().parse_args(["train", "--bf16", "--resume", "--save-every", "3", "--save-dir", "d"])
    cmd = cli.launcher_command(args)
    assert "--bf16" in cmd and "--resume" in cmd and "--save-every=3" in cmd and "--save-dir=d" in cmd
    assert "--fp16" not in " ".join(cmd)


def test_train_defaults_to_one_rank_per_gpu(monkeypatch, tmp_path) -> None:
    """``zerodp train`` without --nproc: one rank per GPU on a CUDA machine (the engine's "auto" device is
    cuda:LOCAL_RANK, so the old fixed 2 was refused on a one-GPU machine), 2 without CUDA; an explicit
    --nproc, the infinity preset (CPU) and the other commands keep theirs."""
    import torch

    from zerodp.app import launch

    def parsed(*argv: str) -> argparse.Namespace:
        return cli.build_parser().parse_args(list(argv))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.resolve_nproc(parsed("train"), per_gpu=True) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert launch.resolve_nproc(parsed("train"), per_gpu=True) == 1
    assert launch.resolve_nproc(parsed("train", "--nproc", "3"), per_gpu=True) == 3
    assert launch.resolve_nproc(parsed("train"), per_gpu=False) == 2
    cmd = cli.launcher_command(parsed("train"))  # torchrun_prefix alone resolves without the GPU count
    assert cmd[4] == "2"
    bench = parsed("bench")
    assert bench.nproc is None and launch.resolve_nproc(bench, per_gpu=False) == 2
    args = parsed("train", "--steps", "1")
    args.nproc = launch.resolve_nproc(args, per_gpu=True)  # what _cmd_train does before launching
    assert cli.launcher_command(args)[4] == "1"
    # a --config that puts the engine on the CPU keeps 2 ranks on a CUDA machine
    from zerodp.app import train as train_mod

    cfg = tmp_path / "cpu.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "device": "cpu"}))
    on_cpu = parsed("train", "--config", str(cfg))
    assert cli.train_nproc(on_cpu, train_mod.resolve_settings(on_cpu)) == 2
    plain = parsed("train")
    assert cli.train_nproc(plain, train_mod.resolve_settings(plain)) == 1
    # and the header says where the ranks train
    from zerodp.app.train import _device_text

    assert _device_text(torch.device("cuda", 0), 1) == "cuda:0"
    assert _device_text(torch.device("cuda", 1), 2) == "cuda:LOCAL_RANK"
    assert _device_text(torch.device("cpu"), 2) == _device_text(None, 2) == "cpu"


def test_bench_command_and_help(capsys) -> None:
    from zerodp.app import bench_args, bench_cmd

    args = cli.build_parser().parse_args(["bench", "--steps", "6", "--rounds", "2"])
    cmd = bench_cmd.bench_command(args)
    assert cmd[:5] == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    tail = cmd[cmd.index("zerodp.app.bench") + 1 :]
    assert cmd[cmd.index("zerodp.app.bench") - 1] == "-m" and "--standalone" in cmd
    assert "--steps=6" in tail and "--rounds=2" in tail and "--preset=small" in tail
    # every flag forwarded parses with bench's own parser, to the values given
    ap = argparse.ArgumentParser()
    bench_args.add_arguments(ap)
    parsed = ap.parse_args(tail)
    assert parsed.steps == 6 and parsed.rounds == 2 and parsed.preset == "small" and parsed.micro_batch is None
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0 and "--micro-batch N" in capsys.readouterr().out


def test_engine_flags_build_config() -> None:
    from zerodp.app import train

    def settings(*argv: str):
        return train.resolve_settings(cli.build_parser().parse_args(["train", *argv]))

    d = train.DEFAULTS
    s2 = settings()
    assert s2.precision == "fp32" and s2.engine_config.zero_optimization.stage == 2
    assert s2.engine_config.zero_optimization.reduce_bucket_size == d.stage2_reduce_bucket_size == 200_000
    s3 = settings("--stage", "3", "--bf16")
    z3 = s3.engine_config.zero_optimization
    assert z3.stage3_param_persistence_threshold == d.stage3_param_persistence_threshold == 1024
    assert z3.stage3_prefetch_bucket_size == d.stage3_prefetch_bucket_size == 50_000
    assert z3.stage3_max_live_parameters == d.stage3_max_live_parameters == 150_000
    assert s3.engine_config.bf16.enabled and not s3.engine_config.fp16.enabled and s3.precision == "bf16"
    s1 = settings("--stage", "1", "--fp16")
    assert s1.engine_config.fp16.enabled and s1.precision == "fp16"
    assert s1.engine_config.zero_optimization.reduce_bucket_size == 500_000_000  # stage 2 only
    assert s1.save_dir == d.save_dir and s1.save_every == 0 and not s1.resume


# ---- end to end ------------------------------------------------------------------------------------

TINY = [
    "--n-layer",
    "1",
    "--d-model",
    "32",
    "--n-head",
    "2",
    "--seq-len",
    "32",
    "--eval-batches",
    "2",
    "--sample-tokens",
    "8",
]


def _zerodp_train(*argv: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "ZERODP_DEBUG")}
    proc = subprocess.run(
        [sys.executable, "-m", "zerodp.app.cli", "train", *TINY, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory) -> dict:
    """Three 2-rank runs of a 1-layer GPT: 6 steps saving every 3, the same resumed to 9 steps, and an
    uninterrupted 9-step run (saving only at its end, to compare its weights with the resumed run's)."""
    ckpt = tmp_path_factory.mktemp("ckpt") / "run"
    first = _zerodp_train("--steps", "6", "--save-every", "3", "--save-dir", str(ckpt))
    latest_after_first = (ckpt / "latest").read_text().strip()
    resumed = _zerodp_train("--steps", "9", "--save-every", "3", "--save-dir", str(ckpt), "--resume")
    whole_ckpt = ckpt.parent / "whole"
    whole = _zerodp_train("--steps", "9", "--save-every", "9", "--save-dir", str(whole_ckpt))
    return {
        "ckpt": ckpt,
        "first": first,
        "resumed": resumed,
        "whole": whole,
        "latest_after_first": latest_after_first,
        "whole_ckpt": whole_ckpt,
    }


def _line(out: str, prefix: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, out
    return lines[0]


def test_tiny_train_run_end_to_end(tiny_runs) -> None:
    out = tiny_runs["whole"].stdout
    assert "ZeRO stage 2, fp32," in out
    assert "held-out loss (nats/byte):" in out
    assert "rank 0/2" in out and "rank 1/2" in out
    assert "per step:" in out and "= 2.000 Psi" in out
    assert "sample (8 bytes" in out
    assert sorted(p.name for p in tiny_runs["whole_ckpt"].iterdir()) == ["global_step9", "latest"]


def test_resume_continues_exactly(tiny_runs) -> None:
    first, resumed, whole = tiny_runs["first"].stdout, tiny_runs["resumed"].stdout, tiny_runs["whole"].stdout
    assert tiny_runs["latest_after_first"] == "global_step6"
    assert "checkpoints saved in" in first and "global_step3, global_step6 " in first
    assert f"resumed from {tiny_runs['ckpt'] / 'global_step6'} at step 6" in resumed
    assert "trained steps 7-9 (3 steps," in resumed
    assert "6/9" in tiny_runs["resumed"].stderr  # the bar starts at the resumed step
    # same loss before (from client_state) and after, to 6 decimals, as the uninterrupted run
    loss = _line(whole, "held-out loss")
    assert _line(resumed, "held-out loss") == loss
    assert _line(first, "held-out loss").split("->")[0] == loss.split("->")[0]
    assert _line(first, "held-out loss") != loss
    assert sorted(p.name for p in tiny_runs["ckpt"].iterdir()) == [
        "global_step3",
        "global_step6",
        "global_step9",
        "latest",
    ]


def test_resumed_weights_equal_uninterrupted_run(tiny_runs, tmp_path) -> None:
    """Bit-exact continuation: the resumed run's step-9 weights are the uninterrupted run's."""
    from safetensors.torch import load_file

    from zerodp.checkpoint import consolidate

    resumed = load_file(str(consolidate(tiny_runs["ckpt"], tmp_path / "resumed.safetensors")))
    whole = load_file(str(consolidate(tiny_runs["whole_ckpt"], tmp_path / "whole.safetensors")))
    assert sorted(resumed) == sorted(whole) and len(whole) > 0
    differ = [k for k in whole if not torch.equal(resumed[k], whole[k])]
    assert not differ, f"resumed weights differ from the uninterrupted run's: {differ}"
    early = load_file(str(consolidate(tiny_runs["ckpt"], tmp_path / "early.safetensors", tag="global_step3")))
    assert any(not torch.equal(early[k], whole[k]) for k in whole), "vacuous: training did not change weights"


def test_resume_refuses_other_seed_or_model(tiny_runs, monkeypatch, capsys) -> None:
    def no_launch(*a, **k):
        raise AssertionError("a mismatched resume must be refused before launching workers")

    monkeypatch.setattr(subprocess, "run", no_launch)
    monkeypatch.setattr(cli.launch, "run_torchrun", no_launch)
    ckpt = str(tiny_runs["ckpt"])
    for extra, needle in [
        (["--seed", "1"], "seed 0 (this run: 1)"),
        (["--d-model", "64"], "d_model=32"),
        (["--steps", "9"], "at step 9, and --steps is 9"),
    ]:
        argv = ["train", *TINY, "--steps", "12", "--save-dir", ckpt, "--resume"]
        with pytest.raises(SystemExit) as exc:
            cli.main([*argv, *extra])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "cannot resume" in err and needle in err


def test_consolidate_loads_into_plain_gpt(tiny_runs, tmp_path, capsys) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "export" / "model.safetensors"
    assert cli.main(["consolidate", str(tiny_runs["ckpt"]), str(out)]) == 0
    assert "global_step9" in capsys.readouterr().out
    model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=32))
    model.load_state_dict(load_file(str(out)))  # strict
    logits, _ = model(torch.randint(0, 256, (2, 32)))
    assert logits.shape == (2, 32, 256) and torch.isfinite(logits).all()
    # the CLI's file holds the uninterrupted run's trained values (same 9 steps, bit-exact resume)
    from zerodp.checkpoint import load_full_state_dict

    whole = load_full_state_dict(tiny_runs["whole_ckpt"])
    mine = model.state_dict()
    assert sorted(whole) == sorted(mine) and all(torch.equal(mine[k], whole[k].float()) for k in whole)
    # another tag gives other weights
    early = tmp_path / "early.safetensors"
    assert cli.main(["consolidate", str(tiny_runs["ckpt"]), str(early), "--tag", "global_step3"]) == 0
    a, b = load_file(str(out)), load_file(str(early))
    assert a.keys() == b.keys() and not torch.equal(a["tok_emb.weight"], b["tok_emb.weight"])


def test_consolidate_errors(tiny_runs, tmp_path, capsys) -> None:
    for argv in (
        [str(tmp_path / "none"), str(tmp_path / "m.safetensors")],
        [str(tiny_runs["ckpt"]), str(tmp_path / "m.bin")],
        [str(tiny_runs["ckpt"]), str(tmp_path / "m.pt"), "--tag", "global_step4"],
    ):
        assert cli.main(["consolidate", *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith("zerodp consolidate: error: ")
    assert not list(tmp_path.glob("m.*"))


def test_config_file_sets_engine_and_seed(tmp_path) -> None:
    from zerodp.app import train

    path = tmp_path / "ds_config.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 1},
                "seed": 5,
            }
        )
    )
    args = cli.build_parser().parse_args(["train", "--config", str(path), "--steps", "7"])
    s = train.resolve_settings(args)
    assert s.engine_config.zero_optimization.stage == 1 and s.engine_config.gradient_accumulation_steps == 2
    # the file's "Adam" means what it means in DeepSpeed: AdamW with weight_decay 0 (as zerodp.deepspeed reads it)
    assert (s.engine_config.optimizer.type, s.engine_config.optimizer.params.weight_decay) == ("AdamW", 0.0)
    assert (
        s.seed == 5
        and s.steps == 7
        and s.model == GPTConfig(**{k: getattr(train.DEFAULTS, k) for k in ("n_layer", "n_head", "d_model", "seq_len")})
    )
    flags = train.resolve_settings(cli.build_parser().parse_args(["train", "--stage", "0", "--lr", "0.01"]))
    assert flags.engine_config.zero_optimization.stage == 0
    assert flags.engine_config.optimizer.params.lr == 0.01 and flags.seed == train.DEFAULTS.seed


@pytest.mark.parametrize("config", [{"zero_optimization": {"stage": 2}}, {"gradient_accumulation_steps": 2}])
def test_config_file_without_batch_size_refused(tmp_path, config: dict) -> None:
    """No flag default (--micro-batch 16) and no schema default (1) silently stands in for the file's
    batch size: a file that gives none is refused, naming the keys, as DeepSpeed refuses it."""
    from zerodp.app import train

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(zerodp.ConfigError) as err:
        train.resolve_settings(cli.build_parser().parse_args(["train", "--config", str(path)]))
    msg = str(err.value)
    assert str(path) in msg and "gives no batch size" in msg, msg
    assert "'train_micro_batch_size_per_gpu'" in msg and "'train_batch_size'" in msg, msg


def test_config_file_train_batch_size_alone_sets_the_micro_batch(tmp_path) -> None:
    """``train_batch_size`` alone: each of 2 ranks trains train_batch_size / 2 sequences per step (as
    DeepSpeed derives it), not the schema's default micro batch of 1."""
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 6, "zero_optimization": {"stage": 1}}))
    proc = _zerodp_train("--config", str(path), "--steps", "1", "--save-every", "0")
    header = _line(proc.stdout, "zerodp train:")
    assert header.endswith("1 steps x 192 tokens"), header  # 6 sequences x 32 tokens


# ---- failures: one line each (see zerodp.app.launch) -------------------------------------------------


def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr  # tracebacks only with --debug / ZERODP_DEBUG=1
    return [ln for ln in stderr.splitlines() if ln.startswith("zerodp train: error")]


def test_truncated_checkpoint_is_one_line_error(tiny_runs, tmp_path) -> None:
    import shutil

    ckpt = tmp_path / "run"
    shutil.copytree(tiny_runs["ckpt"], ckpt)
    tag = (ckpt / "latest").read_text().strip()
    victim = ckpt / tag / "rank1.safetensors"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    proc = _zerodp_train("--steps", "12", "--save-dir", str(ckpt), "--resume", ok=False)
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr  # both ranks fail alike: the message is printed once
    assert "rank1.safetensors" in lines[0] and "truncated" in lines[0], lines[0]
    assert proc.returncode in (1, 2)
    assert (ckpt / "latest").read_text().strip() == tag


def test_non_finite_loss_stops_before_saving(tmp_path) -> None:
    config = tmp_path / "huge_lr.json"  # lr 1e30: the first update sends the weights to ~1e30
    config.write_text(
        json.dumps(
            {
                "optimizer": {"type": "AdamW", "params": {"lr": 1e30}},
                "zero_optimization": {"stage": 2},
                "train_micro_batch_size_per_gpu": 4,
            }
        )
    )
    save_dir = tmp_path / "ckpt"
    proc = _zerodp_train(
        "--config", str(config), "--steps", "4", "--save-every", "1", "--save-dir", str(save_dir), ok=False
    )
    assert proc.returncode == 1
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "TrainingDiverged: the training loss is nan on ranks 0, 1 at step 2" in lines[0], lines[0]
    assert f"the last checkpoint, {save_dir / 'global_step1'}, was kept" in lines[0], lines[0]
    # the step-1 checkpoint (finite weights) is still the latest; nothing was written from step 2 on
    assert (save_dir / "latest").read_text().strip() == "global_step1"
    assert sorted(p.name for p in save_dir.iterdir()) == ["global_step1", "latest"]
    assert "held-out loss" not in proc.stdout


def test_failure_summary_one_line_per_distinct_message() -> None:
    from zerodp.app import launch

    msgs = [
        {"rank": 1, "time": 2.0, "message": "ValueError: bad"},
        {"rank": 0, "time": 3.0, "message": "ValueError: bad"},
        {"rank": 2, "time": 1.0, "message": "RuntimeError: Connection closed by peer"},
    ]
    lines = launch.summarize(
        msgs,
        {
            0: "exited with code 1",
            1: "exited with code 1",
            2: "exited with code 1",
            3: "was killed by SIGTERM",
            4: "was killed by SIGKILL",
        },
    )
    assert lines == [
        "zerodp train: error on rank 2: RuntimeError: Connection closed by peer",
        "zerodp train: error on ranks 0, 1: ValueError: bad",
        "zerodp train: rank 4 was killed by SIGKILL",
        "(zerodp train --debug or ZERODP_DEBUG=1 prints every rank's traceback)",
    ]
    assert (
        launch.summarize([], {0: "was killed by SIGKILL", 1: "was killed by SIGKILL"})[0]
        == "zerodp train: ranks 0, 1 was killed by SIGKILL"
    )
    err = ValueError("invalid zerodp config:\n  'a': no (got 1)\n  'b': no (got 2)")
    assert launch.one_line(err) == "ValueError: invalid zerodp config: 'a': no (got 1); 'b': no (got 2)"


def test_worker_failure_message_and_debug_switch(tmp_path, monkeypatch) -> None:
    from zerodp.app import launch

    monkeypatch.setenv("ZERODP_DEBUG", "0")
    assert not launch.debug_enabled(None) and launch.debug_enabled(True)
    monkeypatch.setenv("ZERODP_DEBUG", "1")
    assert launch.debug_enabled(None)
    monkeypatch.setenv("ZERODP_ERROR_DIR", str(tmp_path))
    launch.report_worker_failure(ValueError("no"), 3)
    rec = json.loads((tmp_path / "rank3.json").read_text())
    assert rec["rank"] == 3 and rec["message"] == "ValueError: no"
    args = cli.build_parser().parse_args(["train", "--debug"])
    assert "--debug" in cli.launcher_command(args)


def test_progress_log_at_most_one_line_per_interval() -> None:
    import io

    from zerodp.app.progress import LOG_INTERVAL_S, ProgressLog, progress_bar

    now = [100.0]
    out = io.StringIO()
    log = ProgressLog(total=400, initial=7, stream=out, clock=lambda: now[0])
    times = [now[0]]  # clock reading at each line written
    for step in range(400 - 7):  # uneven step times: bursts of fast steps and a few slow ones
        now[0] += 0.05 if step % 50 else 6.5
        log.set_postfix({"loss": f"{step:.3f}"})
        before = out.getvalue().count("\n")
        log.update(1)
        if out.getvalue().count("\n") > before:
            times.append(now[0])
    log.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "train: 7/400 steps, 0 s"  # the start (a resumed run: its first step)
    assert len(lines) == len(times) >= 4, lines  # the run lasted long enough for several lines
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert min(gaps) >= LOG_INTERVAL_S == 10.0, gaps
    assert isinstance(progress_bar(5, enabled=True, stream=io.StringIO()), ProgressLog)  # not a TTY


def test_make_train_installs_only_the_package() -> None:
    import shutil
    from pathlib import Path

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    root = Path(__file__).resolve().parents[1]

    def installs(target: str) -> list[str]:
        out = subprocess.run(["make", "-n", "-B", target], cwd=root, capture_output=True, text=True, check=True).stdout
        return [ln for ln in out.splitlines() if "pip install" in ln and "--upgrade pip" not in ln]

    # no test dependencies for train; both take the torch pinned in constraints.txt
    assert installs("train") == [".venv/bin/pip install -q -c constraints.txt  -e ."]
    assert installs("test") == [".venv/bin/pip install -q -c constraints.txt  -e '.[dev]'"]


def test_resume_from_a_tag_other_than_latest(tiny_runs, tmp_path) -> None:
    """``--resume-tag global_step3`` in a directory without ``latest``: continues from step 3, and its
    step-6 weights are bit-identical to the first run's step-6 checkpoint."""
    import shutil

    from safetensors.torch import load_file

    from zerodp.checkpoint import consolidate

    tagged = tmp_path / "tagged"
    shutil.copytree(tiny_runs["ckpt"] / "global_step3", tagged / "global_step3")
    run = _zerodp_train("--steps", "6", "--save-every", "3", "--save-dir", str(tagged), "--resume-tag", "global_step3")
    assert f"resumed from {tagged / 'global_step3'} at step 3" in run.stdout
    mine = load_file(str(consolidate(tagged, tmp_path / "a.safetensors", tag="global_step6")))
    first = load_file(str(consolidate(tiny_runs["ckpt"], tmp_path / "b.safetensors", tag="global_step6")))
    assert sorted(mine) == sorted(first) and len(first) > 0
    assert all(torch.equal(mine[k], first[k]) for k in first)
    missing = _zerodp_train("--steps", "6", "--save-dir", str(tagged), "--resume-tag", "global_step99", ok=False)
    assert "global_step99 does not exist" in missing.stderr


def test_estimate_config_gives_offload_buffers_as_configured(capsys, tmp_path) -> None:
    """Issue 31 item 2: host and NVMe bytes of the offload buffers as a config sets them, by the
    sizing the engine uses (zerodp.offload.sizing), here recomputed by hand."""
    from zerodp.offload.sizing import AUTO_SHARE, SPLIT_ALIGN

    owned = 500_000_000  # 1e9 parameters on 2 ranks
    zo = {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_param": {
            "device": "nvme",
            "nvme_path": str(tmp_path),
            "buffer_count": 2,
            "buffer_size": 4096,
            "max_in_cpu": 8192,
        },
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {**zo, "sub_group_size": 1_000_000}}))
    assert cli.main(["estimate", "--params", "1e9", "--dp", "2", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    # 4 buffers x (3 fp32 segments) + 1 fp32 scratch per element of a 1e6 sub-group; a bf16 gradient
    # read buffer per sub-group buffer
    assert "sub_group_size 1,000,000 (set), 4 buffers" in out
    for want in (4 * (3 * 4) * 10**6 + 4 * 10**6, 4 * 2 * 10**6, 12 * owned, 2 * owned):
        assert accounting.human_bytes(want) in out, (want, out)
    assert (
        f"host pool 2 x {accounting.human_bytes(4096)} + read-ahead {accounting.human_bytes(8192)} = "
        f"{accounting.human_bytes(2 * 4096 + 8192)}"
    ) in out
    # sub_group_size not set: chosen from host_buffer_bytes (default 256 MiB) within 8% of the bytes moved off
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": zo}))
    cli.main(["estimate", "--params", "1e9", "--dp", "2", "--config", str(path)])
    out = capsys.readouterr().out
    size = int(min(256 * 2**20, AUTO_SHARE * 12 * owned) // 52) // SPLIT_ALIGN * SPLIT_ALIGN
    assert f"sub_group_size {size:,} (chosen from host_buffer_bytes 268,435,456)" in out
    assert accounting.human_bytes(52 * size) in out
    # fp16: loss scaling keeps the gradient partition in memory (no gradient swap file)
    path.write_text(json.dumps({"fp16": {"enabled": True}, "zero_optimization": zo}))
    cli.main(["estimate", "--params", "1e9", "--dp", "2", "--config", str(path)])
    out = capsys.readouterr().out
    nvme_grads = next(line for line in out.splitlines() if "nvme  reduced gradient partition" in line)
    assert nvme_grads.split()[-2:] == accounting.human_bytes(0).split(), nvme_grads
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--params", "1e9", "--dp", "2", "--config", str(tmp_path / "missing.json")])
    assert "--config" in capsys.readouterr().err
