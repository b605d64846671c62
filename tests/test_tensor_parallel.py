"""ZeRO (stages 1-3) over the data-parallel sub-group of a 2 x 2 tensor-parallel x data-parallel
layout, through ``zerodp.initialize(..., mpu=...)``, against the single-process full model
(tests/tp_worker.py); plus the argument checks of :func:`zerodp.runtime.topology.resolve_topology`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from distributed import run_worker
from zerodp.runtime.topology import Topology, is_model_parallel_parameter, resolve_topology

WORKER = Path(__file__).with_name("tp_worker.py")
STAGES = (1, 2, 3)
LOCAL_NUMEL = 4 * 6 + 4 + 5 * 4 + 5  # w1, b1 (column-parallel halves), w2 (row-parallel half), b2


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_worker(
        4, ",".join(map(str, STAGES)), worker=WORKER, extra_args=["--ckpt-dir", str(tmp_path_factory.mktemp("tp"))]
    )


@pytest.mark.parametrize("stage", STAGES)
def test_tp_x_dp_equals_single_process_reference(results: list[dict], stage: int) -> None:
    for r, per_rank in enumerate(results):
        res = per_rank[f"stage{stage}"]
        assert res["ok"], f"rank {r}:\n{res.get('error')}"
        assert res["max_err"] < 1e-5, f"rank {r}: parameters differ from the reference by {res['max_err']}"
        # the global gradient norm of the whole model, shards summed over the model-parallel group and
        # the replicated bias counted once; clipping was active (norm above the threshold) every step
        for got, want in zip(res["norms"], res["ref_norms"], strict=True):
            assert math.isclose(got, want, rel_tol=1e-5), (r, res["norms"], res["ref_norms"])
            assert want > 0.05
        # ZeRO's N_d is the data-parallel group's size; Psi is this model-parallel rank's shard
        assert res["dp_world_size"] == res["report_world_size"] == 2
        assert res["numel"] == res["report_numel"] == LOCAL_NUMEL
        assert res["ckpt_dirs"] == ["mp_rank_00", "mp_rank_01"]
        assert res["reload_equal"], f"rank {r}: checkpoint of its model-parallel rank did not load back"


def test_resolve_topology_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="pass either process_group or mpu"):
        resolve_topology(process_group=object(), mpu=object())
    with pytest.raises(TypeError, match=r"mpu must implement get_data_parallel_group\(\)"):
        resolve_topology(mpu=object())
    assert resolve_topology() == Topology(dp_group=None)


def test_model_parallel_marker() -> None:
    import torch

    p = torch.nn.Parameter(torch.zeros(2))
    assert not is_model_parallel_parameter(p)
    p.tensor_model_parallel = True
    assert is_model_parallel_parameter(p)


def test_grad_norm_of_a_large_fp32_gradient_keeps_fp64_accuracy() -> None:
    """One fp32 norm of a whole 8M-element gradient loses precision with its size (relative error
    2e-4 in the norm here, 4e-3 at 50M elements), where the fp64 sum it replaced was exact to
    1e-12: the norm (also used by clipping) must stay within 1e-6 of the fp64 one, for fp32, bf16 and
    fp64 gradients, an empty one and a non-contiguous one, all together."""
    import torch

    from zerodp.runtime.topology import global_grad_norm

    g = torch.Generator().manual_seed(3)
    grads = [
        torch.randn(8 * 10**6, generator=g),
        torch.randn(70_001, generator=g).bfloat16(),
        torch.randn(1000, generator=g, dtype=torch.float64),
        torch.empty(0),
        torch.randn(300, 500, generator=g).t(),
    ]
    want = math.sqrt(sum(float(t.double().pow(2).sum()) for t in grads))
    got = global_grad_norm((iter([]), iter(grads)), Topology(dp_group=None), False, None)
    assert abs(got - want) <= 1e-6 * want, (got, want, abs(got - want) / want)
    assert global_grad_norm(([], []), Topology(dp_group=None), False, None) == 0.0
