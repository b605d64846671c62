"""zerodp.runtime.topology._sum_of_squares: a list of gradients (small CPU ones normed by one
``torch._foreach_norm`` per run of one dtype) gives bitwise the sum that the per-tensor path gives (the
path a generator takes: each gradient normed as it is read, in chunks of NORM_CHUNK elements)."""

from __future__ import annotations

import pytest
import torch

from zerodp.runtime import topology
from zerodp.runtime.topology import NORM_CHUNK, _chunk_norms, _sum_of_squares


def gradients(seed: int) -> list[torch.Tensor]:
    """Mixed dtypes, sizes on both sides of NORM_CHUNK, 1-D and 2-D, an empty one, magnitudes far apart."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 7, 64, 4096, 4160, NORM_CHUNK - 1, NORM_CHUNK, NORM_CHUNK + 3, 0, 3 * NORM_CHUNK + 5, 17]
    dtypes = [
        torch.float32,
        torch.float32,
        torch.bfloat16,
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.float64,
        torch.float32,
    ]
    out = []
    for i, n in enumerate(sizes * 2):
        scale = 10.0 ** (i % 7 - 3)
        t = (torch.randn(n, generator=gen) * scale).to(dtypes[i % len(dtypes)])
        out.append(t.view(-1, 1) if i % 3 == 0 else t)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_list_matches_per_tensor_path_bitwise(seed: int) -> None:
    grads = gradients(seed)
    batched = _sum_of_squares(list(grads))
    per_tensor = _sum_of_squares(g for g in grads)  # a generator: one norm per tensor, as read
    assert batched.dtype == torch.float64 and batched.item() > 0
    assert torch.equal(batched, per_tensor)
    # and both are the documented sum: each tensor's chunk norms, squared and summed in fp64, in order
    norms = torch.cat([_chunk_norms(g, torch.promote_types(g.dtype, torch.float32)) for g in grads])
    assert torch.equal(batched, norms.double().pow(2).sum())


def test_list_uses_one_foreach_norm_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = torch._foreach_norm

    def counting(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(topology.torch, "_foreach_norm", counting)
    small = [torch.randn(64) for _ in range(5)] + [torch.randn(8).bfloat16()] + [torch.randn(4096) for _ in range(3)]
    _sum_of_squares(small)
    assert calls == [5, 1, 3]  # a dtype change starts a new run
    calls.clear()
    _sum_of_squares(iter(small))
    assert calls == []  # a generator's tensors are normed one by one as read


def test_generator_reusing_one_buffer_is_read_as_it_goes() -> None:
    # the deferred offload yields each piece's gradient in one reused buffer: a norm taken later would
    # read the last gradient's values for every one
    grads = [torch.randn(64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    buf = torch.empty(64)

    def reused():
        for g in grads:
            buf.copy_(g)
            yield buf

    assert torch.equal(_sum_of_squares(reused()), _sum_of_squares(grads))
