"""Checkpoint integrity: per-tensor CRC-32 checksums recorded at save time in meta.json (format
version 2), verified by load, consolidate and ``zerodp verify``; a version-1 checkpoint loads unverified.

Checksums are checked against the file's raw bytes located through the safetensors header, read here
independently of zerodp's reader.
"""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

import zerodp
from test_checkpoint import process_group, refused, train, zoo_engine  # noqa: F401 (fixture)
from zerodp.app import cli
from zerodp.checkpoint import CheckpointError, consolidate

TAG = "global_step2"


def raw_tensors(path: Path) -> dict[str, tuple[int, int]]:
    """Tensor name -> (absolute start, end) byte offsets of its data, from the safetensors header."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    return {
        k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__"
    }


def corrupt(path: Path, name: str | None = None) -> str:
    """Overwrite the middle bytes of the largest tensor (or ``name``) with 0xFF, size unchanged;
    returns the tensor's name."""
    spans = raw_tensors(path)
    name = name or max(spans, key=lambda k: spans[k][1] - spans[k][0])
    lo, hi = spans[name]
    mid, width = (lo + hi) // 2, max(1, min(16, (hi - lo) // 4))
    blob = bytearray(path.read_bytes())
    assert blob[mid : mid + width] != b"\xff" * width
    blob[mid : mid + width] = b"\xff" * width
    path.write_bytes(bytes(blob))
    return name


@pytest.fixture(scope="module")
def saved(process_group: None, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """A 1-rank stage-1 checkpoint of a model with buffers (BatchNorm), so model_extra holds tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 7), nn.BatchNorm1d(7), nn.Linear(7, 5))
    engine = zerodp.initialize(
        model, {"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 1}}
    )
    train(engine, 2)
    d = tmp_path_factory.mktemp("saved")
    engine.save_checkpoint(d)
    return d


@pytest.fixture
def ckpt(saved: Path, tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(saved, d)
    return d


def fresh_engine() -> zerodp.Engine:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(13, 7), nn.BatchNorm1d(7), nn.Linear(7, 5))
    return zerodp.initialize(
        model, {"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 1}}
    )


def test_meta_records_the_crc32_of_every_tensor_in_every_file(ckpt: Path) -> None:
    meta = json.loads((ckpt / TAG / "meta.json").read_text())
    assert meta["version"] == 2
    files = {r["file"]: r["crc32"] for r in meta["ranks"]}
    files["model_extra.safetensors"] = meta["extra_crc32"]
    compared = 0
    for file, recorded in files.items():
        path = ckpt / TAG / file
        spans = raw_tensors(path)
        assert sorted(recorded) == sorted(spans), file
        blob = path.read_bytes()
        for name, (lo, hi) in spans.items():
            assert recorded[name] == zlib.crc32(blob[lo:hi]), (file, name)
            compared += 1
    assert compared >= 10 and len(meta["extra_crc32"]) == 3  # BatchNorm: running mean/var, batch count


def test_pristine_checkpoint_verifies_and_loads(ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["verify", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "intact" in out and "checksums match" in out
    engine = fresh_engine()
    engine.load_checkpoint(ckpt)
    assert engine.global_steps == 2


@pytest.mark.parametrize("file", ["rank0.safetensors", "model_extra.safetensors"])
def test_corrupted_bytes_refused_by_load_consolidate_and_verify(
    ckpt: Path, tmp_path: Path, file: str, capsys: pytest.CaptureFixture
) -> None:
    path = ckpt / TAG / file
    size = path.stat().st_size
    name = corrupt(path)
    assert path.stat().st_size == size
    pattern = rf"checkpoint file .*{file}: tensor '{name}' is corrupt"
    refused(fresh_engine(), ckpt, pattern)  # and nothing in the engine changed
    with pytest.raises(CheckpointError, match=pattern):
        consolidate(ckpt, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    assert cli.main(["verify", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zerodp verify: error:") and f"tensor '{name}' is corrupt" in err and file in err
    assert cli.main(["consolidate", str(ckpt), str(tmp_path / "cli.safetensors")]) == 1
    assert f"tensor '{name}' is corrupt" in capsys.readouterr().err


def test_corrupted_rng_state_is_refused_on_load(ckpt: Path) -> None:
    name = corrupt(ckpt / TAG / "rank0.safetensors", "rng/torch_cpu")
    refused(fresh_engine(), ckpt, rf"tensor '{name}' is corrupt")


def test_version_1_checkpoint_loads_unverified(ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    meta_file = ckpt / TAG / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["version"] = 1
    meta.pop("extra_crc32")
    for r in meta["ranks"]:
        r.pop("crc32")
    meta_file.write_text(json.dumps(meta))
    engine = fresh_engine()
    engine.load_checkpoint(ckpt)
    assert engine.global_steps == 2
    assert cli.main(["verify", str(ckpt)]) == 0
    assert "format version 1 has no checksums" in capsys.readouterr().out


def test_version_2_meta_without_a_checksum_is_refused(ckpt: Path) -> None:
    meta_file = ckpt / TAG / "meta.json"
    meta = json.loads(meta_file.read_text())
    dropped = sorted(meta["ranks"][0]["crc32"])[0]
    del meta["ranks"][0]["crc32"][dropped]
    meta_file.write_text(json.dumps(meta))
    refused(fresh_engine(), ckpt, r"rank0.safetensors: 'crc32' must list a checksum for each of its tensors")
