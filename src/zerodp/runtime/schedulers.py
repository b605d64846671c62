"""DeepSpeed's warmup learning-rate schedules as torch ``LRScheduler`` subclasses.

``t`` is the number of optimizer steps already taken (0 for the first step); ``W`` the warmup steps,
at least 2 (DeepSpeed's ``max(2, warmup_num_steps)``), ``T`` the total steps. Warmup factor:
``gamma(t) = log(t + 1) / log(W)`` (``warmup_type="log"``) or ``t / W`` (``"linear"``) while ``t < W``,
then 1.

- WarmupLR:       lr(t) = min + (max - min) * gamma(t); max defaults to the first param group's lr
- WarmupDecayLR:  as WarmupLR for t < W, then lr(t) = min + (max - min) * max(0, (T - t) / max(1, T - W))
- WarmupCosineLR: lr(t) = base_lr * r(t), r = warmup_min_ratio + (1 - warmup_min_ratio) * gamma(t)
                  for t < W, then cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2 with
                  p = min(1, (t - W + 1) / max(1, T - W)): the first step after warmup already decays

Source: DeepSpeed's ``deepspeed/runtime/lr_schedules.py`` (the same lr(t) as its ``get_lr()`` at
``last_batch_iteration = t``). These are torch ``LRScheduler``s, which take step t = 0 at construction;
DeepSpeed's start at ``last_batch_iteration = -1`` (lr = min, or 0 for WarmupCosineLR) for the first step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from zerodp.config import SchedulerConfig, WarmupCosineLRParams, WarmupDecayLRParams, WarmupLRParams


def warmup_steps_of(p: WarmupLRParams | WarmupCosineLRParams) -> int:
    """``W``: ``warmup_num_steps``, at least 2 as in DeepSpeed (whose log warmup divides by log(W))."""
    return max(2, p.warmup_num_steps)


def warmup_gamma(t: int, warmup_steps: int, warmup_type: str) -> float:
    """The warmup factor in [0, 1] after ``t`` steps of a ``warmup_steps`` (>= 2) step warmup."""
    if t >= warmup_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(t + 1) / math.log(warmup_steps)
    return t / warmup_steps


class _ClosedForm(LRScheduler):
    def lr_at(self, t: int, base_lr: float) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [self.lr_at(self.last_epoch, float(base)) for base in self.base_lrs]


class WarmupLR(_ClosedForm):
    def __init__(self, optimizer: Optimizer, p: WarmupLRParams, last_epoch: int = -1) -> None:
        self.p = p
        super().__init__(optimizer, last_epoch)

    def lr_at(self, t: int, base_lr: float) -> float:
        p = self.p
        hi = float(self.base_lrs[0]) if p.warmup_max_lr is None else p.warmup_max_lr  # DeepSpeed: group 0's lr
        return p.warmup_min_lr + (hi - p.warmup_min_lr) * warmup_gamma(t, warmup_steps_of(p), p.warmup_type)


class WarmupDecayLR(WarmupLR):
    p: WarmupDecayLRParams

    def __init__(self, optimizer: Optimizer, p: WarmupDecayLRParams, last_epoch: int = -1) -> None:
        super().__init__(optimizer, p, last_epoch)

    def lr_at(self, t: int, base_lr: float) -> float:
        p = self.p
        w = warmup_steps_of(p)
        if t < w:
            return super().lr_at(t, base_lr)
        gamma = max(0.0, (p.total_num_steps - t) / max(1.0, p.total_num_steps - w))
        return p.warmup_min_lr + (p.warmup_max_lr - p.warmup_min_lr) * gamma


class WarmupCosineLR(_ClosedForm):
    def __init__(self, optimizer: Optimizer, p: WarmupCosineLRParams, last_epoch: int = -1) -> None:
        self.p = p
        super().__init__(optimizer, last_epoch)

    def lr_at(self, t: int, base_lr: float) -> float:
        p = self.p
        w = warmup_steps_of(p)
        if t < w:
            g = warmup_gamma(t, w, p.warmup_type)
            return base_lr * (p.warmup_min_ratio + (1.0 - p.warmup_min_ratio) * g)
        progress = min(1.0, (t - w + 1) / max(1, p.total_num_steps - w))
        return base_lr * (p.cos_min_ratio + (1.0 - p.cos_min_ratio) * (1.0 + math.cos(math.pi * progress)) / 2.0)


def build_scheduler(cfg: SchedulerConfig, optimizer: Optimizer) -> LRScheduler:
    cls = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}[cfg.type]
    return cls(optimizer, cfg.parsed_params())


def engine_scheduler(
    factory: Callable[[Optimizer], LRScheduler] | None, cfg: SchedulerConfig | None, optimizer: Optimizer
) -> LRScheduler | None:
    """The engine's scheduler: ``factory(optimizer)`` (``initialize(lr_scheduler=...)``), else the
    config's ``scheduler`` section, else None.

    Raises:
        TypeError: ``factory(optimizer)`` is not a torch ``LRScheduler``.
    """
    if factory is None:
        return build_scheduler(cfg, optimizer) if cfg is not None else None
    scheduler = factory(optimizer)
    if not isinstance(scheduler, LRScheduler):
        raise TypeError(
            f"lr_scheduler(optimizer) returned {type(scheduler).__name__}, not a torch.optim.lr_scheduler.LRScheduler"
        )
    return scheduler
