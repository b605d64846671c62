"""tools/run_clients.py's ``--only CLIENT:LABEL`` run filter (no client is run here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import run_clients  # noqa: E402
from run_clients import Run, parse_only, select_runs  # noqa: E402


def chat_runs() -> list[Run]:
    labels = ["s0-bf16", "s3-bf16", "s3-offload-bf16", "s0-fp16", "s3-fp16", "s3-offload-fp16"]
    return [
        Run(
            "chat",
            label,
            label[1],
            label[-4:],
            Path("main.py"),
            [],
            ref=None if label.startswith("s0") else f"s0-{label[-4:]}",
        )
        for label in labels
    ]


def test_parse_only() -> None:
    assert parse_only("cifar,chat") == {"cifar": None, "chat": None}
    assert parse_only("chat:s3,chat:s0-bf16") == {"chat": ["s3", "s0-bf16"]}
    assert parse_only("chat:s3,chat") == {"chat": None}  # the client alone: all its runs
    assert parse_only("chat,chat:s3") == {"chat": None}
    with pytest.raises(ValueError, match="unknown client 'chats'"):
        parse_only("chats:s3")
    with pytest.raises(ValueError, match="give a label after ':'"):
        parse_only("chat:")


def test_select_runs_by_label_prefix() -> None:
    runs = chat_runs() + [Run("cifar", "s0-fp32", "0", "fp32", Path("c.py"), [])]
    picked = select_runs(runs, parse_only("chat:s3"))
    assert [r.label for r in picked] == ["s3-bf16", "s3-offload-bf16", "s3-fp16", "s3-offload-fp16"]
    picked = select_runs(runs, parse_only("chat:s3-offload,chat:s0-bf16"))
    assert [r.label for r in picked] == ["s0-bf16", "s3-offload-bf16", "s3-offload-fp16"]
    assert len(select_runs(runs, parse_only("chat,cifar"))) == 7
    with pytest.raises(ValueError, match=r"chat:s9 selects no run of chat; its runs: \['s0-bf16'"):
        select_runs(runs, parse_only("chat:s9"))


def test_table_says_when_the_reference_was_left_out() -> None:
    picked = select_runs(chat_runs(), parse_only("chat:s3-bf16,chat:s0-fp16,chat:s3-fp16"))
    for run, losses in zip(picked, ([2.0, 1.0], [2.0, 1.5], [2.0, 1.0]), strict=True):
        run.result.update(status="ok", losses=losses, records=[])
    rows = {line.split("|")[2].strip(): line for line in run_clients.table(picked).splitlines()[2:]}
    assert "ref not run" in rows["s3-bf16"]  # its s0-bf16 was not selected
    assert "| ref " in rows["s0-fp16"] and "NO (" in rows["s3-fp16"]  # 1.0 vs 1.5: beyond fp16's 1e-2
