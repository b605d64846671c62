"""A DeepSpeed checkpoint directory is named as such, not reported as a missing checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerodp.checkpoint.format import CheckpointError
from zerodp.checkpoint.reader import resolve_checkpoint


def _deepspeed_dir(root: Path) -> Path:
    tag = root / "global_step10"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    (root / "latest").write_text("global_step10")
    return tag


def test_deepspeed_checkpoint_named_through_latest(tmp_path: Path) -> None:
    _deepspeed_dir(tmp_path)
    with pytest.raises(CheckpointError, match=r"holds a DeepSpeed checkpoint.*zero_to_fp32\.py"):
        resolve_checkpoint(tmp_path)


def test_deepspeed_tag_directory_named_directly(tmp_path: Path) -> None:
    tag = _deepspeed_dir(tmp_path)
    with pytest.raises(CheckpointError, match=r"no checkpoint in .*holds a DeepSpeed checkpoint"):
        resolve_checkpoint(tag)


def test_missing_checkpoint_gets_no_deepspeed_hint(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("global_step3")
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint(tmp_path)
    assert "DeepSpeed" not in str(e.value) and "does not exist" in str(e.value)
