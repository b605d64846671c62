"""Swap files do not outlive a killed job (zerodp.offload.swap_dir): SIGTERM and SIGINT to a rank,
and SIGTERM to torchrun's agent, remove the job's swap files before the processes end; a job killed by
SIGKILL leaves a directory that the next start under the same nvme_path names in one warning with its
size and removes only when asked (``remove_stale_swap``, ``zerodp clean-swap``), never a live job's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import zerodp
from zerodp.app.cli import main as cli_main
from zerodp.offload.swap_dir import OWNER_FILE, find_stale

RANK_SCRIPT = """
import os, sys, time, pathlib, torch, zerodp
from torch import nn
if "RANK" in os.environ:
    zerodp.init_distributed(timeout_s=60)
nvme, ready = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
e = zerodp.initialize(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)),
                      {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}})
e.backward(e(torch.ones(2, 64)).sum()); e.step()
pathlib.Path(ready, os.environ.get("RANK", "0")).write_text(e.optimizer_offload.file.path)
while True:
    time.sleep(0.05)
"""


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(tmp_path: Path, torchrun: bool = False, nproc: int = 1) -> tuple[subprocess.Popen, Path, Path]:
    nvme, ready = tmp_path / "nvme", tmp_path / "ready"
    nvme.mkdir(exist_ok=True)
    ready.mkdir(exist_ok=True)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    cmd = [sys.executable, str(script), str(nvme), str(ready)]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *cmd[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    # a job started in the background by a non-interactive shell (nohup, `cmd &`) inherits SIGINT
    # ignored, and Python and zerodp then leave it ignored: give the rank SIGINT's default disposition,
    # as an interactive or scheduler-started process has
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_default_sigint
    )
    deadline = time.time() + 90
    while len(list(ready.iterdir())) < nproc:
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"rank script did not get ready: rc {proc.poll()}\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.1)
    swaps = [Path(f.read_text()) for f in ready.iterdir()]
    assert all(s.exists() and s.stat().st_size > 0 for s in swaps)
    return proc, nvme, ready


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_rank_removes_its_swap_files(tmp_path, sig):
    proc, nvme, _ = _start(tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGTERM:  # ends with the signal's status, as without zerodp
        assert proc.returncode == -signal.SIGTERM, (proc.returncode, err[-2000:])
    else:  # SIGINT's default handler: KeyboardInterrupt
        assert proc.returncode != 0 and "KeyboardInterrupt" in err, (proc.returncode, err[-2000:])
    assert list(nvme.iterdir()) == []


def test_sigterm_to_torchrun_agent_removes_every_rank_swap_files(tmp_path):
    proc, nvme, _ = _start(tmp_path, torchrun=True, nproc=2)
    assert len(list(nvme.iterdir())) == 1 and len(list(next(nvme.iterdir()).iterdir())) == 2
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=90)
    assert list(nvme.iterdir()) == []


def test_sigkill_leftovers_are_named_and_removed_only_when_asked(tmp_path, capsys):
    dead, nvme, _ = _start(tmp_path)
    dead.kill()  # SIGKILL: no chance to clean up
    dead.communicate(timeout=30)
    (left,) = list(nvme.iterdir())
    assert (left / "rank0" / OWNER_FILE).exists()
    # a live job under the same path: never stale, never removed
    (tmp_path / "ready" / "0").unlink()
    live, _, _ = _start(tmp_path)
    try:
        stale = find_stale(str(nvme))
        assert [s.path for s in stale] == [str(left)] and stale[0].bytes > 0, stale
        # the next start names it, with its size, in one warning and keeps it
        torch.manual_seed(0)
        cfg = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}}}
        import zerodp.offload.swap_dir as swap_dir

        swap_dir._announced.discard(str(nvme))
        with pytest.warns(UserWarning, match="left by jobs whose processes are gone") as rec:
            e = zerodp.initialize(nn.Linear(8, 8), cfg)
        msgs = [str(w.message) for w in rec if "processes are gone" in str(w.message)]
        assert len(msgs) == 1 and str(left) in msgs[0] and f"{stale[0].bytes:,} bytes" in msgs[0], msgs
        assert "zerodp clean-swap" in msgs[0]
        assert left.exists()
        e.close()
        # zerodp clean-swap --dry-run lists, clean-swap removes the dead job's directory only
        assert cli_main(["clean-swap", str(nvme), "--dry-run"]) == 0
        assert left.exists() and "would remove 1 swap directory" in capsys.readouterr().out
        assert cli_main(["clean-swap", str(nvme)]) == 0
        assert f"removed {left}" in capsys.readouterr().out
        assert not left.exists()
        assert len(list(nvme.iterdir())) == 1  # the live job's
        assert find_stale(str(nvme)) == []
    finally:
        live.send_signal(signal.SIGTERM)
        live.communicate(timeout=60)
    assert list(nvme.iterdir()) == []


def test_remove_stale_swap_key_removes_dead_jobs_dirs_at_start(tmp_path):
    dead, nvme, _ = _start(tmp_path)
    dead.kill()
    dead.communicate(timeout=30)
    assert len(list(nvme.iterdir())) == 1
    import zerodp.offload.swap_dir as swap_dir

    swap_dir._announced.discard(str(nvme))
    cfg = {
        "zero_optimization": {
            "stage": 1,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "remove_stale_swap": True},
        }
    }
    with pytest.warns(UserWarning, match="removed 1 swap directory"):
        e = zerodp.initialize(nn.Linear(8, 8), cfg)
    assert len(list(nvme.iterdir())) == 1  # this engine's own
    e.close()
    assert list(nvme.iterdir()) == []
