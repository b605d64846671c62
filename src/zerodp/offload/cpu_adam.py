"""Which torch Adam/AdamW kernel the offloaded CPU step runs
(``zero_optimization.offload_optimizer.cpu_adam``, zerodp's own key).

- ``"fused"`` (default): torch's fused CPU kernel (``torch._fused_adam_`` / ``torch._fused_adamw_``,
  selected by ``fused=True`` on the param group), faster than the for-loop kernel the non-offloaded
  engine uses on CPU tensors (``docs/benchmarks/2026-12-01-offload.md``, "CPU Adam kernel"). Its
  arithmetic differs in rounding order, so the parameters equal the non-offloaded engine's within
  about 1e-6 relative, not bitwise.
- ``"same"``: the non-offloaded engine's kernel (torch's default choice for the optimizer's
  options), so the offloaded run is bitwise equal to the non-offloaded one.

``fused=True`` is set on a param group only for the duration of the offloaded ``optimizer.step()``
(:func:`cpu_adam_kernel`) and restored afterwards, so ``optimizer.state_dict()`` (and therefore every
checkpoint) carries the user's options unchanged and crosses between offloaded and non-offloaded
engines. The state layout is the same for both kernels: torch (2.13, ``torch/optim/adam.py``
``_init_group``) makes ``step`` a 0-dim float32 tensor on the parameter's device (CPU here) whether
``fused`` is set or not, and ``exp_avg`` / ``exp_avg_sq`` like the parameter (fp32 masters).

Left alone (the configured kernel runs): optimizers other than ``torch.optim.Adam`` and its subclass
``AdamW`` (SGD, ...), and a param group whose ``fused`` or ``foreach`` the user set explicitly
(``optimizer.params`` or a param-group dict), or with ``differentiable=True`` (fused refuses it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from zerodp.offload.config import CpuAdam


def fused_groups(optimizer: torch.optim.Optimizer, choice: CpuAdam) -> list[dict]:
    """The param groups of ``optimizer`` whose step :func:`cpu_adam_kernel` switches to the fused
    kernel: none for ``"same"`` or a non-Adam optimizer; else the groups with neither ``fused`` nor
    ``foreach`` set (None: torch's default) and ``differentiable`` off."""
    if choice != "fused" or not isinstance(optimizer, torch.optim.Adam):
        return []
    return [
        g
        for g in optimizer.param_groups
        if g.get("fused") is None and g.get("foreach") is None and not g.get("differentiable", False)
    ]


@contextlib.contextmanager
def cpu_adam_kernel(optimizer: torch.optim.Optimizer, choice: CpuAdam) -> Iterator[list[dict]]:
    """Within the block, ``optimizer.step()`` runs the kernel ``choice`` names on the host masters
    (fp32, CPU); yields the groups switched to ``fused=True``; their ``fused`` is None again after
    the block (also after an exception)."""
    groups = fused_groups(optimizer, choice)
    for g in groups:
        g["fused"] = True
    try:
        yield groups
    finally:
        for g in groups:
            g["fused"] = None


__all__ = ["CpuAdam", "cpu_adam_kernel", "fused_groups"]
