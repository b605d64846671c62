"""Losses that differ between ranks (issue 11, backward): they train right or raise on every rank.

Two torchrun launches (world sizes 2 and 3, started together) run tests/backward_guard_worker.py under
tests/distributed.py's wall-clock limit, so a hang fails. Trained results are compared with
single-process plain PyTorch on the same global batch (err <= 1: within 1e-5 relative, fp32).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from distributed import run_worker

WORKER = Path(__file__).with_name("backward_guard_worker.py")
_runs: dict[int, list[dict]] = {}


def per_rank(world: int, name: str) -> list[dict]:
    if not _runs:
        with ThreadPoolExecutor(2) as pool:
            futures = {w: pool.submit(run_worker, w, "", "all", WORKER) for w in (2, 3)}
            _runs.update({w: f.result() for w, f in futures.items()})
    out = [r[name] for r in _runs[world]]
    for r, res in enumerate(out):
        assert res["ok"], f"rank {r} raised outside the scenario:\n{res.get('error')}"
    return out


def trained(world: int, name: str) -> list[dict]:
    out = per_rank(world, name)
    for r, res in enumerate(out):
        assert res["error"] is None, f"rank {r}: {res['error']}: {res.get('message')}\n{res.get('traceback')}"
    return [res["value"] for res in out]


def raised(world: int, name: str) -> list[dict]:
    out = per_rank(world, name)
    for r, res in enumerate(out):
        assert res["error"] == "CollectiveMismatchError", f"rank {r} did not raise: {res}"
        assert res["seconds"] < 60, res  # bounded: the guard's 20 s timeout is not even needed
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_using_the_head_on_rank0_only_matches_reference(stage: int) -> None:
    values = trained(2, f"head_rank0/stage{stage}")
    for v in values:
        assert v["err"] <= 1.0, values
        assert v["head_moved"], values
    assert [v["phantom"] for v in values] == [0, 3], values  # rank 1 back-propagated a zero through the head


def test_loss_using_the_head_on_ranks_0_and_2_of_3_matches_reference() -> None:
    values = trained(3, "head_ranks_0_2/stage3")
    assert all(v["err"] <= 1.0 for v in values), values
    assert [v["phantom"] for v in values] == [0, 3, 0], values


def test_head_no_rank_uses_is_not_stepped() -> None:
    """AdamW with weight decay skips a parameter without gradient (torch); the zero gradient of a
    phantom output must not make it step."""
    values = trained(2, "head_nowhere/stage3")
    for v in values:
        assert v["err"] <= 1.0 and not v["head_moved"], values


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameter_used_on_rank0_only_matches_reference(stage: int) -> None:
    values = trained(2, f"extra_param/stage{stage}")
    assert all(v["err"] <= 1.0 for v in values), values


@pytest.mark.parametrize("world", [2, 3])
def test_same_size_units_used_by_different_ranks_raise_before_pairing(world: int) -> None:
    """rank 0 (and 2) add ``aux``'s kept output, rank 1 ``aux2``'s: two units of the same size, whose
    backward all-gathers would pair silently."""
    out = raised(world, "aux_swap")
    for r, res in enumerate(out):
        msg = res["message"]
        assert f"on rank {r}: the ranks' losses reach different modules" in msg, msg
        assert "rank 0's backward reaches aux;" in msg and "rank 1's backward reaches aux2" in msg, msg
        assert "at step 0 (micro-step 0)" in msg, msg


def test_dropped_output_raises_on_every_rank() -> None:
    """Stage 3, rank 1 writes ``engine(x)[0]`` and drops the head's output (the engine keeps weak
    references only): rank 1 cannot serve the head's backward gathers."""
    for res in raised(2, "dropped_output"):
        assert "rank 0's backward reaches head; rank 1's backward reaches nothing more" in res["message"], res


def test_different_size_unit_on_one_rank_raises_instead_of_aborting() -> None:
    """A mis-paired gloo collective of another size aborts the process (gloo's size check); the
    agreement at the start of backward raises before any collective is issued."""
    out = raised(2, "aux_hang")
    for res in out:
        assert "rank 0's backward reaches aux;" in res["message"], res["message"]
        assert "rank 1's backward reaches nothing more" in res["message"], res["message"]


def test_reductions_in_another_order_are_detected() -> None:
    """Same parameters, forward ops in another order on rank 1 (stage 2, one bucket per parameter):
    the gradient buckets complete in another order; the asynchronous tags name the first mis-paired
    reduction on every rank, at the first step (its calibration launches buckets as they complete too)."""
    out = raised(2, "swap_order/stage2")
    for r, res in enumerate(out):
        msg = res["message"]
        assert "collective mismatch in backward at step 0" in msg and f"rank {r} entered reduce(bucket" in msg, msg


def test_backward_fetch_order_is_compared_without_a_tag_per_fetch() -> None:
    """Backward fetches that launch no all-gather post no tag; their order goes into the end tag's
    digest, so ranks that fetched the same modules in another order raise when backward ends."""
    assert [res["value"] for res in per_rank(2, "tags_same")] == [{"posted": 2}] * 2  # group + end
    for r, res in enumerate(raised(2, "tags_fetch_order")):
        msg = res["message"]
        assert (
            f"collective #1 of this backward: rank {r} entered the end of backward (after 1 collectives "
            "and 2 module fetches, fetch order digest" in msg
        ), msg


def test_coalesced_reduction_differing_in_one_bucket_is_detected() -> None:
    """One tag covers a coalesced reduction of several buckets; a group that differs in any bucket
    has another identity, named on the rank that launched it."""
    for r, res in enumerate(raised(2, "tags_group")):
        msg = res["message"]
        mine = "unit 0 + unit 1" if r == 0 else "unit 0 + unit 2"
        assert (
            f"collective #0 of this backward: rank {r} entered reduce({mine}); rank {1 - r} is in "
            "reduce(a coalesced group of other gradient buckets)" in msg
        ), msg


def test_peer_stuck_inside_backward_times_out_on_every_rank() -> None:
    """Rank 1 sleeps 5 s inside backward (guard timeout 3 s): rank 0 gives up waiting for the gradient
    reduction after the timeout, naming it (and what rank 1 reported, if it did within the 3 s
    post-mortem wait); rank 1, awake again, finds rank 0 gone from the exchange and raises too."""
    o0, o1 = per_rank(2, "slow_peer")
    assert o0["error"] == "CollectiveTimeoutError", o0
    assert "collective timeout after 3 s: rank 0 was in backward(reduce(bucket 0.0" in o0["message"], o0["message"]
    assert o0["seconds"] < 30, o0  # 3 s + the 3 s post-mortem wait, not the process group's 20 s
    assert o1["error"] in ("CollectiveTimeoutError", "RankLostError"), o1
    assert "rank 1 was in backward(reduce(bucket 0.0" in o1["message"], o1["message"]


def test_tensor_walk_finds_tensors_in_every_container():
    """zerodp.runtime.tensor_walk (shared by the stage-3 hooks and the backward roots): tensors in
    tuples, lists, namedtuples, dicts, dataclasses and Hugging Face ModelOutput, nested, in order;
    other leaves ignored; the predicate filters (requires_grad, grad_fn)."""
    import collections
    import dataclasses

    import torch

    from zerodp.runtime.tensor_walk import tensors_in

    ModelOutput = pytest.importorskip("transformers.utils").ModelOutput

    @dataclasses.dataclass
    class Out(ModelOutput):
        logits: torch.Tensor = None
        aux: torch.Tensor = None
        hidden: tuple = None

    @dataclasses.dataclass
    class Plain:
        a: torch.Tensor
        rest: dict
        unset: object = dataclasses.field(init=False)  # never assigned: skipped

    Pair = collections.namedtuple("Pair", "x y")
    w = torch.ones(2, requires_grad=True)
    t = [w * i for i in range(7)]  # each has a grad_fn
    leaf, plain = torch.zeros(2, requires_grad=True), torch.zeros(2)
    obj = (
        t[0],
        [t[1], Pair(t[2], "s")],
        {"k": Plain(t[3], {"m": [t[4], 3, None]})},
        Out(logits=t[5], hidden=(t[6], plain)),
        leaf,
        plain,
        w,
        1.5,
        "x",
        None,
    )
    assert [id(x) for x in tensors_in(obj, lambda x: x.grad_fn is not None)] == [id(x) for x in t]
    assert [id(x) for x in tensors_in(obj, lambda x: x.requires_grad)] == [id(x) for x in (*t, leaf, w)]
    assert len(tensors_in(obj, lambda x: True)) == 11
    assert tensors_in(Out(), lambda x: True) == [] and tensors_in(torch, lambda x: True) == []
