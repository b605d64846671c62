"""zerodp's state per module, reached through the module, as FSDP2 reaches its state with
``fully_shard.state(module)`` (torch keeps it in the module's ``__dict__``).

Every module holding a parameter that an engine or ``zerodp.zero.Init`` manages carries one
:class:`ZeroState` (:func:`zero_state`) with one :class:`ParamRecord` per such parameter: the engine that
wraps it and its flat group and slot (read by :mod:`zerodp.accessors`), the stage-3 unit owning it (read
by ``GatheredParameters``, ``register_external_parameter`` and ``zero.Init``). A parameter reaches its
record through the module holding it (the first module, in ``module.modules()`` order, whose own
parameters include it; :func:`param_holders`): the parameter carries a weak link to that module and the
name of the engine that wraps it (``initialize`` refuses a parameter wrapped before, also after its
engine and module were dropped: its data stays laid out for that engine).

Lifetimes: the state lives as long as its module; it holds the stage-3 owner strongly (a submodule kept
alone after the engine and root are dropped still gathers) and the engine, its groups and slots weakly
(an engine is collectable once the user drops it, even while the module lives). A copied or pickled
module or parameter carries no state (``copy.deepcopy`` of a wrapped model gives an unwrapped one).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from torch import nn

from zerodp.runtime.partition import FlatGroup

#: key of a module's ``__dict__`` holding its :class:`ZeroState`
STATE_KEY = "_zerodp_state"
#: key of a parameter's ``__dict__`` holding its :class:`HolderLink`
LINK_KEY = "_zerodp_holder"


class WrappingEngine(Protocol):
    """What a record reaches of the engine wrapping a parameter (a Protocol: no import of the engine)."""

    def refresh_masters(self, param: nn.Parameter) -> None:
        """``param`` was edited under ``GatheredParameters(modifier_rank=...)``: copy it into the fp32 masters."""


class ParamRecord:
    """What zerodp keeps about one parameter in the state of the module holding it.

    ``engine``, ``group`` and ``slot`` are weak references (None: no engine, or a frozen parameter
    outside the engine's flat groups); ``owner`` is the stage-3 :class:`zerodp.stage3.ownership.Owner`
    (None: not partitioned), held strongly: it lives as long as the module."""

    __slots__ = ("param", "engine", "group", "slot", "owner")

    def __init__(self, param: nn.Parameter) -> None:
        self.param = weakref.ref(param)
        self.engine: weakref.ref | None = None
        self.group: weakref.ref | None = None
        self.slot: weakref.ref | None = None
        self.owner: Any = None  # zerodp.stage3.ownership.Owner (a higher package)

    def live_engine(self) -> WrappingEngine | None:
        return self.engine() if self.engine is not None else None


class ZeroState:
    """The state of one module: its managed parameters' records, by parameter identity (each record
    checks that its parameter is still the one asked about). Copies and pickles are empty."""

    def __init__(self) -> None:
        self.records: dict[int, ParamRecord] = {}
        #: parameters declared by ``register_external_parameter(module, param)`` before a stage-3
        #: engine adopted the module (weak references)
        self.pending_external: list[weakref.ref] = []

    def record(self, param: nn.Parameter) -> ParamRecord | None:
        rec = self.records.get(id(param))
        return rec if rec is not None and rec.param() is param else None

    def __deepcopy__(self, memo: dict) -> ZeroState:
        return ZeroState()

    def __reduce__(self) -> tuple:
        return (ZeroState, ())


class HolderLink:
    """A parameter's link to the module holding its record (weak), and the engine that wrapped it
    (its description, e.g. ``"ZeRO stage 2"``; None while only ``zero.Init`` manages it)."""

    __slots__ = ("module", "wrapped_by")

    def __init__(self, module: nn.Module | None, wrapped_by: str | None = None) -> None:
        self.module = weakref.ref(module) if module is not None else None
        self.wrapped_by = wrapped_by

    def holder(self) -> nn.Module | None:
        return self.module() if self.module is not None else None

    def __deepcopy__(self, memo: dict) -> HolderLink:
        return HolderLink(None)

    def __reduce__(self) -> tuple:
        return (HolderLink, (None,))


def zero_state(module: nn.Module) -> ZeroState | None:
    """The zerodp state of ``module``, or None if zerodp manages none of its own parameters."""
    state = module.__dict__.get(STATE_KEY)
    return state if isinstance(state, ZeroState) else None


def module_state(module: nn.Module) -> ZeroState:
    """The zerodp state of ``module``, created if it has none."""
    state = zero_state(module)
    if state is None:
        state = module.__dict__[STATE_KEY] = ZeroState()
    return state


def _link(param: Any) -> HolderLink | None:
    link = getattr(param, "__dict__", {}).get(LINK_KEY)
    return link if isinstance(link, HolderLink) else None


def param_record(param: Any) -> ParamRecord | None:
    """The record of ``param`` in the state of the module holding it; None for a parameter zerodp does
    not manage (or whose module was collected)."""
    link = _link(param)
    holder = link.holder() if link is not None else None
    state = zero_state(holder) if holder is not None else None
    return state.record(param) if state is not None else None


def wrapped_by(param: Any) -> str | None:
    """The description of the engine that wrapped ``param`` (kept by the parameter itself), or None."""
    link = _link(param)
    return link.wrapped_by if link is not None else None


def ensure_record(param: nn.Parameter, holder: nn.Module) -> ParamRecord:
    """``param``'s record, in the state of ``holder`` (created there, or moved there from the module
    that held it before, e.g. the module ``zero.Init`` partitioned when an engine picks another)."""
    link = _link(param)
    rec = param_record(param)
    before = link.holder() if link is not None else None
    if before is not holder:
        if before is not None and rec is not None:
            state = zero_state(before)
            assert state is not None  # rec was found in it
            del state.records[id(param)]
        param.__dict__[LINK_KEY] = HolderLink(holder, link.wrapped_by if link is not None else None)
    state = module_state(holder)
    if rec is None:
        rec = state.records[id(param)] = ParamRecord(param)
    else:
        state.records[id(param)] = rec
    return rec


def mark_wrapped(param: nn.Parameter, description: str) -> None:
    """Remember on ``param`` that an engine (``description``) wrapped it (checked by ``initialize``)."""
    link = _link(param)
    assert link is not None  # ensure_record ran first
    link.wrapped_by = description


def param_holders(module: nn.Module) -> dict[int, tuple[nn.Parameter, nn.Module]]:
    """id(parameter) -> (the parameter, the first module in ``module.modules()`` order whose own
    parameters include it) for every parameter of ``module`` (tied parameters once)."""
    holders: dict[int, tuple[nn.Parameter, nn.Module]] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and id(p) not in holders:
                holders[id(p)] = (p, m)
    return holders


def refresh_masters(param: Any) -> None:
    """Let the engine wrapping ``param`` copy its edited value into its fp32 masters (nothing without one)."""
    rec = param_record(param)
    engine = rec.live_engine() if rec is not None else None
    if engine is not None:
        engine.refresh_masters(param)


def attach_engine(module: nn.Module, engine: WrappingEngine, groups: Sequence[FlatGroup], description: str) -> None:
    """Record ``engine`` (weakly) in the states of the modules holding ``module``'s parameters, with
    each parameter's flat group and slot (None for a frozen parameter, outside ``groups``), and mark the
    parameters as wrapped by ``description`` (e.g. ``"ZeRO stage 2"``). Called once by the engine."""
    slots = {id(s.param): (g, s) for g in groups for s in g.slots}
    ref = weakref.ref(engine)
    for key, (p, holder) in param_holders(module).items():
        rec = ensure_record(p, holder)
        rec.engine = ref
        found = slots.get(key)
        rec.group, rec.slot = (weakref.ref(found[0]), weakref.ref(found[1])) if found else (None, None)
        mark_wrapped(p, description)


def refuse_wrapped(model: nn.Module) -> None:
    """Raise if any parameter of ``model`` already belongs to an engine: its data was re-laid out into
    that engine's flat buffers (or shards) and its gradient hooks feed that engine's reducer.

    Raises:
        ValueError: naming the engine and the first such parameter.
    """
    for name, p in model.named_parameters(remove_duplicate=True):
        engine = wrapped_by(p)
        if engine is not None:
            raise ValueError(
                f"zerodp.initialize: the model is already wrapped by an engine ({engine}; parameter "
                f"'{name}'); keep using that engine, or build a new model (a model, or any module sharing "
                "its parameters, can be wrapped once, also after its engine was dropped: its parameters "
                "stay laid out for that engine)"
            )
