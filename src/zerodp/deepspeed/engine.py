"""The engine ``zerodp.deepspeed.initialize`` returns: DeepSpeed's method names and semantics over a
:class:`zerodp.Engine`.

:class:`DeepSpeedEngine` wraps (does not subclass) the zerodp engine, because DeepSpeed spells as
methods what zerodp keeps as attributes (``gradient_accumulation_steps()``). Everything zerodp's engine
has and this class does not define is reached through it (``memory_report()``, ``comm_report()``...).

What differs from DeepSpeed is refused, never ignored: ``backward(retain_graph=True)``,
``step(lr_kwargs=...)``, ``no_sync()`` at stages 2-3 (as DeepSpeed, with what to use instead) or
around a boundary backward, ``load_checkpoint(load_module_strict=False / custom_load_fn=...)``
raise ``NotImplementedError`` naming the argument.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerodp.deepspeed.engine_checkpoint import DeepSpeedCheckpointMethods
from zerodp.deepspeed.engine_states import ThroughputTimer, offload_states, reload_states
from zerodp.engine import Engine

#: no_sync() at stages 2-3 (``stage`` filled in): refused, as DeepSpeed does, with why and what instead.
NO_SYNC_PARTITIONED = (
    "no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage {stage}: "
    "stages 2-3 reduce-scatter each bucket of gradients during every backward and keep only this "
    "rank's partition, so there is no full local gradient to hold back until the boundary. Set "
    "gradient_accumulation_steps in the config instead and call engine.backward(loss) and engine.step() "
    "every micro-batch: the engine accumulates the gradients over the window (in fp32 under bf16/fp16) "
    "and updates only at the boundary. Stages 0-1 accept no_sync (they reduce only at the boundary)"
)


class DeepSpeedEngine(DeepSpeedCheckpointMethods):
    """DeepSpeed's ``DeepSpeedEngine`` API over a :class:`zerodp.Engine` (``self.engine``); saving and
    loading are :class:`~zerodp.deepspeed.engine_checkpoint.DeepSpeedCheckpointMethods`.

    Call it like the model; ``backward(loss)`` and ``step()`` every micro-batch, as in DeepSpeed.
    """

    def __init__(
        self, engine: Engine, training_dataloader: Any = None, ds_config: Mapping[str, Any] | None = None
    ) -> None:
        self.engine = engine
        self.training_dataloader = training_dataloader
        #: DeepSpeed's ``engine.config``: the config dict given to initialize ("auto" resolved)
        self.config: dict[str, Any] = dict(ds_config or {})
        self._step_applied = False
        self._no_sync = False
        self._backward_unstepped = False  # a backward() ran and no step() since (accelerate's protocol)
        self._offloaded: Any = None
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.tput_timer = ThroughputTimer(self.train_batch_size())

    def __getattr__(self, name: str) -> Any:
        # only reached for names this class lacks: zerodp's own engine API, then the module's
        # attributes (DeepSpeed's engine is an nn.Module that forwards them: ``engine.model``)
        if name in ("engine", "__setstate__") or name.startswith("__"):
            raise AttributeError(name)
        try:
            return getattr(self.engine, name)
        except AttributeError:
            pass
        try:
            return getattr(self.engine.module, name)
        except AttributeError:
            raise AttributeError(
                f"'{type(self).__name__}' object (and its module "
                f"{type(self.engine.module).__name__}) has no attribute '{name}'"
            ) from None

    # ---- the module --------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.engine.lr_scheduler

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine.module.training:
            self.tput_timer.start()
        t0 = time.perf_counter()
        out = self.engine(*args, **kwargs)
        self._times["forward"] += time.perf_counter() - t0
        return out

    forward = __call__

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.engine.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        self.engine.eval()
        return self

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    # ---- training ----------------------------------------------------------------------------------
    def backward(
        self,
        loss: torch.Tensor,
        allreduce_gradients: bool = True,
        release_loss: bool = False,
        retain_graph: bool = False,
        scale_wrt_gas: bool = True,
    ) -> torch.Tensor:
        """Back-propagate ``loss / gradient_accumulation_steps``, or ``loss`` as given with
        ``scale_wrt_gas=False`` (a loss already normalised over the accumulation window, e.g. by the
        window's token count); returns ``loss``.

        Raises:
            NotImplementedError: ``allreduce_gradients=False``, ``retain_graph=True``, or a boundary
                micro-step inside :meth:`no_sync`.
        """
        for name, value, default in (
            ("allreduce_gradients", allreduce_gradients, True),
            ("retain_graph", retain_graph, False),
        ):
            if value != default:
                raise NotImplementedError(f"engine.backward({name}={value!r}) is not implemented in zerodp")
        if self._no_sync and self.is_gradient_accumulation_boundary():
            raise NotImplementedError(
                "engine.backward inside no_sync() on a gradient accumulation boundary is not implemented: "
                "zerodp reduces gradients in the boundary micro-step's backward; leave no_sync() for it"
            )
        t0 = time.perf_counter()
        self.engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
        self._times["backward"] += time.perf_counter() - t0
        self._backward_unstepped = True
        return loss

    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:
        """End a micro-step; at a boundary, update the parameters and step the LR scheduler.

        Raises:
            NotImplementedError: ``lr_kwargs`` given.
        """
        if lr_kwargs is not None:
            raise NotImplementedError("engine.step(lr_kwargs=...) is not implemented in zerodp")
        boundary = self.is_gradient_accumulation_boundary()
        skipped = self.engine.skipped_steps
        self._backward_unstepped = False
        t0 = time.perf_counter()
        self.engine.step()
        self._times["step"] += time.perf_counter() - t0
        self.tput_timer.stop(global_step=boundary)
        if boundary:
            self._step_applied = self.engine.skipped_steps == skipped
            self._report()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """accelerate's protocol (its ``DeepSpeedEngineWrapper``): before each micro-batch's
        ``backward``, say whether it ends the accumulation window; ``step()`` then follows only the
        window's last backward. A backward left without ``step()`` is ended here, as a non-boundary
        micro-step (its gradients stay accumulated). zerodp's window is fixed by the config's
        ``gradient_accumulation_steps``, so ``is_boundary`` must agree with it.

        Raises:
            NotImplementedError: ``is_boundary`` differs from the engine's window (a window cut short,
                e.g. an epoch whose micro-batch count ``gradient_accumulation_steps`` does not divide);
                or a boundary backward was left without ``step()``.
        """
        if self._backward_unstepped:
            if self.is_gradient_accumulation_boundary():
                raise NotImplementedError(
                    "set_gradient_accumulation_boundary: the last backward ended the accumulation window and "
                    "was not followed by engine.step(); call step() after the window's last backward"
                )
            self._backward_unstepped = False
            self.engine.step()  # a non-boundary micro-step: counts it, updates nothing
            self.tput_timer.stop(global_step=False)
        engine_boundary = self.is_gradient_accumulation_boundary()
        if bool(is_boundary) != engine_boundary:
            gas = self.gradient_accumulation_steps()
            raise NotImplementedError(
                f"set_gradient_accumulation_boundary(is_boundary={bool(is_boundary)}) at micro-step "
                f"{self.engine.micro_steps % gas + 1} of {gas}: zerodp's accumulation window is fixed by "
                f"gradient_accumulation_steps={gas} and a window cut short is not implemented. Give the "
                'Trainer/accelerate the config\'s gradient_accumulation_steps ("auto" does) and a number of '
                "micro-batches per epoch that it divides"
            )

    def _report(self) -> None:
        cfg = self.engine.config
        if cfg.steps_per_print is None or self.engine.global_steps % cfg.steps_per_print:
            return  # None: never (steps_per_print inf, as accelerate sets it)
        if self.engine.rank == 0:
            print(
                f"[zerodp] step={self.engine.global_steps}, skipped={self.engine.skipped_steps}, "
                f"lr={self.get_lr()}, mom={self.get_mom()}, loss_scale={self.engine.loss_scale}",
                flush=True,
            )
            if cfg.wall_clock_breakdown:
                t = self._times
                print(
                    f"[zerodp] time (s) over the last {cfg.steps_per_print} steps: forward={t['forward']:.4f} "
                    f"backward={t['backward']:.4f} step={t['step']:.4f}",
                    flush=True,
                )
        self._times = dict.fromkeys(self._times, 0.0)

    def zero_grad(self) -> None:
        """Forget accumulated gradients (DeepSpeed's ``engine.zero_grad``). With
        ``offload_optimizer.overlap_step`` the sub-groups of the last step still to be updated read
        the reduced gradients: they are forgotten once the loop has ended (at the latest when the next
        backward starts), as the engine itself does after a step."""
        self.engine.grad_placeholders.forget_backward()  # gradients discarded: a cleared .grad is expected
        self.engine.optimizer_offload.when_updated(self.engine.reducer.zero_grads)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction in the backward passes inside (stages 0-1; DeepSpeed refuses it at
        stages 2-3 too). zerodp already reduces only on the boundary micro-step at these stages.

        Raises:
            AssertionError: at stages 2-3 (DeepSpeed's type and first words), saying why and what to use:
                ``gradient_accumulation_steps``.
        """
        if self.engine.stage >= 2:
            raise AssertionError(NO_SYNC_PARTITIONED.format(stage=self.engine.stage))
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def was_step_applied(self) -> bool:
        """False when the last boundary step was skipped (fp16 overflow)."""
        return self._step_applied

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def get_mom(self) -> list[Any]:
        """Per group: ``betas`` (Adam-like) or ``momentum`` (SGD-like), as DeepSpeed reports it."""
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def destroy(self) -> None:
        """Nothing to tear down here (hooks live as long as the module); kept for DeepSpeed scripts."""

    # ---- what DeepSpeed exposes as methods and properties ------------------------------------------
    def train_batch_size(self) -> int:
        return self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps() * self.world_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.engine.stage

    def zero_optimization(self) -> bool:
        return self.engine.stage > 0

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.bf16.enabled

    def fp16_enabled(self) -> bool:
        return self.engine.config.fp16.enabled

    def gradient_clipping(self) -> float:
        return self.engine.config.gradient_clipping

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @property
    def global_samples(self) -> int:
        return self.engine.global_steps * self.train_batch_size()

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    dp_world_size = world_size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def device(self) -> torch.device | None:
        """The engine's device (``cuda:LOCAL_RANK`` on a CUDA machine with NCCL, else the CPU; config
        key ``device``): where a script puts its batches (``batch.to(engine.device)``)."""
        return self.engine.device

    # ---- states between phases (RLHF) --------------------------------------------------------------
    def offload_states(
        self, include: Any = None, device: Any = "cpu", pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        """Move optimizer states and fp32 masters to the host (see :mod:`zerodp.deepspeed.engine_states`)."""
        offload_states(self, include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Move what :meth:`offload_states` moved back, values unchanged."""
        reload_states(self, non_blocking)
