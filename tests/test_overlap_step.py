"""``offload_optimizer.overlap_step`` with the NVMe optimizer offload and no parameter offload (stage 3,
world sizes 1 and 2): the run equals the NVMe offload without overlap and plain stage 3 bitwise (fp32
and bf16, gradient accumulation, clipping, a warmup scheduler, a GatheredParameters read and an eval
forward right after a step), and the steps really returned with sub-groups left to update.
The worker: tests/overlap_step_worker.py. With ``offload_param`` nvme: tests/test_param_offload.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed import run_offload_worker

WORKER = Path(__file__).with_name("overlap_step_worker.py")


@pytest.mark.parametrize("world", [1, 2])
def test_overlap_step_without_param_offload_equals_loop_in_step(world):
    results, leftover = run_offload_worker(world, "3", "noparam", WORKER)
    assert len(results) == world
    for r, res in enumerate(results):
        out = res["noparam"]
        assert out.pop("ok"), f"rank {r}:\n{out.get('error')}"
        for precision, m in out.items():
            assert m["overlap_vs_nvme"] and m["overlap_vs_plain"] and m["changed"], (r, precision, m)
            # every non-persistent unit's uses are hooked; fp32 on the CPU: the shards are the masters
            assert m["hooks"] and m["hooked_units"] == 6 and m["in_place"] == (precision == "fp32"), m
            # each step returned with sub-groups still to update (the biases' were updated inside step())
            for pending, in_step, total in m["deferred"]:
                assert pending and 0 < in_step < total, (r, precision, m["deferred"])
            assert m["finished_by_eval"], m  # the eval forward used every unit: the loop had ended
    assert leftover == []
