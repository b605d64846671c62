"""No FutureWarning from torch.distributed at a stage-3 step (torch 2.13 deprecates
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` for ``all_gather_single`` /
``reduce_scatter_single``; every rank printed it once per process): two ranks train at stage 3,
gather, checkpoint and use the DeepSpeed comm facade under a FutureWarning recorder
(tests/deprecation_worker.py, on ZERODP_TEST_DEVICE)."""

from pathlib import Path

import torch.distributed as dist

from devices import skip_beyond_devices
from distributed import run_worker

WORKER = Path(__file__).with_name("deprecation_worker.py")


def test_stage3_training_raises_no_future_warning() -> None:
    skip_beyond_devices(2)
    for r, res in enumerate(run_worker(2, worker=WORKER)):
        assert res["future"] == [], (r, res["future"])
        if hasattr(dist, "all_gather_single"):  # torch >= 2.13: the old name warns, so the recorder must see it
            assert any("all_gather_into_tensor" in w for w in res["probe"]), (r, res["probe"])
