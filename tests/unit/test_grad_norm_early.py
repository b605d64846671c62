"""The gradient norm of an NVMe offload with ``gradients.swp`` is taken as the boundary backward writes
each partition (:meth:`zerodp.offload.grad_swap.GradSwap.put`), so ``step()`` reads no byte of the
file for it (issue 31: that pass read the whole partition once more, serially, every step); the norm
and the update are bitwise those of the read pass."""

from __future__ import annotations

import os

import pytest
import torch
from test_offload_device import _model
from test_offload_nvme_device import _nvme_config

import zerodp
from zerodp.offload.aio import AsyncIO, SwapFile
from zerodp.offload.config import AioConfig
from zerodp.offload.grad_swap import GradSwap, plan_extents
from zerodp.runtime.topology import NORM_CHUNK, ChunkNorms, _chunk_norms, _sum_of_squares, chunk_norms_fp32

SIZES = [0, 1, NORM_CHUNK - 1, NORM_CHUNK, 2 * NORM_CHUNK, 2 * NORM_CHUNK + 1, 5 * NORM_CHUNK + 17]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block", [1, 2, 3])
def test_blocked_chunk_norms_are_bitwise_the_whole_tensors(dtype, block):
    scratch = torch.empty(block * NORM_CHUNK)
    for n in SIZES:
        g = torch.randn(n, generator=torch.Generator().manual_seed(n)).mul(3).to(dtype)
        assert torch.equal(chunk_norms_fp32(g, scratch), _chunk_norms(g.float(), torch.float32)), (n, block)


def test_a_scratch_that_is_not_whole_chunks_is_refused():
    with pytest.raises(ValueError, match="multiple of"):
        chunk_norms_fp32(torch.ones(10, dtype=torch.bfloat16), torch.empty(NORM_CHUNK + 1))


def test_chunk_norms_stand_in_for_their_gradient_in_the_sum():
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (3, NORM_CHUNK + 5, 70)]
    mixed = [ChunkNorms(_chunk_norms(g, torch.float32)) if k % 2 else g for k, g in enumerate(grads)]
    assert torch.equal(_sum_of_squares(g for g in mixed), _sum_of_squares(g for g in grads))
    assert torch.equal(_sum_of_squares(mixed), _sum_of_squares(grads))  # a list: the batched small ones


def _run(tmp_path, accumulation: int, read_pass: bool, clip: float | None = None, stage: int = 3) -> tuple:
    """Two optimizer steps; returns (global norms, parameters, bytes the norm passes read, norms taken
    by put per backward)."""
    tmp_path.mkdir()
    cfg = _nvme_config(stage, str(tmp_path))
    cfg["gradient_accumulation_steps"] = accumulation
    with pytest.warns(UserWarning, match="sub_group_size 100"):  # tiny sub-groups: several per piece
        engine = zerodp.initialize(_model(None), cfg)
    off, spill = engine.optimizer_offload, engine.optimizer_offload.spill
    assert spill is not None
    norm_grads, read = off.norm_grads, []

    def counted(pieces):  # a generator, as the pass: each fp32 gradient overwrites the previous one's
        before = spill.bytes_read
        yield from norm_grads(pieces)
        read.append(spill.bytes_read - before)

    off.norm_grads = counted
    norms, taken = [], []
    for step in range(2):
        for micro in range(accumulation):
            x = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * step + micro)).bfloat16()
            engine.backward(engine(x).float().square().mean())
            taken.append(sum(len(v) for v in spill.span_norms.values()))
            if read_pass:  # as when no norm was taken at the put
                spill.span_norms.clear()
            if clip is not None and micro == accumulation - 1:
                engine.clip_grad_norm_(clip)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    with zerodp.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    engine.close()
    return norms, params, read, taken


@pytest.mark.parametrize(("stage", "accumulation"), [(3, 1), (3, 3), (2, 1)])
def test_the_step_reads_no_gradient_for_the_norm_and_matches_the_read_pass(world1, tmp_path, stage, accumulation):
    norms, params, read, taken = _run(tmp_path / "a", accumulation, read_pass=False, stage=stage)
    ref_norms, ref_params, ref_read, _ = _run(tmp_path / "b", accumulation, read_pass=True, stage=stage)
    assert len(read) == len(ref_read) == 4  # two steps, two kinds of gradient (MP-partitioned, replicated)
    assert sum(read) == 0 and ref_read[1] > 0 and ref_read[3] > 0, (read, ref_read)
    # norms are taken on the boundary backward only (its puts), never on the micro-steps before it
    boundary = [k % accumulation == accumulation - 1 for k in range(len(taken))]
    assert all((t > 0) == b for t, b in zip(taken, boundary, strict=True)), taken
    assert norms == ref_norms and all(n > 0 for n in norms)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))


def test_a_pending_clip_factor_makes_the_step_read_the_gradients(world1, tmp_path):
    """``clip_grad_norm_`` scales the gradients after they were written: the norms taken at the put
    no longer describe them, so the step reads them (and gives what the read pass gives)."""
    norms, params, read, _ = _run(tmp_path / "a", 1, read_pass=False, clip=1e-3)
    ref_norms, ref_params, _, _ = _run(tmp_path / "b", 1, read_pass=True, clip=1e-3)
    assert read[1] > 0 and read[3] > 0, read
    assert norms == ref_norms and all(n < 1e-3 * 1.01 for n in norms), norms
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))


def test_span_norms_always_describe_what_the_file_holds(tmp_path):
    """A put while norms are taken records them; a later put of the same group without norms drops
    them (the file changed), and ``forget`` drops all: a stale norm is never handed to a step."""
    extents, nbytes = plan_extents([(0, 300, torch.bfloat16), (1, 100, torch.bfloat16)])
    file = SwapFile(str(tmp_path / "gradients.swp"))
    os.ftruncate(file.fd, nbytes)
    swap = GradSwap(AsyncIO(AioConfig()), file, extents, 0, 0)
    swap.take_norms({0: [(7, 0, 200), (8, 200, 300)], 1: [(9, 0, 100)]})
    g = swap.empty(0).copy_(torch.linspace(-1, 1, 300))
    swap.put(0, g)
    assert set(swap.span_norms[0]) == {7, 8} and 1 not in swap.span_norms
    assert torch.equal(swap.span_norms[0][8], _chunk_norms(swap.get(0)[200:300].float(), torch.float32))
    swap.take_norms(None)
    swap.put(0, swap.empty(0).fill_(2.0))
    assert 0 not in swap.span_norms  # written again without norms: the old ones went
    swap.take_norms({1: [(9, 0, 100)]})
    swap.put(1, swap.empty(1).fill_(1.0))
    swap.forget()
    assert swap.span_norms == {}
    file.close()
