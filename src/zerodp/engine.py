"""The training engine returned by :func:`zerodp.initialize`.

One micro-step is ``loss = engine(batch); engine.backward(loss); engine.step()``. ``step()`` is called
after every micro-batch, as in DeepSpeed; the optimizer runs only at each gradient accumulation
boundary (every ``gradient_accumulation_steps`` micro-steps). What each stage holds and sends:

- stage 0: full parameters, gradients and optimizer states; gradients all-reduced (2 Psi).
- stage 1: optimizer states partitioned; gradients reduce-scattered (Psi) at the boundary, updated
  parameter shards all-gathered (Psi).
- stage 2: gradients partitioned as well: reduce-scattered bucket by bucket during backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from zerodp.checkpoint.engine_methods import CheckpointMethods
from zerodp.config import ConfigError, ZeroDPConfig
from zerodp.offload.build import OptimizerOffload, build_offload
from zerodp.offload.param_offload import ParamOffloadStrategy, build_param_offload
from zerodp.offload.report import OffloadReport, offload_report
from zerodp.runtime import accounting, comm, grad_norm, step_control
from zerodp.runtime.accounting import CATEGORIES, CommReport, MemoryReport
from zerodp.runtime.backward_agreement import BackwardAgreement, build_backward_agreement
from zerodp.runtime.backward_roots import OutputRoots
from zerodp.runtime.collective_guard import CollectiveGuard
from zerodp.runtime.comm import CommLedger
from zerodp.runtime.device import all_finite, device_of
from zerodp.runtime.grad_placeholder import GradPlaceholders
from zerodp.runtime.guards import TrainingGuards, refuse_add_param_group
from zerodp.runtime.module_state import guard_module_load_state_dict
from zerodp.runtime.optim import ParamGroupSpec, build_optimizer
from zerodp.runtime.partition import (
    FlatGroup,
    all_gather_updated_shards,
    assign_pieces,
    build_flat_groups,
    pieces_by_bucket,
    pieces_by_param,
)
from zerodp.runtime.precision import LossScaler, PrecisionPolicy, cast_module
from zerodp.runtime.reducer import GradientReducer, build_reducer
from zerodp.runtime.schedulers import engine_scheduler
from zerodp.runtime.topology import Topology
from zerodp.runtime.training_state import TrainingPhase, TrainingState
from zerodp.runtime.zero_state import attach_engine
from zerodp.stage3.sharded_param import is_sharded
from zerodp.stage3.sharding import Stage3


class Engine(CheckpointMethods):
    """Wraps ``module`` for ZeRO data-parallel training. Build it with :func:`zerodp.initialize`.

    Every method that issues collectives (forward at stage 3, backward, step at a boundary, the
    checkpoint methods) first agrees with the other ranks (:mod:`zerodp.runtime.collective_guard`) and
    raises ``CollectiveMismatchError`` / ``CollectiveTimeoutError`` / ``RankLostError`` on every rank
    when they are not all in the same call."""

    def __init__(
        self,
        module: nn.Module,
        config: ZeroDPConfig,
        param_groups: list[ParamGroupSpec],
        process_group: dist.ProcessGroup | None = None,
        *,
        topology: Topology | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], LRScheduler] | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``topology``: the data- and model-parallel groups (default: data parallel over
        ``process_group``); ``lr_scheduler``: ``f(optimizer) -> LRScheduler`` (else the config's
        ``scheduler``, if any); ``device``: the device :func:`zerodp.initialize` placed the module on.

        Raises:
            TypeError: ``lr_scheduler(optimizer)`` is not a torch ``LRScheduler``.
        """
        self.module = module
        self.config = config
        self.topology = topology if topology is not None else Topology(dp_group=process_group)
        self.process_group = process_group = self.topology.dp_group if topology is not None else process_group
        self.device = device
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.stage = config.zero_optimization.stage
        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        self.global_steps = 0  # optimizer steps taken
        self.micro_steps = 0  # micro-batches seen
        self.skipped_steps = 0  # optimizer steps skipped because some rank's gradients overflowed
        self.ledger = CommLedger()
        self._global_grad_norm: float | None = None
        self.grad_clip = grad_norm.ClipState()  # what engine.clip_grad_norm_ left for the step
        self.precision = PrecisionPolicy.from_config(config)
        self.loss_scaler: LossScaler | None = LossScaler.from_config(config)
        self.phase = TrainingPhase(self.gradient_accumulation_steps)  # IDLE, BACKWARD, ..., STEP
        gc = config.collective_guard
        self.collective_guard = CollectiveGuard(process_group, gc.timeout_s, gc.check_gathers, gc.enabled, self.ledger)
        if self.precision.has_master:
            cast_module(module, self.precision.param_dtype, partitioned=is_sharded)  # parameters and buffers
        self._build_layout(param_groups)
        self._build_optimizer_update()
        self._build_reducer()
        self.optimizer = build_optimizer(config.optimizer, param_groups, self.groups)
        refuse_add_param_group(self.optimizer)
        self.lr_scheduler = engine_scheduler(lr_scheduler, config.scheduler, self.optimizer)
        self._build_guards()
        self.output_roots = OutputRoots(module, self.reducer.slots)  # forward outputs since the last backward
        self.ledger.reset()  # the report covers training, not the initial broadcast
        attach_engine(module, self, self.groups, f"ZeRO stage {self.stage}")  # accessors, GatheredParameters

    # ---- construction ------------------------------------------------------------------------------
    def _build_layout(self, param_groups: list[ParamGroupSpec]) -> None:
        """Flat groups (stages 0-2) or stage-3 units, the parameter offload, the frozen parameters, and
        rank 0's values on every rank."""
        zc = self.config.zero_optimization
        self.sharding: Stage3 | None = None
        self.param_offload: ParamOffloadStrategy = build_param_offload(
            zc.offload_param,
            self.config.aio,
            self.rank,
            self.process_group,
            self.device if self.device is not None else device_of(self.module.parameters()),
        )
        if self.stage == 3:
            self.sharding = Stage3(
                self.module,
                param_groups,
                self.rank,
                self.world_size,
                self.process_group,
                self.ledger,
                zc,
                fetch_check=self.collective_guard.gather_check(self.module),
                read_ahead=self.param_offload.read_ahead_hook(),
            )
            self.groups = self.sharding.groups
        else:
            self.groups = build_flat_groups(
                [spec.params for spec in param_groups], zc.reduce_bucket_size, self.world_size
            )
        # offload_param (stage 3): from here on every shard lives in its home between uses
        self.param_offload.attach_to(self.sharding)
        in_groups = {id(s.param) for g in self.groups for s in g.slots}
        self.frozen = [p for p in self.module.parameters() if id(p) not in in_groups]
        self._broadcast_from_rank0()

    def _build_guards(self) -> None:
        """The training-loop guards and the shutdown check."""
        self.training_guards = TrainingGuards(self)
        self.collective_guard.install_shutdown_check(self)

    def _build_optimizer_update(self) -> None:
        """This rank's pieces and the optimizer update, chosen once: in place (NoOffload) or the host /
        NVMe offload; masters are copies made by the offload's ``attach``."""
        zc = self.config.zero_optimization
        self.optimizer_offload: OptimizerOffload = build_offload(
            zc, self.config.aio, self.stage, self.rank, self.process_group, self.groups, self.precision.has_master
        )
        for g in self.groups:  # pieces are views of the shards: their storage is needed, not their values
            with self.shards_resident([g], fill=False):
                assign_pieces(g, self.rank, owns_everything=self.stage == 0)
        # NVMe both ways: attach and step make shards resident per sub-group
        self.optimizer_offload.set_shard_access(self.param_offload)
        with self.shards_resident() if self.optimizer_offload.shard_access is None else contextlib.nullcontext():
            self.optimizer_offload.attach(self.groups)
        # id(param) -> its group, its pieces with masters (GatheredParameters edits reach them)
        self._master_pieces = pieces_by_param(self.groups, self.optimizer_offload.holds_master)
        self._bucket_pieces = pieces_by_bucket(self.groups)  # id(bucket) -> this rank's pieces in it
        self._load_guards = guard_module_load_state_dict(self.module, self.stage, self.precision.has_master)

    def _build_reducer(self) -> None:
        """The stage's gradient reducer; gradients accumulate in ``precision.grad_accum_dtype`` (fp32
        under bf16/fp16 with k > 1 micro-steps). With the collective guard on, the agreement on each
        backward's collectives (:mod:`zerodp.runtime.backward_agreement`) is built first: the reducer
        gets its tag as ``launch_check``."""
        self.backward_tags: BackwardAgreement | None = None
        if self.collective_guard.enabled:
            self.backward_tags = build_backward_agreement(
                self.collective_guard, self.module, self.groups, self.sharding is not None
            )
            self.backward_tags.attach()
        self.reducer: GradientReducer = build_reducer(
            self.stage,
            self.groups,
            self.rank,
            self.world_size,
            self.process_group,
            self.ledger,
            self.config.zero_optimization,
            self.precision.grad_accum_dtype,
            # an offload's copies of the boundary's reduced gradients start per bucket
            self._stream_bucket if self.optimizer_offload.streams_grads else None,
            launch_check=self.backward_tags.note_reduce if self.backward_tags is not None else None,
            # with NVMe offload (no fp16 scaling), gradients go to disk per unit
            spill=None if self.loss_scaler is not None else self.optimizer_offload.gradient_spill,
            staging_pool=self.sharding.pool if self.sharding is not None else None,
            # stage 3 has one bucket per unit: reduce-scatter units in a few coalesced groups
            coalesce_elements=self.sharding.reduce_flush_elements if self.sharding is not None else 0,
        )
        self.reducer.attach()
        self.grad_placeholders = GradPlaceholders(
            self.reducer.slots, self.stage, self.loss_scaler is not None, folded=self.reducer.folds
        )

    def refresh_masters(self, param: nn.Parameter) -> None:
        """``param`` was edited under ``GatheredParameters(modifier_rank=...)``: copy its new value into
        the fp32 masters of this rank's pieces of it (nothing without masters)."""
        g, pieces = self._master_pieces.get(id(param), (None, []))
        if g is not None:
            with self.shards_resident([g]):
                for piece in pieces:
                    self.optimizer_offload.refresh_master(piece)

    def _broadcast_from_rank0(self) -> None:
        """Make every rank start from rank 0's parameters and buffers, as DDP does."""
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
        tensors = [p.data for p in self.frozen]
        if self.sharding is None:  # stage-3 units were broadcast before sharding
            tensors += [g.buffer for g in self.groups]
        tensors += [b for b in self.module.buffers()]
        for t in tensors:
            comm.broadcast(t, src, self.process_group, self.ledger, "init")

    # ---- training loop -----------------------------------------------------------------------------
    def collective_call(self, name: str) -> AbstractContextManager[None]:
        """Context of one collective engine call: every rank agrees on it first (see
        :mod:`zerodp.runtime.collective_guard`); raises CollectiveError subclasses otherwise. Any
        call but forward first finishes an optimizer step still updating (``overlap_step``)."""
        if name != "forward":
            self.optimizer_offload.settle()
        return self.collective_guard.call(name, self.global_steps, self.micro_steps)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.training_guards.before_forward()
        if self.sharding is not None:
            with self.collective_call("forward"):
                out = self.sharding.forward(self.module, args, kwargs)
        else:
            out = self.module(*args, **kwargs)
        if self.world_size > 1 and torch.is_grad_enabled():
            self.output_roots.record(out)  # see zerodp.runtime.backward_roots
        return out

    forward = __call__

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        self.module.eval()
        return self

    @property
    def grads_ready(self) -> bool:
        """The boundary micro-step's backward has reduced the gradients of the accumulation (until step())."""
        return self.phase.grads_ready

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next :meth:`step` will run the optimizer."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """Back-propagate ``loss`` (a scalar) divided by ``gradient_accumulation_steps``, or as given with
        ``scale_wrt_gas=False`` (DeepSpeed's: a loss already normalised over the accumulation window).
        ``retain_graph``: as in ``torch.Tensor.backward``; several ``backward`` calls before one ``step()``
        add up into one micro-step (warned once if gradient_accumulation_steps > 1: runtime.training_state).

        Gradient collectives are launched during backward (stage 2: every micro-step; stages 0-1: on
        the boundary micro-step only) and have completed when this returns.

        Raises:
            ValueError: ``loss`` is not a scalar tensor that requires grad.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(
                "engine.backward(loss) needs a scalar tensor that requires grad, got "
                f"{type(loss).__name__} {getattr(loss, 'shape', '')}"
            )
        boundary = self.is_gradient_accumulation_boundary()
        after = TrainingState.GRADS_READY if boundary else TrainingState.ACCUMULATING
        with self.phase.during(TrainingState.BACKWARD, "engine.backward", then=after):
            self._backward(loss, boundary, retain_graph, scale_wrt_gas)

    def _backward(self, loss: torch.Tensor, boundary: bool, retain_graph: bool, scale_wrt_gas: bool) -> None:
        self.optimizer_offload.settle()  # the reduced gradients of the last step are in use until then
        self.grad_placeholders.remove()  # autograd accumulates into .grad (zerodp.runtime.grad_placeholder)
        self.training_guards.before_backward()
        if scale_wrt_gas and self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.loss_scaler is not None:
            loss = loss * self.loss_scaler.scale
        # what this backward will gather and reduce, agreed with the other ranks before it starts
        plan = self.output_roots.plan(loss, walk=self.world_size > 1)
        with self.collective_guard.call(
            "backward",
            self.global_steps,
            self.micro_steps,
            plan.fetch_digest(),
            plan.slot_digest(),
            lambda: plan.fetch_names(self.output_roots.names),
        ):
            tags = self.backward_tags
            if tags is not None:
                tags.begin(self.global_steps, self.micro_steps)
            try:
                if boundary:
                    self.optimizer_offload.begin_grads()
                # the ranks reach different parameters: reduce every bucket at the end, in one order
                self.reducer.begin_micro_step(
                    reduce=boundary or self.stage >= 2, defer=self.collective_guard.aux_differs
                )
                self.output_roots.backward(plan, retain_graph, self.reducer)
                self.reducer.end_micro_step()
                if tags is not None:
                    tags.finish()  # before any gradient is used: a mis-paired collective raises here
            finally:
                if tags is not None:
                    tags.end()
            self.grad_placeholders.install(boundary)
            if self.sharding is not None:
                self.sharding.end_backward()

    def _stream_bucket(self, g: FlatGroup, b: Any) -> None:
        """The reducer reduced bucket ``b`` of ``g``: on the boundary backward, start copying its owned
        gradients into the offload's host partition (zerodp.offload.stream)."""
        if not self.is_gradient_accumulation_boundary():  # micro_steps counts this backward at step()
            return
        for piece in self._bucket_pieces.get(id(b), ()):
            self.optimizer_offload.stream_grad(piece, self.reducer.piece_grad(g, piece.lo, piece.hi))

    def step(self) -> None:
        """End a micro-step; at a gradient accumulation boundary, update the parameters."""
        boundary = self.is_gradient_accumulation_boundary()
        # the reduced gradients are consumed (or, off the boundary, the accumulation goes on)
        with self.phase.during(TrainingState.STEP, "engine.step", then=TrainingState.IDLE, on_error=TrainingState.IDLE):
            self.grad_placeholders.check_not_cleared()  # module.zero_grad() between backward and step
            self.grad_placeholders.remove()
            self.micro_steps += 1
            if boundary:
                self._boundary_step()

    def _boundary_step(self) -> None:
        with self.collective_call("step"):
            self.param_offload.check_health()  # collective: a lost swap file stops every rank
            whole = self.optimizer_offload.shard_access is None
            with self.shards_resident(write=True) if whole else contextlib.nullcontext():
                self._optimizer_step()

    def _optimizer_step(self) -> None:
        self.optimizer_offload.check_health()  # collective: a lost swap file stops every rank here
        self.training_guards.before_update()
        local_overflow = self.loss_scaler is not None and self._has_inf_or_nan()
        overflow, norm = step_control.presence_and_stage(self, local_overflow)  # stages the gradients
        if overflow:  # every rank skips: parameters and optimizer states stay exactly as they were
            self.optimizer_offload.skipped_step()  # edits still reach the masters (NVMe folds them at the step)
            self.reducer.zero_grads()
            assert self.loss_scaler is not None  # only a loss scaler reports overflow (same config on every rank)
            self.loss_scaler.update(overflow=True)
            self.skipped_steps += 1
            self.global_steps += 1
            self.ledger.steps += 1
            return
        if self.loss_scaler is not None:
            self._scale_grads(1.0 / self.loss_scaler.scale)
        self._global_grad_norm = grad_norm.clip_at_step(self, self.config.gradient_clipping, self._scale_grads, norm)
        self.optimizer_offload.step(self.optimizer)
        self.optimizer_offload.finish_step()  # the module's parameters now hold the update
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        if self.sharding is not None:
            self.sharding.after_step()
        elif self.stage >= 1:  # every rank's updated shards, all-gathered into the full parameters
            all_gather_updated_shards(
                self.groups,
                self.rank,
                self.process_group,
                self.ledger,
                self.config.zero_optimization.allgather_bucket_size,
            )
        self.optimizer_offload.when_updated(self.reducer.zero_grads)  # its loop may still read them (overlap_step)
        self.training_guards.after_update()
        self.global_steps += 1
        self.ledger.steps += 1

    def _scale_grads(self, factor: float) -> None:
        """Multiply the owned gradients by ``factor`` in place (an offload may defer it, bitwise alike)."""
        self.optimizer_offload.scale_grads(factor)

    def _has_inf_or_nan(self) -> bool:
        """Any inf/nan in the reduced gradients this rank owns (before the cross-rank check)."""
        return not all_finite(
            [self.reducer.piece_grad(g, p.lo, p.hi) for g in self.groups for p in g.pieces], "fp16_overflow"
        )  # one host sync per device

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without loss scaling)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def get_lr(self) -> list[float]:
        """Learning rate of each optimizer param group."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Collective (FSDP's spelling): clip the full averaged gradient to ``max_norm`` in the
        ``norm_type``-norm and return its norm before clipping (0-d fp32 tensor); call it after the
        boundary micro-step's ``engine.backward``, before ``step()``. See :mod:`zerodp.runtime.grad_norm`."""
        return grad_norm.clip_grad_norm(self, max_norm, norm_type)

    def parameters_finite(self) -> bool:
        """Collective over the whole world (every data- and model-parallel rank, as a save is): True
        when every trained parameter holds only finite values on every rank (each rank checks the
        pieces it updates: the fp32 masters under bf16/fp16, else the parameters). One all-reduce of
        one int32 (recorded as ``checkpoint``: it guards saving)."""
        with self.shards_resident():
            bad = not all_finite([p.opt_tensor for g in self.groups for p in g.pieces], "parameters_finite")
        flag = torch.tensor([int(bad)], dtype=torch.int32)
        if dist.get_world_size() > 1:
            comm.all_reduce(flag, None, self.ledger, "checkpoint", op=dist.ReduceOp.MAX)
        return not bool(flag)

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the full (averaged, unscaled) gradient at the last optimizer step, before the
        ``gradient_clipping`` of the config (after the user's own, e.g. :meth:`clip_grad_norm_`); None
        before the first step. Computed at every step, with or without clipping."""
        return self._global_grad_norm

    # ---- reports (zerodp.runtime.accounting, zerodp.offload.report) -------------------------------
    @property
    def numel(self) -> int:
        """Psi: trainable elements, without padding."""
        return accounting.trainable_numel(self.groups)

    def memory_report(self) -> MemoryReport:
        """Bytes of model state held by this rank, measured from the engine's tensors, beside the
        paper's formula for this stage (see :func:`zerodp.runtime.accounting.memory_report`)."""
        return accounting.memory_report(self)

    def offload_report(self) -> OffloadReport | None:
        """Host and NVMe bytes of this rank's offloaded optimizer partition (None without offload)."""
        return offload_report(self)

    def comm_report(self) -> CommReport:
        """Every collective since the last :meth:`reset_comm_report` (op, count, elements, bytes)."""
        return accounting.comm_report(self.stage, self.numel, self.ledger, self.gradient_accumulation_steps)

    def reset_comm_report(self) -> None:
        self.ledger.reset()

    def shards_resident(
        self, groups: Sequence[FlatGroup] | None = None, write: bool = False, fill: bool = True
    ) -> AbstractContextManager:
        """Stage 3 with ``offload_param``: this rank's shards (all, or those of ``groups``) hold their
        values for the block (``fill`` False: their storage only, nothing read), written home
        afterwards with ``write`` (see :mod:`zerodp.offload.param_offload`); otherwise a no-op."""
        # an optimizer step still updating shards (overlap_step) ends first
        return self.param_offload.resident(groups, write, settle=self.optimizer_offload.settle, fill=fill)

    def close(self) -> None:
        """Release offload resources now (swap files, I/O threads); also done at interpreter exit."""
        self.optimizer_offload.close()
        self.param_offload.close()


__all__ = ["Engine", "ConfigError", "CATEGORIES"]
