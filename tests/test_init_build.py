"""``zerodp.zero.Init`` on unmodified constructors (issue 9 item 4), tests/init_build_worker.py on 1 and 2
gloo ranks (one launch each).

- Weights: built under ``Init`` then ``initialize``d, every parameter equals (bit for bit) the same
  constructor built without ``Init`` then ``initialize``d, in fp32 and bf16, for an HF-style model with
  ``post_init()``, a nanoGPT-style ``self.apply(_init_weights)`` model (with a root parameter and an
  ``orthogonal_`` init, which has no bf16 kernel on CPU), ``nn.Sequential(*layers)``, a free-standing
  ``nn.Linear`` and a module registering parameters before and after a child; every parameter above
  the persistence threshold was partitioned by ``Init`` itself and the engine adopted Init's units.
- Build peak (2 ranks): the live heap (glibc) while ``nn.Sequential(*[nn.Linear(512, 512)] * 8)`` is built
  under ``Init`` stays within Init's shards plus two and a half layers (the module being partitioned,
  the next module's first parameter, which exists when its registration ends the previous module's
  construction, and the shard being cut), and below building without ``Init``. Partitioning a module
  only when it is attached to its parent held all 8 layers at once (10.0 MB against this bound's 6.8 MB).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed import run_worker

WORKER = Path(__file__).with_name("init_build_worker.py")
MODELS = ["hf", "nano", "sequential", "free_linear", "late_param"]


@pytest.fixture(scope="module", params=[1, 2])
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, run_worker(request.param, stages="3", scenarios="all", worker=WORKER)


def _rows(results: tuple[int, list[dict]], name: str) -> list[dict]:
    rows = [r[name] for r in results[1]]
    for row in rows:
        assert row["ok"], row.get("error")
    return rows


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model", MODELS)
def test_init_gives_the_same_weights_as_without_it(results: tuple[int, list[dict]], model: str, precision: str) -> None:
    for row in _rows(results, f"weights_{model}_{precision}"):
        assert len(row["keys"]) > 0
        assert row["identical"] == row["keys"]  # bit-identical, every parameter
        assert row["dtypes"] == [f"torch.{'float32' if precision == 'fp32' else 'bfloat16'}"]
        assert row["partitioned"] == row["big"] > 0  # Init itself partitioned every large parameter
        assert row["held_after_init"] < row["full_elements"] / 10
        assert row["adopted"] == row["init_units"]  # the engine took Init's units as they are
        if model in ("hf", "nano"):
            assert row["touch_gathers"] > 0  # it edited partitioned parameters
        else:
            assert row["touch_gathers"] == 0  # each layer's own init ran before its partition
        if model in ("hf", "nano"):
            assert row["weight_std_max"] < 0.03  # the post-construction init ran (default: ~0.1-0.25)


def test_init_build_peak_is_one_layer_above_the_shards(results: tuple[int, list[dict]]) -> None:
    world, _ = results
    for row in _rows(results, "build_peak"):
        assert row["samples"] > 1000  # the probe saw the construction
        assert row["plain_peak"] >= row["model_bytes"]  # without Init: the whole model
        assert row["shard_bytes"] >= (row["model_bytes"] - 64) / world  # every layer partitioned
        assert row["held_after_init"] <= 1  # only the last 1-element bias is left full
        if world > 1:
            assert row["init_peak"] <= row["shard_bytes"] + 2.5 * row["largest_layer_bytes"]
            assert row["init_peak"] < row["plain_peak"]
