"""Ctrl-C on ``zerodp train``: one line from the launcher, no rank's traceback, exit code 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from zerodp.app.launch import INTERRUPTED_EXIT


def _default_sigint() -> None:
    # a suite started in the background inherits SIGINT ignored; a terminal's Ctrl-C is not ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_prints_one_line_and_no_traceback(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "zerodp.app.cli",
        "train",
        "--nproc",
        "2",
        "--steps",
        "100000",
        "--n-layer",
        "1",
        "--d-model",
        "32",
        "--n-head",
        "2",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 120
        assert proc.stderr is not None
        seen = ""
        while "train: " not in seen and time.monotonic() < deadline:  # training has started on rank 0
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            seen += line
        assert "train: " in seen, f"training never started: {seen}"
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = seen + err
    assert proc.returncode == INTERRUPTED_EXIT, (proc.returncode, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "zerodp train: interrupted by SIGINT; the workers were stopped" in err
