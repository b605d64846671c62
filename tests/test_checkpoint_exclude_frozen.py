"""Issue 26 item 5: ``save_checkpoint(..., exclude_frozen_parameters=True)`` (DeepSpeed PR 3953, LoRA
checkpoints) writes only the trained parameters and their optimizer states; ``load_checkpoint`` into a
model whose frozen part was loaded separately resumes exactly; ``zerodp consolidate`` names the absent
parameters.

One torchrun launch per world size (1 and 3) runs tests/exclude_frozen_worker.py at every stage, precision
(fp32, bf16, fp16) and optimizer offload (none, cpu); the trained values are compared with plain PyTorch
computed in the worker, and the resumed run with the uninterrupted one bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from distributed import run_worker
from zerodp import checkpoint
from zerodp.app.cli import main

WORKER = Path(__file__).with_name("exclude_frozen_worker.py")
FROZEN = ["base1.bias", "base1.weight", "base2.weight"]
TRAINED = ["a.weight", "b.weight", "base2.bias"]
#: trained values against fp32 plain PyTorch after 4 Adam steps (relative to the largest value)
TOL = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 1e-2}
_cache: dict[int, tuple[Path, list[dict]]] = {}


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory):
    def get(world_size: int) -> tuple[Path, list[dict]]:
        if world_size not in _cache:
            d = tmp_path_factory.mktemp(f"exclude{world_size}")
            _cache[world_size] = (d, run_worker(world_size, worker=WORKER, extra_args=["--ckpt", str(d)]))
        return _cache[world_size]

    return get


def cases() -> list:
    return [
        pytest.param(w, s, p, o, id=f"w{w}-stage{s}-{p}-{o}")
        for w in (1, 3)  # 3: several ranks and uneven shards; 2 adds no path (see tests/test_stages.py)
        for s in (0, 1, 2, 3)
        for p in ("fp32", "bf16", "fp16")
        for o in (("none",) if s == 0 else ("none", "cpu"))
    ]


@pytest.mark.parametrize("world_size,stage,precision,offload", cases())
def test_exclude_frozen_parameters(launch, world_size: int, stage: int, precision: str, offload: str) -> None:
    _, results = launch(world_size)
    for r, res in enumerate(results):
        res = res[f"exclude/stage{stage}/{precision}/{offload}"]
        assert res["ok"], f"rank {r} raised:\n{res.get('error')}"
        assert res["resumed_bitwise"] == [], f"resumed run differs from the uninterrupted one: {res['resumed_bitwise']}"
        assert res["frozen_kept"], "load_checkpoint changed the frozen parameters loaded separately"
        assert res["ref_err"] <= TOL[precision], res["ref_err"]
        assert res["frozen_err"] <= (0 if precision == "fp32" else 1e-2), res["frozen_err"]
        if r == 0:
            assert sorted(res["excluded"]) == FROZEN
            assert res["extra_keys"] == []  # no buffers in this model, and no frozen parameter
            assert res["piece_names"] == TRAINED
            assert res["consolidated_keys"] == TRAINED
            assert len(res["warnings"]) == 1 and all(k in res["warnings"][0] for k in FROZEN)


def test_consolidate_names_absent_parameters(launch, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d, _ = launch(3)
    src = d / "stage3-bf16-none"
    out = tmp_path / "lora.safetensors"
    assert main(["consolidate", str(src), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "absent" in printed and all(k in printed for k in FROZEN) and "exclude_frozen_parameters" in printed
    assert sorted(load_file(str(out))) == TRAINED
    assert main(["consolidate", str(src), str(tmp_path / "hf")]) == 0  # sharded: the same
    printed = capsys.readouterr().out
    assert all(k in printed for k in FROZEN)
    with pytest.warns(checkpoint.reader.AbsentParametersWarning, match="base1.weight"):
        checkpoint.export_sharded_safetensors(src, tmp_path / "hf2")


def test_load_refused_where_an_excluded_parameter_trains(launch) -> None:
    _, results = launch(1)
    res = results[0]["refuse"]
    assert res["ok"], res.get("error")
    assert res["refused"] and res["unchanged"]
    assert "'base2.weight'" in res["message"] and "exclude_frozen_parameters=True" in res["message"]
