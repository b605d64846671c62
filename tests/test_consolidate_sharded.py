"""``zerodp consolidate CKPT DIR``: streaming export to HF-style sharded safetensors (issue 14).

A stage-3 bf16 checkpoint (fp32 masters, a tied pair, an int buffer) is exported with a small shard
limit; the shards + index load with zerodp's own loader and equal ``consolidate()``'s single file;
the peak live heap of the export and of a single-file ``.safetensors`` consolidate (glibc,
tests/heap_probe.py) stays near the largest tensor while a ``.pt`` consolidate (built in memory) under
the same probe holds more than the whole model. With transformers
installed, a tiny GPT-2 trained at stage 3 is exported and loads with ``from_pretrained``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

import zerodp
from heap_probe import HeapPeak
from zerodp.checkpoint import consolidate, export_sharded_safetensors, load_safetensors_weights
from zerodp.checkpoint.sharded_export import parse_size

LAYERS, D = 16, 256  # 16 x 257 KiB layers + a 514 KiB one + a tied 128 KiB pair: about 4.8 MiB in fp32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, D)
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(LAYERS))
        self.wide = nn.Linear(D, 2 * D)
        self.head = nn.Linear(2 * D, 128, bias=False)
        self.back = nn.Linear(D, 128, bias=False)
        self.back.weight = self.emb.weight  # tied
        self.register_buffer("counter", torch.arange(5, dtype=torch.int64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(torch.tanh(self.wide(h))) + self.back(h)


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    """A 1-rank gloo group in the pytest process, torn down (and its env vars restored) afterwards."""
    if dist.is_initialized():
        yield
        return
    env = dict(os.environ)
    zerodp.init_distributed()
    yield
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


def _cfg(bf16: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


@pytest.fixture(scope="module")
def saved(process_group: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    engine = zerodp.initialize(Net(), _cfg(bf16=True))  # bf16 module, fp32 masters in the checkpoint
    idx = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(idx).float().pow(2).mean())
    engine.step()
    d = tmp_path_factory.mktemp("plain")
    engine.save_checkpoint(d)
    return d


def test_shards_index_and_values(saved: Path, tmp_path: Path) -> None:
    single = load_file(str(consolidate(saved, tmp_path / "one.safetensors")))
    out = tmp_path / "hf"
    (out).mkdir()
    (out / "model-00009-of-00099.safetensors").write_bytes(b"stale")  # from an earlier export: removed
    index_path = export_sharded_safetensors(saved, out, max_shard_size="600KB")
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 6 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted(files + ["model.safetensors.index.json"])
    assert list(index["weight_map"]) == list(Net().state_dict())  # every state_dict name (tied too), in order
    total = sum(v.numel() * v.element_size() for v in single.values())
    assert index["metadata"]["total_size"] == total
    for f in files:  # each shard is a valid safetensors file within the limit (or one larger tensor)
        shard = load_file(str(out / f))
        size = sum(v.numel() * v.element_size() for v in shard.values())
        assert size <= 600_000 or len(shard) == 1
    got = load_safetensors_weights(out)
    assert sorted(got) == sorted(single) and len(got) == 38
    assert all(got[k].dtype == single[k].dtype and torch.equal(got[k], single[k]) for k in single)
    assert got["counter"].dtype == torch.int64 and got["emb.weight"].dtype == torch.float32
    assert torch.equal(got["back.weight"], got["emb.weight"])


def test_export_streams_peak_heap_near_largest_tensor(saved: Path, tmp_path: Path) -> None:
    with HeapPeak() as whole:
        consolidate(saved, tmp_path / "one.pt")  # .pt: the state dict is built in memory, then saved
    with HeapPeak() as streamed:
        export_sharded_safetensors(saved, tmp_path / "hf", max_shard_size="1MB")
    with HeapPeak() as single_file:  # one .safetensors file is streamed the same way
        consolidate(saved, tmp_path / "one.safetensors")
    single = load_file(str(tmp_path / "one.safetensors"))
    pt = torch.load(tmp_path / "one.pt", weights_only=True)
    assert sorted(pt) == sorted(single) and all(torch.equal(pt[k], single[k]) for k in pt)
    total = sum(v.numel() * v.element_size() for v in single.values())
    largest = max(v.numel() * v.element_size() for v in single.values())
    assert total > 8 * largest  # a model of many tensors, so the bound below is far from the whole
    assert whole.peak >= total  # the probe sees a whole model when one is held
    assert streamed.samples > 1000
    # the largest tensor assembled in fp32 plus the piece being read; never a shard, never the model
    for probe in (streamed, single_file):
        assert probe.peak <= 2 * largest + 256 * 1024 < 1_000_000 + largest < total


def test_parse_size_and_refusals(saved: Path, tmp_path: Path) -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(40) == 40
    assert parse_size("1.5MB") == 1_500_000
    for bad in ("5 parsecs", "0", -3, "GB"):
        with pytest.raises(ValueError, match="max shard size"):
            parse_size(bad)
    (tmp_path / "file").write_text("x")
    with pytest.raises(zerodp.checkpoint.CheckpointError, match="is not a directory"):
        export_sharded_safetensors(saved, tmp_path / "file")


def test_cli_directory_output(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from zerodp.app.cli import main

    assert main(["consolidate", str(saved), str(tmp_path / "hf"), "--max-shard-size", "1MB"]) == 0
    assert "shards of at most 1MB" in capsys.readouterr().out
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert main(["consolidate", str(saved), str(tmp_path / "m.safetensors"), "--max-shard-size", "1MB"]) == 1
    assert "--max-shard-size applies to a directory OUT" in capsys.readouterr().err
    assert main(["consolidate", str(saved), str(tmp_path / "hf2"), "--max-shard-size", "lots"]) == 1
    assert "max shard size 'lots'" in capsys.readouterr().err


def test_hf_from_pretrained_loads_the_export(process_group: None, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    engine = zerodp.initialize(transformers.AutoModelForCausalLM.from_config(config).float(), _cfg(bf16=False))
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=idx, labels=idx).loss)
    engine.step()
    expected = engine.module_state_dict()
    engine.save_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "hf"
    export_sharded_safetensors(tmp_path / "ckpt", out, max_shard_size="40KB")
    config.save_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    got = model.state_dict()
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    assert sorted(got) == sorted(expected) and len(expected) > 10
    assert all(torch.equal(got[k], expected[k].float()) for k in expected)
