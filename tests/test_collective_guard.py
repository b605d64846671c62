"""Ranks that disagree about collectives raise a clear error on every rank within a bounded time
(issue 11), and generation loops of different lengths work with ``zerodp.zero.synced_generate``.

Each launch runs real rank processes (gloo, CPU) under a wall-clock limit: a hang fails the test.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("guard_worker.py")
WALL_S = 150  # a hang (the symptom) fails the launch well before gloo's 30-minute timeout


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """``world`` rank processes of one worker group, started at once (groups run concurrently: most of
    their time is spent waiting on timeouts and process start-up)."""

    def __init__(self, group: str, world: int = 2) -> None:
        self.group, self.world = group, world
        self.out = Path(tempfile.mkdtemp(prefix=f"guard-{group}-"))
        port = _port()
        self.t0 = time.monotonic()
        self.procs = []
        for r in range(world):
            env = {
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "PYTHONWARNINGS": "ignore",
            }
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), "--group", group, "--out", str(self.out)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )

    def finish(self) -> tuple[list, list[int], Path]:
        codes, logs = [], []
        for p in self.procs:
            try:
                stdout, _ = p.communicate(timeout=max(1.0, WALL_S - (time.monotonic() - self.t0)))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                pytest.fail(f"{self.group}: ranks still running after {WALL_S} s (a hang)")
            codes.append(p.returncode)
            logs.append(stdout)
        files = [self.out / f"rank{r}.json" for r in range(self.world)]
        results = [json.loads(f.read_text()) if f.exists() else None for f in files]
        if results[0] is None:
            pytest.fail(
                f"{self.group}: rank 0 wrote no results (codes {codes}):\n" + "\n".join(log[-3000:] for log in logs)
            )
        return results, codes, self.out


@pytest.fixture(scope="module")
def launches() -> Iterator[dict[str, Launch]]:
    started = {g: Launch(g) for g in ("mismatch", "kill_train", "kill_save")}
    yield started
    for launch in started.values():
        for p in launch.procs:
            if p.poll() is None:
                p.kill()


@pytest.fixture(scope="module")
def mismatch(launches: dict[str, Launch]) -> list[dict]:
    results, codes, _ = launches["mismatch"].finish()
    assert codes == [0, 0], codes
    return results  # type: ignore[return-value]


def _errors(results: list[dict], name: str) -> list[dict]:
    per_rank = [r[name] for r in results]
    for r, o in enumerate(per_rank):
        assert o["error"] is not None, f"{name}: rank {r} raised nothing ({o})"
    return per_rank


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_save_on_rank0_only_raises_on_every_rank(mismatch: list[dict], stage: int) -> None:
    o0, o1 = _errors(mismatch, f"save_rank0_stage{stage}")
    other = "forward" if stage == 3 else "backward"  # rank 1's next collective call
    for o in (o0, o1):
        assert o["error"] == "CollectiveMismatchError", o
        assert o["seconds"] < 60, o  # bounded (gloo's own default is 30 min); generous on a busy machine
    assert "rank 0 entered save_checkpoint at step 1" in o0["message"], o0["message"]
    # a backward names what its loss graph reaches, e.g. "backward(loss graph 0d4cbb29)"
    assert re.search(rf"rank 1 is in {other}(\([^)]*\))? at step 1", o0["message"]), o0["message"]
    assert re.search(rf"rank 1 entered {other}(\([^)]*\))? at step 1", o1["message"]), o1["message"]
    assert "rank 0 is in save_checkpoint" in o1["message"], o1["message"]


@pytest.mark.parametrize(
    "name, mine, theirs",
    [
        ("skip_module", "gather(blocks.1)", "gather(blocks.2)"),  # rank 1 skips blocks.1
        ("call_twice", "gather(blocks.3)", "gather(blocks.2)"),  # rank 1 calls blocks.2 twice
    ],
)
def test_stage3_divergent_forward_names_the_modules(mismatch: list[dict], name: str, mine: str, theirs: str) -> None:
    o0, o1 = _errors(mismatch, name)
    for o in (o0, o1):
        assert o["error"] == "CollectiveMismatchError", o
    assert f"rank 0 entered {mine} at step 0" in o0["message"], o0["message"]
    assert f"rank 1 is in {theirs}" in o0["message"], o0["message"]
    assert f"rank 1 entered {theirs}" in o1["message"], o1["message"]


@pytest.mark.parametrize(
    "name, mine, theirs",
    [
        ("skip_module_traced", "gather(blocks.1)", "gather(blocks.2)"),
        ("call_twice_traced", "gather(blocks.3)", "gather(blocks.2)"),
        ("skip_last_traced", "gather(blocks.3)", "the end of forward (after 3 module fetches)"),
    ],
)
def test_stage3_divergence_after_trace_is_caught_by_forward_tags(
    mismatch: list[dict], name: str, mine: str, theirs: str
) -> None:
    """At the third step the fetches are agreed by asynchronous tags: the same error, on every rank,
    raised inside that forward (before any backward collective or update)."""
    o0, o1 = _errors(mismatch, name)
    for o in (o0, o1):
        assert o["error"] == "CollectiveMismatchError", o
        assert o["seconds"] < 60, o
        assert "engine.backward" not in o["traceback"] and "in step" not in o["traceback"], o["traceback"]
    assert f"rank 0 entered {mine} at step 2" in o0["message"], o0["message"]
    assert f"rank 1 is in {theirs} at step 2" in o0["message"], o0["message"]
    assert f"rank 1 entered {theirs} at step 2" in o1["message"], o1["message"]
    assert f"rank 0 is in {mine} at step 2" in o1["message"], o1["message"]


def test_stage3_same_size_blocks_swapped_after_trace_raises(mismatch: list[dict]) -> None:
    """Two blocks of the same size in another order on rank 1: their all-gathers would pair up and
    exchange parameters silently; the forward tags raise on both ranks, naming the blocks."""
    o0, o1 = _errors(mismatch, "swap_blocks_traced")
    for o in (o0, o1):
        assert o["error"] == "CollectiveMismatchError", o
        assert "engine.backward" not in o["traceback"], o["traceback"]
    assert re.search(r"rank 0 entered gather\(blocks\.0\.[^)]*\) at step 2", o0["message"]), o0["message"]
    assert re.search(r"rank 1 is in gather\(blocks\.1\.[^)]*\) at step 2", o0["message"]), o0["message"]
    assert re.search(r"rank 1 entered gather\(blocks\.1\.", o1["message"]), o1["message"]


def test_forward_fetch_agreements_do_not_block_once_traced(mismatch: list[dict]) -> None:
    """Blocks has 4 modules with parameters: the recording step agrees on each fetch synchronously
    (forward, 4 gathers, backward, step; the forward's end tag is its one blocking wait); afterwards
    each fetch launches an all-gather and posts a tag before it, and the forward blocks once, for
    those 4 tags and its end tag, before it returns: 3 synchronous agreements per step (forward,
    backward, step) instead of 7."""
    for r in range(2):
        o = mismatch[r]["forward_tag_counts"]
        assert o["error"] is None, o
        first, *rest = o["value"]["per_step"]
        assert first == {"agreements": 7, "tags": 1, "tag_waits": 1}, first
        for s in rest:
            assert s == {"agreements": 3, "tags": 5, "tag_waits": 1}, s


def test_unequal_generation_without_sync_raises(mismatch: list[dict]) -> None:
    o0, o1 = _errors(mismatch, "unequal_generation_unsynced")
    assert "rank 0 entered forward" in o0["message"] and "rank 1 is in module_state_dict" in o0["message"], o0
    assert "rank 1 entered module_state_dict" in o1["message"], o1


@pytest.mark.parametrize("name, lengths", [("unequal_generation_synced", [3, 5]), ("rank0_only_generation", [4, 0])])
def test_synced_generation_matches_single_process(mismatch: list[dict], name: str, lengths: list[int]) -> None:
    for r, res in enumerate(mismatch):
        o = res[name]
        assert o["error"] is None, o
        tokens, ref = o["value"]["tokens"], o["value"]["reference"]
        assert len(tokens) == 3 + lengths[r], (r, tokens)
        assert tokens == ref, (r, tokens, ref)


def test_rank_outside_collectives_times_out(mismatch: list[dict]) -> None:
    o0, o1 = _errors(mismatch, "timeout")
    assert o0["error"] == "CollectiveTimeoutError", o0
    assert "collective timeout after 3 s: rank 0 was in module_state_dict" in o0["message"], o0["message"]
    assert "rank 1 reported module_state_dict" in o0["message"], o0["message"]  # it arrived late
    assert o0["seconds"] < 60, o0  # the guard's timeout (3 s) + the post-mortem wait, not gloo's 30 min
    assert o1["error"] == "CollectiveTimeoutError", o1  # rank 0 answered: alive, not lost
    assert mismatch[0]["shutdown"]["error"] is None and mismatch[1]["shutdown"]["error"] is None


def test_shutdown_mismatch_names_the_steps_done(mismatch: list[dict]) -> None:
    """Rank 1 shuts down after 2 steps while rank 0 is in its third: the message gives rank 1's real
    counters (2 steps of 1 micro-step each), not the agreement's -1."""
    o0, o1 = _errors(mismatch, "uneven_steps")
    want = "shutdown_distributed after 2 optimizer step(s) (2 micro-step(s))"
    assert f"rank 1 is in {want}" in o0["message"], o0["message"]
    assert f"rank 1 entered {want}" in o1["message"], o1["message"]
    assert "step -1" not in o0["message"] + o1["message"]


def test_killed_rank_during_training_is_named(launches: dict[str, Launch]) -> None:
    results, codes, _ = launches["kill_train"].finish()
    assert codes[1] == -9, codes
    assert codes[0] != 0, codes
    o = results[0]["kill_train"]
    assert o["error"] == "RankLostError", o
    assert "rank(s) 1 lost" in o["message"], o["message"]


def test_killed_rank_during_save_keeps_previous_checkpoint(launches: dict[str, Launch]) -> None:
    results, codes, out = launches["kill_save"].finish()
    assert codes[1] == -9 and codes[0] != 0, codes
    o = results[0]["kill_save"]
    assert o["error"] == "RankLostError", o
    assert "rank(s) 1 lost" in o["message"] and "save_checkpoint" in o["message"], o["message"]
    ckpt = out / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "good"
    assert not (ckpt / "broken").exists()
    from zerodp.checkpoint import resolve_checkpoint

    assert resolve_checkpoint(ckpt).name == "good"
