"""Where parameters live, per ZeRO stage: which pieces a rank saves, which tensors loading fills, how
full values are assembled (see :mod:`zerodp.checkpoint`, [Note: stage 3]).

Stages 0-2 share :class:`ReplicatedParamsLayout`; stage 3 uses :class:`ShardedParamsLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from zerodp.checkpoint.engine_state import (
    full_master_values,
    keyed_like_state_dict,
    outside_slots,
    trained_slots,
    units,
)
from zerodp.checkpoint.format import value_dtype
from zerodp.checkpoint.protocol import CheckpointableEngine as Engine
from zerodp.runtime import comm
from zerodp.runtime.partition import ParamSlot, Piece
from zerodp.stage3.gathered import GatheredParameters
from zerodp.stage3.units import ShardState


@dataclass
class Target:
    """Elements ``[start, end)`` of flattened state_dict entry ``name`` that this rank holds in ``tensor``
    (``end - start`` elements, any shape; written with ``copy_``, which casts to its dtype)."""

    name: str
    start: int
    end: int
    tensor: torch.Tensor
    #: set when the stored values are row-major but ``tensor`` holds them in this slot's memory order
    #: (a frozen ``channels_last`` parameter at stage 3): the range is taken after reordering
    reorder: ParamSlot | None = None


class CheckpointLayout(Protocol):
    """Stage-dependent part of saving and loading (see [Note: stage 3])."""

    def saved_pieces(self, engine: Engine) -> list[Piece]:
        """The pieces (values and optimizer state) this rank writes to its rank file."""

    def value_targets(self, engine: Engine) -> list[Target]:
        """The parameter ranges this rank keeps in its flat buffers: loading fills exactly these."""

    def extra_values(self, engine: Engine, frozen: bool = True) -> dict[str, torch.Tensor]:
        """Full values of every state_dict entry outside the flat buffers' trained parameters (frozen
        parameters, persistent buffers) by first state_dict name. Called on every rank when saving (it
        may gather); only rank 0's are written, so other ranks may leave out what they would copy.
        ``frozen=False``: the frozen parameters are not needed (they may be left out, not gathered)."""

    def extra_targets(self, engine: Engine) -> dict[str, torch.Tensor]:
        """The live full tensors, by first state_dict name, that loading fills besides
        :meth:`value_targets` (frozen parameters and buffers that every rank holds in full)."""

    def full_state_dict(self, engine: Engine) -> dict[str, torch.Tensor]:
        """Fresh full copies keyed like ``module.state_dict()``, trained parameters in fp32 (the fp32
        masters when the engine keeps them), frozen parameters and buffers in their dtype (every rank)."""

    def before_load(self, engine: Engine) -> None:
        """Runs once every rank has staged the load successfully, before anything is copied in."""

    def after_load(self, engine: Engine) -> None:
        """Runs after new values were copied into :meth:`value_targets` (e.g. re-gather parameters)."""


class ReplicatedParamsLayout:
    """Stages 0-2: every rank holds every parameter in full (views of the flat buffers) and the module's
    frozen parameters and buffers in full. Pieces are the optimizer's owned ranges; at stage 0 every
    rank owns everything, so only rank 0 writes them."""

    def saved_pieces(self, engine: Engine) -> list[Piece]:
        if engine.stage == 0 and engine.rank != 0:
            return []
        return [p for g in engine.groups for p in g.pieces]

    def value_targets(self, engine: Engine) -> list[Target]:
        return [
            Target(s.name, 0, s.numel, g.buffer[s.offset : s.offset + s.numel]) for g in engine.groups for s in g.slots
        ]

    def extra_values(self, engine: Engine, frozen: bool = True) -> dict[str, torch.Tensor]:
        return self.extra_targets(engine)

    def extra_targets(self, engine: Engine) -> dict[str, torch.Tensor]:
        return outside_slots(engine)  # all slots are trained at stages 0-2

    def full_state_dict(self, engine: Engine) -> dict[str, torch.Tensor]:
        """Trained parameters: the fp32 masters when there are any (assembled across ranks at stages
        1-2, see :func:`full_master_values`), else the module's values cast to fp32."""
        masters = full_master_values(engine)
        trained = {id(s.param) for s in trained_slots(engine)}
        return keyed_like_state_dict(
            engine,
            masters,
            lambda v: v.detach().to(dtype=value_dtype(v.dtype) if id(v) in trained else v.dtype, copy=True),
        )

    def before_load(self, engine: Engine) -> None:
        pass

    def after_load(self, engine: Engine) -> None:
        pass


class ShardedParamsLayout:
    """Stage 3: each rank holds one shard of every unit (frozen parameters included) and the module's
    buffers in full; parameters are gathered only to be read (see [Note: stage 3])."""

    def saved_pieces(self, engine: Engine) -> list[Piece]:
        return [p for g in engine.groups for p in g.pieces]

    def value_targets(self, engine: Engine) -> list[Target]:
        out = []
        trained = {id(s.param) for s in trained_slots(engine)}
        for g in engine.groups:
            base, end = g.shard_offset, g.shard_offset + g.buffer.numel()  # the shard, in unit coordinates
            for s in g.slots:
                lo, hi = max(base, s.offset), min(end, s.offset + s.numel)
                if lo < hi:
                    reorder = s if s.stride is not None and id(s.param) not in trained else None
                    out.append(Target(s.name, lo - s.offset, hi - s.offset, g.buffer[lo - base : hi - base], reorder))
        return out

    def extra_values(self, engine: Engine, frozen: bool = True) -> dict[str, torch.Tensor]:
        """Buffers (every rank), and on rank 0 CPU copies of the frozen unit parameters: each unit
        holding one is gathered on every rank (collective), one unit at a time (not with ``frozen=False``)."""
        trained = {id(s.param) for s in trained_slots(engine)}
        out: dict[str, torch.Tensor] = {}
        for u in units(engine) if frozen else ():
            held = [s for s in u.slots if id(s.param) not in trained]
            if not held:
                continue
            with torch.no_grad(), GatheredParameters([s.param for s in held]):
                if engine.rank == 0:
                    for s in held:
                        out[s.name] = s.param.detach().to("cpu", copy=True)
        out.update(outside_slots(engine))
        return out

    def extra_targets(self, engine: Engine) -> dict[str, torch.Tensor]:
        return outside_slots(engine)  # buffers (a parameter outside every unit, if any, is full)

    def full_state_dict(self, engine: Engine) -> dict[str, torch.Tensor]:
        """Gathers one unit at a time (collective) and copies its parameters; nothing stays gathered
        that was not gathered before. With fp32 masters, trained parameters are assembled from every
        rank's master pieces instead (:func:`full_master_values`) and only units holding frozen
        parameters are gathered."""
        trained = {id(s.param) for s in trained_slots(engine)}
        full: dict[int, torch.Tensor] = full_master_values(engine)
        for u in units(engine):
            rest = [s for s in u.slots if id(s.param) not in full]
            if not rest:
                continue
            with torch.no_grad(), GatheredParameters([s.param for s in rest]):
                for s in rest:
                    v = s.param.detach()
                    full[id(s.param)] = v.to(
                        dtype=value_dtype(v.dtype) if id(s.param) in trained else v.dtype, copy=True
                    )
                    del v  # a view of the gathered storage: alive at the release, it would keep that memory
        return keyed_like_state_dict(engine, full, lambda v: v.detach().clone())

    def before_load(self, engine: Engine) -> None:
        # Units gathered ahead of use (prefetched, then not used) would keep the old values: drop them
        # now (finishing any all-gather in flight, so none reads a shard while it is overwritten).
        assert engine.sharding is not None  # the stage-3 layout
        engine.sharding.coordinator.release_idle()

    def after_load(self, engine: Engine) -> None:
        sharding = engine.sharding
        assert sharding is not None  # the stage-3 layout
        sharding.after_step()  # the persistent unit, from the new shards
        for u in sharding.units:  # units held gathered right now (e.g. inside GatheredParameters)
            if not u.persistent and u.state is not ShardState.SHARDED:
                if u.state is ShardState.GATHERING:
                    u.finish_gather()
                comm.all_gather(u.full_buffer, u.shard, sharding.pg, sharding.ledger, "parameters")


#: layout per ZeRO stage.
LAYOUTS: dict[int, CheckpointLayout] = {
    0: ReplicatedParamsLayout(),
    1: ReplicatedParamsLayout(),
    2: ReplicatedParamsLayout(),
    3: ShardedParamsLayout(),
}


def layout_for(engine: Engine) -> CheckpointLayout:
    """The :class:`CheckpointLayout` of ``engine``'s stage.

    Raises:
        NotImplementedError: no layout is registered in :data:`LAYOUTS` for that stage.
    """
    try:
        return LAYOUTS[engine.stage]
    except KeyError:
        raise NotImplementedError(
            f"checkpoints are not implemented for ZeRO stage {engine.stage}: register a "
            "CheckpointLayout in zerodp.checkpoint.LAYOUTS"
        ) from None


def module_state_dict(engine: Engine) -> dict[str, torch.Tensor]:
    """Full state dict of ``engine.module`` on every rank, keyed like ``module.state_dict()`` (tied
    weights under each name, as separate tensors), buffers included. Trained parameters are fp32: the
    fp32 master values under bf16/fp16 (collective: assembled across ranks), else the module's values;
    frozen parameters and buffers keep the module's dtype."""
    return layout_for(engine).full_state_dict(engine)
