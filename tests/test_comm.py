"""zerodp.runtime.comm's reduce-scatter of host tensors on gloo: an all-to-all and a local sum (gloo's
own reduce-scatter costs more than its all-reduce, see [Note: gloo reduce-scatter]). It must give what
torch's reduce-scatter gives, leave its input alone, and sum only after a wait that completed."""

from datetime import timedelta
from pathlib import Path

import pytest
import torch
from tests.distributed import run_worker

from zerodp.runtime import comm

WORKER = Path(__file__).with_name("comm_worker.py")


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_by_all_to_all_matches_torch(world: int) -> None:
    for r, res in enumerate(run_worker(world, worker=WORKER)):
        assert res["all_to_all_path"] is True  # host tensors on gloo take the all-to-all
        assert len(res["cases"]) == 18
        for case in res["cases"]:
            assert case["input_unchanged"], case
            if world == 2 or case["kind"] == "integers":  # a + b = b + a; integer sums are exact
                assert case["equal"] == [True, True, True], (r, case)
            else:  # three ranks: torch's ring may add in another order
                tol = {"torch.float32": 1e-6, "torch.bfloat16": 1e-2, "torch.float64": 1e-14}[case["dtype"]]
                assert case["max_err"] <= tol * max(1.0, case["scale"]) * 4, (r, case)
        assert "received must be like input" in res["bad_scratch"]
        # sizes that do not split into N chunks of the output raise (as torch's), not sum wrong rows
        assert res["bad_sizes"] is not None and "elements" in res["bad_sizes"], res["bad_sizes"]
        assert res["two_d"] == {"shape": [2, 3], "equal": True}, res["two_d"]
        assert res["ledger_reduce_scatter"] == [len(res["cases"]) * 3 + 1]


class _SlowWork:
    """A Work whose first timed wait runs out (as a polling slice does), then completes."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        if timeout is not None and self.waits == 1:
            raise RuntimeError("Wait timed out")
        return True

    def is_completed(self) -> bool:
        return self.waits > 1


def test_sum_happens_once_and_only_after_a_completed_wait() -> None:
    received = torch.tensor([1.0, 2.0, 10.0, 20.0])  # two ranks' chunks of 2 elements
    out = torch.zeros(2)
    work = comm._SumOnWait(_SlowWork(), received, out)
    with pytest.raises(RuntimeError, match="timed out"):
        work.wait(timedelta(seconds=0.05))
    assert out.tolist() == [0.0, 0.0]  # not summed while the exchange may still be writing
    work.wait(timedelta(seconds=0.05))
    assert out.tolist() == [11.0, 22.0]
    out.zero_()
    work.wait()
    assert out.tolist() == [0.0, 0.0]  # summed once
    first_out = torch.zeros(2)
    both = comm.AllOf([comm._SumOnWait(_SlowWork(), torch.ones(4), first_out), _SlowWork()])
    for _ in range(2):  # each Work's first slice runs out, in turn
        with pytest.raises(RuntimeError, match="timed out"):
            both.wait(timedelta(seconds=0.05))
        assert not both.is_completed()
    assert first_out.tolist() == [2.0, 2.0]  # the first completed and was summed meanwhile
    both.wait(timedelta(seconds=0.05))
    assert both.is_completed()
