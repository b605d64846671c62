"""Comparing two runs' tensors when they ran on different devices (tests/offload_worker.py)."""

from __future__ import annotations

import torch


def ulps(x: torch.Tensor, y: torch.Tensor) -> float:
    """The largest difference of ``x`` and ``y`` in units of ``x``'s dtype's machine epsilon times its
    largest magnitude: 0.0 when bitwise equal; inf when the shapes differ, an integer tensor differs, or
    a NaN or inf is not at the same place with the same value in both. On a GPU the non-offloaded step
    runs there and the offloaded one on the host: the same arithmetic, rounded differently, so such
    runs are compared within a few of these units, not bitwise."""
    if x.shape != y.shape:
        return float("inf")
    if not x.is_floating_point():
        return 0.0 if torch.equal(x, y.to(x.device)) else float("inf")
    x64, y64 = x.detach().double().cpu(), y.detach().double().cpu()
    finite = torch.isfinite(x64)
    if not torch.equal(finite, torch.isfinite(y64)):
        return float("inf")
    if not finite.all():  # the same NaN / +inf / -inf at the same places (nan_to_num tells them apart)
        if not torch.equal(x64[~finite].nan_to_num(), y64[~finite].nan_to_num()):
            return float("inf")
        x64, y64 = x64.where(finite, 0.0), y64.where(finite, 0.0)
    scale = torch.finfo(x.dtype).eps * max(x64.abs().max().item(), 1e-30)
    return (x64 - y64).abs().max().item() / scale if x64.numel() else 0.0
