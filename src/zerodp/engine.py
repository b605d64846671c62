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
from collections import deque
from typing import Any, ContextManager, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from zerodp.runtime import comm, grad_norm
from zerodp.runtime.backward_agreement import BackwardAgreement, build_backward_agreement
from zerodp.runtime.backward_roots import OutputRoots
from zerodp.runtime.collective_guard import CollectiveGuard
from zerodp.runtime.accounting import CATEGORIES, BytesPerElement, CommReport, MemoryReport, model_state_bytes
from zerodp.runtime.comm import CommLedger
from zerodp.runtime.device import all_finite
from zerodp.config import ConfigError, ZeroDPConfig
from zerodp.runtime.optim import ParamGroupSpec, build_optimizer
from zerodp.runtime.module_state import (GatheredCopy, LoadResult, guard_module_load_state_dict,
                                         load_module_state)
from zerodp.runtime.partition import FlatGroup, assign_pieces, flatten_into, plan_buckets
from zerodp.runtime.precision import LossScaler, PrecisionPolicy, cast_module
from zerodp.runtime.schedulers import build_scheduler
from zerodp.offload.build import OptimizerOffload, build_offload, no_offload
from zerodp.offload.report import OffloadReport
from zerodp.offload.param_swap import ParamOffload, build_param_offload
from zerodp.runtime.guards import TrainingGuards, refuse_add_param_group
from zerodp.runtime.grad_placeholder import GradPlaceholders
from zerodp import accessors
from zerodp.runtime.topology import Topology
from zerodp.stage3.sharded_param import is_sharded
from zerodp.stage3.sharding import Stage3
from zerodp.stage3.ownership import register_master_refresh
from zerodp.runtime.wrapped import WRAPPED
from zerodp.runtime.grad_spill import partitioned_reducer
from zerodp.runtime.reducer import AllReduceReducer, FullGradReduceScatter, GradientReducer


class Engine:
    """Wraps ``module`` for ZeRO data-parallel training. Build it with :func:`zerodp.initialize`.

    Every method that issues collectives (forward at stage 3, backward, step at a boundary, the
    checkpoint methods) first agrees with the other ranks (:mod:`zerodp.runtime.collective_guard`) and
    raises ``CollectiveMismatchError`` / ``CollectiveTimeoutError`` / ``RankLostError`` on every rank
    when they are not all in the same call."""

    def __init__(
        self, module: nn.Module, config: ZeroDPConfig,
        param_groups: list[ParamGroupSpec], process_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.module = module
        self.config = config
        self.process_group = process_group
        self.topology = Topology(dp_group=process_group)  # initialize(mpu=...) sets the model-parallel part
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.stage = config.zero_optimization.stage
        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        self.global_steps = 0  # optimizer steps taken
        self.micro_steps = 0  # micro-batches seen
        self.ledger = CommLedger()
        self._global_grad_norm: Optional[float] = None
        self.grad_clip = grad_norm.ClipState()  # what engine.clip_grad_norm_ left for the step
        self.precision = PrecisionPolicy.from_config(config)
        self.loss_scaler: Optional[LossScaler] = LossScaler.from_config(config)
        self.grads_ready = False  # reduced gradients of a complete accumulation exist (until step())
        self.skipped_steps = 0  # optimizer steps skipped because some rank's gradients overflowed
        if self.precision.has_master:
            cast_module(module, self.precision.param_dtype, partitioned=is_sharded)  # parameters and buffers

        zc = config.zero_optimization
        self.sharding: Optional[Stage3] = None
        if self.stage == 3:
            self.sharding = Stage3(module, param_groups, self.rank, self.world_size, process_group,
                                   self.ledger, zc)
            self.groups = self.sharding.groups
        else:
            self.groups = self._flatten(param_groups, zc.reduce_bucket_size)
        # offload_param (stage 3): from here on every shard lives in its home between uses
        self.param_offload: Optional[ParamOffload] = build_param_offload(
            zc.offload_param, config.aio, self.sharding, self.rank, process_group)
        in_groups = {id(s.param) for g in self.groups for s in g.slots}
        self.frozen = [p for p in _unique_params(module) if id(p) not in in_groups]
        self._broadcast_from_rank0()
        self.optimizer_offload: Optional[OptimizerOffload] = build_offload(
            zc, config.aio, self.stage, self.rank, process_group, self.groups)
        for g in self.groups:  # pieces are views of the shards; masters are copies (an offload makes its own)
            with self.shards_resident([g]):
                assign_pieces(g, self.rank, owns_everything=self.stage == 0)
                for piece in g.pieces if self.precision.has_master and self.optimizer_offload is None else ():
                    piece.master = piece.tensor.detach().float().clone()
        if self.optimizer_offload is not None:
            if self.param_offload is not None:  # NVMe: attach and step make shards resident per sub-group
                self.optimizer_offload.set_shard_access(self.param_offload)
            with self.shards_resident() if self.optimizer_offload.shard_access is None else contextlib.nullcontext():
                self.optimizer_offload.attach(self.groups)
        self._register_master_refresh()
        if self.stage == 3 or self.precision.has_master:
            why = ("stage 3 keeps each parameter as a shard; outside forward the module's parameters hold no values"
                   if self.stage == 3 else "the next step would copy the fp32 master weights back over them")
            self._load_guards = guard_module_load_state_dict(module, why)

        # gradients accumulate in precision.grad_accum_dtype: fp32 under bf16/fp16 with k > 1 micro-steps
        reducer_args = (self.groups, self.rank, self.world_size, process_group, self.ledger, zc.overlap_comm,
                        self.precision.grad_accum_dtype)
        self.reducer: GradientReducer
        if self.stage == 0:
            self.reducer = AllReduceReducer(*reducer_args)
        elif self.stage == 1:
            self.reducer = FullGradReduceScatter(*reducer_args)
        else:
            self.reducer = partitioned_reducer(  # with NVMe offload (no fp16 scaling), gradients go to disk per unit
                *reducer_args, contiguous_gradients=zc.contiguous_gradients,
                spill=None if self.optimizer_offload is None or self.loss_scaler is not None else self.optimizer_offload.gradient_spill,
                staging_pool=self.sharding.pool if self.sharding is not None else None,
                # stage 3 has one bucket per unit: reduce-scatter units in a few coalesced groups
                coalesce_elements=self.sharding.reduce_flush_elements if self.sharding is not None else 0)
        self.reducer.attach()
        self.grad_placeholders = GradPlaceholders(self.reducer.slots, self.stage, self.loss_scaler is not None,
                                                  folded=self.reducer.folds)
        self._bucket_pieces: dict[int, list] = {}  # id(bucket) -> this rank's pieces in it
        for g in self.groups:
            for piece in g.pieces:
                self._bucket_pieces.setdefault(id(piece.bucket), []).append(piece)
        self.optimizer = build_optimizer(config.optimizer, param_groups, self.groups)
        refuse_add_param_group(self.optimizer)
        self.training_guards = TrainingGuards(self)
        accessors.register_engine(self)
        self.lr_scheduler: Optional[LRScheduler] = None
        if config.scheduler is not None:
            self.lr_scheduler = build_scheduler(config.scheduler, self.optimizer)
        gc = config.collective_guard
        self.collective_guard = CollectiveGuard(process_group, gc.timeout_s, gc.check_gathers, gc.enabled)
        if self.sharding is not None:
            self.sharding.coordinator.fetch_check = self.collective_guard.gather_check(module)
        self.collective_guard.install_shutdown_check()
        self.backward_tags: Optional[BackwardAgreement] = None
        if self.collective_guard.enabled:
            self.backward_tags = build_backward_agreement(self.collective_guard, module, self.groups, self.sharding is not None)
            self.backward_tags.attach(self.reducer)
        self.output_roots = OutputRoots(module, self.reducer.slots)  # forward outputs since the last backward
        self.ledger.reset()  # the report covers training, not the initial broadcast
        for p in _unique_params(module):
            WRAPPED.add(p, f"ZeRO stage {self.stage}")

    # ---- construction ------------------------------------------------------------------------------
    def _flatten(self, specs: list[ParamGroupSpec], bucket_size: int) -> list[FlatGroup]:
        groups: list[FlatGroup] = []
        index = 0
        for gi, spec in enumerate(specs):
            by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
            for name, p in spec.params:
                by_kind.setdefault((p.dtype, p.device), []).append((name, p))
            for named in by_kind.values():
                slots, buckets, padded = plan_buckets(named, index, bucket_size, self.world_size, gi)
                index += len(named)
                buffer = flatten_into(slots, padded)
                groups.append(FlatGroup(len(groups), buffer, buckets, slots))
        return groups

    def _register_master_refresh(self) -> None:
        """Let GatheredParameters(modifier_rank=...) edits reach the fp32 master copies."""
        by_param: dict[int, list] = {}
        for g in self.groups:
            for piece in g.pieces:
                if piece.master is not None or self.optimizer_offload is not None:
                    by_param.setdefault(id(piece.slot.param), []).append(piece)
        for g in self.groups:
            for s in g.slots:
                pieces = by_param.get(id(s.param))
                if pieces:
                    register_master_refresh(s.param, lambda ps=pieces, g=g: [self._refresh_master(p, g) for p in ps],
                                            self)

    def _refresh_master(self, piece: Any, group: FlatGroup) -> None:
        with self.shards_resident([group]):
            self._copy_to_master(piece)

    def _copy_to_master(self, piece: Any) -> None:
        if self.optimizer_offload is not None:
            self.optimizer_offload.refresh_master(piece)
        else:
            piece.master.copy_(piece.tensor)

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
    def collective_call(self, name: str) -> ContextManager[None]:
        """Context of one collective engine call: every rank agrees on it first (see
        :mod:`zerodp.runtime.collective_guard`); raises CollectiveError subclasses otherwise. Any
        call but forward first finishes an optimizer step still updating (``overlap_step``)."""
        if name != "forward" and self.optimizer_offload is not None:
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

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        self.module.eval()
        return self

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next :meth:`step` will run the optimizer."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """Back-propagate ``loss`` (a scalar) divided by ``gradient_accumulation_steps``, or as given with
        ``scale_wrt_gas=False`` (DeepSpeed's: a loss already normalised over the accumulation window).
        ``retain_graph``: as in ``torch.Tensor.backward``; several ``backward`` calls before one
        ``step()`` add up their gradients, as in torch.

        Gradient collectives are launched during backward (stage 2: every micro-step; stages 0-1: on
        the boundary micro-step only) and have completed when this returns.

        Raises:
            ValueError: ``loss`` is not a scalar tensor that requires grad.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("engine.backward(loss) needs a scalar tensor that requires grad, got "
                             f"{type(loss).__name__} {getattr(loss, 'shape', '')}")
        if self.optimizer_offload is not None:
            self.optimizer_offload.settle()  # the reduced gradients of the last step are in use until then
        self.grad_placeholders.remove()  # autograd accumulates into .grad (zerodp.runtime.grad_placeholder)
        self.training_guards.before_backward()
        if scale_wrt_gas and self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.loss_scaler is not None:
            loss = loss * self.loss_scaler.scale
        boundary = self.is_gradient_accumulation_boundary()
        # what this backward will gather and reduce, agreed with the other ranks before it starts
        plan = self.output_roots.plan(loss, walk=self.world_size > 1)
        with self.collective_guard.call("backward", self.global_steps, self.micro_steps, plan.fetch_digest(),
                             plan.slot_digest(), lambda: plan.fetch_names(self.output_roots.names)):
            tags = self.backward_tags
            if tags is not None:
                tags.begin(self.global_steps, self.micro_steps)
            try:
                if self.optimizer_offload is not None:  # the boundary's reduced gradients stream to the host per bucket
                    if boundary:
                        self.optimizer_offload.begin_grads()
                    self.reducer.on_reduced = self._stream_bucket if boundary else None
                self.reducer.begin_micro_step(reduce=boundary or self.stage >= 2)
                # the ranks reach different parameters: reduce every bucket at the end, in one order
                self.reducer.defer_once = self.collective_guard.aux_differs
                self.output_roots.backward(plan, retain_graph, self.reducer)
                self.reducer.end_micro_step()
                if tags is not None:
                    tags.finish()  # before any gradient is used: a mis-paired collective raises here
            finally:
                if tags is not None:
                    tags.end()
            self.grads_ready = boundary
            self.grad_placeholders.install(boundary)
            if self.sharding is not None:
                self.sharding.end_backward()

    def _stream_bucket(self, g: FlatGroup, b: Any) -> None:
        """Bucket ``b`` of ``g`` was reduced on the boundary backward: start copying its owned
        gradients into the offload's host partition (zerodp.offload.stream)."""
        for piece in self._bucket_pieces.get(id(b), ()):
            self.optimizer_offload.stream_grad(piece, self.reducer.piece_grad(g, piece.lo, piece.hi))

    def step(self) -> None:
        """End a micro-step; at a gradient accumulation boundary, update the parameters."""
        boundary = self.is_gradient_accumulation_boundary()
        self.grad_placeholders.remove()
        self.micro_steps += 1
        self.grads_ready = False
        if boundary:
            with self.collective_call("step"):
                if self.param_offload is not None:
                    self.param_offload.check_health()  # collective: a lost swap file stops every rank
                whole = self.optimizer_offload is None or self.optimizer_offload.shard_access is None
                with self.shards_resident(write=True) if whole else contextlib.nullcontext():
                    self._optimizer_step()

    def _optimizer_step(self) -> None:
        if self.optimizer_offload is not None:
            self.optimizer_offload.check_health()  # collective: a lost swap file stops every rank here
        self.training_guards.before_update()
        local_overflow = self.loss_scaler is not None and self._has_inf_or_nan()
        present, overflow = self.reducer.presence(local_overflow)
        if overflow:  # every rank skips: parameters and optimizer states stay exactly as they were
            if self.optimizer_offload is not None:
                self.optimizer_offload.skipped_step()  # edits still reach the masters (NVMe folds them at the step)
            self.reducer.zero_grads()
            self.loss_scaler.update(overflow=True)
            self.skipped_steps += 1
            self.global_steps += 1
            self.ledger.steps += 1
            return
        present = present.tolist()  # one conversion, not one tensor index per piece
        for g in self.groups:
            for piece in g.pieces:
                target = piece.opt_tensor
                if present[piece.slot.index] and self.optimizer_offload is not None:
                    self.optimizer_offload.stage_grad(piece, self.reducer.held_grad(g, piece.lo, piece.hi))
                elif present[piece.slot.index]:
                    grad = self.reducer.piece_grad(g, piece.lo, piece.hi)
                    target.grad = grad if grad.dtype == target.dtype else grad.to(target.dtype)
                else:
                    target.grad = None
        if self.loss_scaler is not None:
            self._scale_grads(1.0 / self.loss_scaler.scale)
        self._global_grad_norm = grad_norm.clip_at_step(self, self.config.gradient_clipping, self._scale_grads)
        if self.optimizer_offload is not None:
            self.optimizer_offload.step(self.optimizer)
            self.optimizer_offload.finish_step()  # the module's parameters now hold the update
        else:
            self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        for g in self.groups:
            for piece in g.pieces:
                if self.optimizer_offload is not None:
                    break
                piece.opt_tensor.grad = None
                if piece.master is not None:
                    piece.tensor.copy_(piece.master)  # cast the update back to the module dtype
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        if self.sharding is not None:
            self.sharding.after_step()
        elif self.stage >= 1:
            self._all_gather_params()
        if self.optimizer_offload is not None:  # its loop may still read them (overlap_step)
            self.optimizer_offload.when_updated(self.reducer.zero_grads)
        else:
            self.reducer.zero_grads()
        self.training_guards.after_update()
        self.global_steps += 1
        self.ledger.steps += 1

    def _scale_grads(self, factor: float) -> None:
        """Multiply the owned gradients by ``factor`` in place (an offload may defer it, bitwise alike)."""
        if self.optimizer_offload is not None:
            return self.optimizer_offload.scale_grads(factor)
        for g in self.groups:
            for p in g.pieces:
                if p.opt_tensor.grad is not None:
                    p.opt_tensor.grad.mul_(factor)

    def _has_inf_or_nan(self) -> bool:
        """Any inf/nan in the reduced gradients this rank owns (before the cross-rank check)."""
        return not all_finite([self.reducer.piece_grad(g, p.lo, p.hi) for g in self.groups for p in g.pieces],
                              "fp16_overflow")  # one host sync per device

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

    def get_global_grad_norm(self) -> Optional[float]:
        """L2 norm of the full (averaged, unscaled) gradient at the last optimizer step, before the
        ``gradient_clipping`` of the config (after the user's own, e.g. :meth:`clip_grad_norm_`); None
        before the first step. Computed at every step, with or without clipping."""
        return self._global_grad_norm

    def _all_gather_params(self) -> None:
        """Rebuild full parameters from every rank's updated shard, in place, bucket by bucket, with
        at most ``allgather_bucket_size`` elements in flight."""
        limit = self.config.zero_optimization.allgather_bucket_size
        in_flight: deque[tuple[int, Any]] = deque()
        for g in self.groups:
            for b in g.buckets:
                lo, hi = b.shard_range(self.rank)
                out = g.buffer[b.start : b.start + b.numel]
                work = comm.all_gather(out, g.buffer[lo:hi], self.process_group, self.ledger,
                                       "parameters", async_op=True)
                in_flight.append((b.numel, work))
                while sum(n for n, _ in in_flight) > limit and len(in_flight) > 1:
                    in_flight.popleft()[1].wait()
        for _, work in in_flight:
            work.wait()

    # ---- reports -----------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Psi: trainable elements, without padding."""
        return sum(s.numel for g in self.groups for s in g.slots if s.group_index >= 0 and s.param.requires_grad)

    def _bytes_per_element(self) -> BytesPerElement:
        return self.precision.bytes_per_element

    def memory_report(self) -> MemoryReport:
        """Bytes of model state held by this rank, measured from the engine's tensors, beside the
        paper's formula for this stage (see :mod:`zerodp.runtime.accounting`)."""
        frozen_bytes = sum(p.numel() * p.element_size() for p in self.frozen)
        held = self.reducer.held_bytes()
        measured = {
            # stage 3: shards, from their live storage (0 bytes while offload_param has one swapped out)
            "parameters": sum(g.buffer.untyped_storage().nbytes() if self.stage == 3 else _nbytes(g.buffer)
                              for g in self.groups) + frozen_bytes,
            "gradients": held["gradients"],
            "optimizer_states": sum(
                _nbytes(t) for st in self.optimizer.state.values() for t in st.values()
                if isinstance(t, torch.Tensor)
            ),
            # fp32 training: none, the optimizer updates views of the parameters
            "master_weights": sum(_nbytes(p.master) for g in self.groups for p in g.pieces
                                  if p.master is not None),
            "comm_buffers": held["comm_buffers"],
        }
        formula = model_state_bytes(self.stage, self.numel, self.world_size, self._bytes_per_element())
        if self.optimizer_offload is not None:  # fp32 masters always; with NVMe, masters and moments not in memory
            nvme = self.optimizer_offload.device == "nvme"
            formula["master_weights"] = 0.0 if nvme else 4 * self.numel / self.world_size
            formula["optimizer_states"] = 0.0 if nvme else formula["optimizer_states"]
        if self.param_offload is not None and self.param_offload.device == "nvme":
            formula["parameters"] = 0.0  # shards on NVMe between uses (persistent ones stay: measured)
        formula["parameters"] += frozen_bytes
        peak = {"gradients+buffers": self.reducer.peak_grad_bytes}
        if self.sharding is not None:
            held3 = self.sharding.held_bytes()
            measured["parameters"] += held3["gathered"]
            # read from the live storages of the gathered buffers, not from the coordinator's counts
            peak["gathered_parameters"] = self.sharding.coordinator.peak_gathered_bytes
            # idle + lent slabs of the gather pool (see zerodp.stage3.pool), largest seen
            peak["gather_pool"] = self.sharding.pool.peak_bytes
        return MemoryReport(
            stage=self.stage, rank=self.rank, world_size=self.world_size, numel=self.numel,
            frozen_numel=sum(s.numel for g in self.groups for s in g.slots
                             if not (s.group_index >= 0 and s.param.requires_grad))
            + sum(p.numel() for p in self.frozen),
            measured=measured, formula=formula, peak=peak,
        )

    def offload_report(self) -> Optional[OffloadReport]:
        """Host and NVMe bytes of this rank's offloaded optimizer partition (None without offload)."""
        if self.optimizer_offload is None:
            return None
        owned = sum(p.hi - p.lo for g in self.groups for p in g.pieces)
        host = self.optimizer_offload.host_bytes(self.optimizer)
        return OffloadReport(self.optimizer_offload.device, self.rank, owned, host, self.optimizer_offload.nvme_bytes(),
                             self.optimizer_offload.formula(self.numel / self.world_size, host))

    def comm_report(self) -> CommReport:
        """Every collective since the last :meth:`reset_comm_report` (op, count, elements, bytes)."""
        model = self.ledger.traffic_elements("gradients") + self.ledger.traffic_elements("parameters")
        return CommReport(stage=self.stage, numel=self.numel, steps=self.ledger.steps,
                          records=self.ledger.records(), traffic_elements=self.ledger.traffic_elements(),
                          model_traffic_elements=model)

    def reset_comm_report(self) -> None:
        self.ledger.reset()

    # ---- checkpoints (zerodp.checkpoint) ---------------------------------------------------------------
    def save_checkpoint(self, save_dir: Any, tag: Optional[str] = None, client_state: Optional[Mapping[str, Any]] = None,
                        exclude_frozen_parameters: bool = False) -> Any:
        """Collective: write a sharded checkpoint to ``save_dir/<tag>`` (default ``global_step{N}``) and
        point ``save_dir/latest`` at it; returns that directory. ``exclude_frozen_parameters``: only trained
        parameters and their optimizer states. See :func:`zerodp.checkpoint.save_checkpoint`."""
        from zerodp import checkpoint

        with self.collective_call("save_checkpoint"), self._states_resident():
            return checkpoint.save_checkpoint(self, self._checkpoint_dir(save_dir), tag, client_state,
                                              exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: Any, tag: Optional[str] = None) -> tuple[Any, Any]:
        """Collective: load ``load_dir/<tag>`` (default: ``latest``), saved at any world size and stage;
        returns (checkpoint directory, client_state). See :func:`zerodp.checkpoint.load_checkpoint`."""
        from zerodp import checkpoint

        with self.collective_call("load_checkpoint"), self._states_resident(write=True):
            return checkpoint.load_checkpoint(self, self._checkpoint_dir(load_dir), tag)

    def _checkpoint_dir(self, d: Any) -> Any:
        """``d``, or with model parallelism ``d/mp_rank_XX``: each model-parallel rank's DP group
        saves and loads its own parameter shards (the same names hold different slices)."""
        import os

        return os.path.join(d, f"mp_rank_{self.topology.mp_rank:02d}") if self.topology.model_parallel else d

    def load_module_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> LoadResult:
        """Collective: load a full state dict (keys and shapes of ``module.state_dict()``, e.g. from
        :meth:`module_state_dict` or a plain PyTorch model) into this rank's parameters or shards and
        fp32 master weights, at any stage and precision; optimizer states are kept. Every rank must pass
        the same values. See :func:`zerodp.runtime.module_state.load_module_state`.

        Raises:
            RuntimeError: missing/unexpected keys with ``strict``, a shape mismatch, or ranks passing
                different values.
        """
        gathered = []
        if self.sharding is not None:
            gathered = [GatheredCopy(u.group, u.full) for u in self.sharding.units
                        if u.full is not None and u.full.untyped_storage().nbytes() > 0]
        with self._states_resident(write=True):  # NVMe offload: masters are placeholders between steps
            return load_module_state(self.module, self.groups, self.frozen, gathered, state_dict, strict,
                                     self.process_group, self.ledger)

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """Full state dict keyed like ``module.state_dict()``, fresh copies, on every rank (a
        collective): trained parameters in fp32 (the fp32 masters under bf16/fp16), frozen parameters
        and buffers in the module's dtype."""
        from zerodp import checkpoint

        with self.collective_call("module_state_dict"), self._states_resident():
            return checkpoint.module_state_dict(self)

    @contextlib.contextmanager
    def _states_resident(self, write: bool = False) -> Iterator[None]:
        """Offloaded masters, optimizer states and parameter shards as ordinary tensors for the duration
        of a block (``write``: the block may change the shards)."""
        with (self.optimizer_offload.resident(self.optimizer) if self.optimizer_offload is not None else no_offload()), \
                self.shards_resident(write=write):
            yield

    def shards_resident(self, groups: Optional[Sequence[FlatGroup]] = None, write: bool = False) -> ContextManager:
        """Stage 3 with ``offload_param``: this rank's shards (all, or those of ``groups``) hold their
        values for the block, written home afterwards with ``write`` (see
        :mod:`zerodp.offload.param_swap`); otherwise a no-op."""
        if self.param_offload is None:
            return contextlib.nullcontext()
        if self.optimizer_offload is not None:
            self.optimizer_offload.settle()  # an optimizer step still updating shards (overlap_step) ends first
        return self.param_offload.resident(groups, write)

    def close(self) -> None:
        """Release offload resources now (swap files, I/O threads); also done at interpreter exit."""
        if self.optimizer_offload is not None:
            self.optimizer_offload.close()
        if self.param_offload is not None:
            self.param_offload.close()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters())


__all__ = ["Engine", "ConfigError", "CATEGORIES"]
