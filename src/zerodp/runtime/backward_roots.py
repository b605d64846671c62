"""Rank-divergent losses that still work: back-propagate through every output of the engine's forwards.

With several ranks, every gradient collective (and, at stage 3, every backward fetch) is issued when
autograd reaches the module or parameter it belongs to. A loss that uses one of the forward's outputs
on some ranks only (``loss = ce(logits)`` on rank 0, ``loss = aux.pow(2).mean()`` on rank 1, both
outputs of the same forward) makes the ranks' graphs differ, and their collectives no longer pair up.

:class:`OutputRoots` keeps weak references to the tensors that the engine's forwards (grad enabled)
returned since the last ``engine.backward`` (tensors with a ``grad_fn``, found by
:func:`zerodp.runtime.tensor_walk.tensors_in`): an output the script dropped (``aux = engine(x)[1]``)
is gone, and the engine never keeps a graph alive. At ``backward`` it walks the loss's graph once
(:meth:`OutputRoots.plan`); every recorded output still alive that the loss does not reach (a *phantom* output on this
rank) becomes an extra root of the same ``torch.autograd.backward`` call with a zero gradient
(``torch.zeros(()).expand(shape)``: no memory). Every rank then runs the backward of
every module of its forward, in the same order (autograd orders nodes by creation; the forwards are the
same), so the collectives pair up; the zero gradient adds exactly nothing (``g + 0 == g``), so the
reduced gradients equal the single-process reference on the same global batch.

Presence: the optimizer must still skip a parameter that *no* rank's loss reached (torch leaves its
``.grad`` None; a zero gradient would still move AdamW's moments and apply weight decay). The walk
also collects the parameters the loss reaches; after the backward the reducer's "received a gradient"
flags of this micro-step are kept only for those (:meth:`GradientReducer.restrict_presence`), and the
flags are OR-ed across ranks at the step as before.

The same walk gives the :class:`BackwardPlan` that ``engine.backward`` agrees on with the other ranks
before backward starts (stage-3 fetches reached, compared; parameters reached, exchanged: when they
differ every rank reduces the buckets at the end, see the engine). Not made to work (the agreement then
raises at stage 3; stages 0-2 reduce at the end and work): outputs the forward does not return (kept in
an attribute, captured by a hook) or that the script dropped, and any phantom output when the loss's
graph holds a reentrant activation checkpoint (its inner parameters are invisible to the walk, so their
presence flags could not be restricted safely).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
import zlib
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from zerodp.runtime.tensor_walk import tensors_in


class _Presence(Protocol):
    def presence_flags(self) -> torch.Tensor: ...

    def restrict_presence(self, before: torch.Tensor, reached: set[int]) -> None: ...


@dataclasses.dataclass
class BackwardPlan:
    """What one rank's ``engine.backward(loss)`` will run, read from its autograd graph before it runs.

    ``phantom``: outputs the loss does not reach, back-propagated with a zero gradient (empty when
    none, or when the graph holds a reentrant checkpoint); ``loss_params``: ids of the parameters the
    loss itself reaches; ``fetches``: stage-3 backward fetches reached (module position -> count),
    over the loss and the phantom outputs; ``slots``: the engine's parameter slots reached, same.
    """

    loss: torch.Tensor
    phantom: list[torch.Tensor]
    loss_params: set[int]
    fetches: dict[int, int]
    slots: list[int]

    def fetch_digest(self) -> str:
        """Compared between ranks at the backward agreement: equal fetches, same backward gathers."""
        return f"loss graph {zlib.crc32(repr(sorted(self.fetches.items())).encode()):08x}"

    def slot_digest(self) -> int:
        """Exchanged (not compared) at the backward agreement: different parameter sets make every
        rank reduce this backward's buckets at its end, in one fixed order."""
        return zlib.crc32(repr(self.slots).encode()) & 0x7FFFFFFF

    def fetch_names(self, names: dict[int, str]) -> list[str]:
        """The fetches as module names (``blocks.2 x2`` for two fetches), for error messages."""
        return [names.get(p, f"#{p}") + (f" x{n}" if n > 1 else "") for p, n in sorted(self.fetches.items())]


def _walk(
    roots: list[Any], nodes: dict[int, Any], params: set[int], fetches: dict[int, int], positions: dict[int, int]
) -> bool:
    """Walk the autograd graph from ``roots`` (``grad_fn`` objects) along ``next_functions``, adding to
    ``nodes`` (by id, kept alive), ``params`` (ids of ``AccumulateGrad`` variables) and ``fetches``
    (stage-3 fetch hooks, see :mod:`zerodp.stage3.hooks`). Returns whether a reentrant checkpoint
    (whose inner graph is invisible) was met."""
    opaque = False
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if id(node) in nodes:
            continue
        nodes[id(node)] = node
        var = getattr(node, "variable", None)
        if var is not None:
            params.add(id(var))
        else:
            action = getattr(node, "action", None)
            if action is not None and getattr(action, "__name__", "") == "fetch":
                pos = positions.get(id(getattr(node, "module", None)), -1)
                fetches[pos] = fetches.get(pos, 0) + 1
            elif "Checkpoint" in type(node).__name__:
                opaque = True
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return opaque


class OutputRoots:
    """The engine's forward outputs since the last backward (see the module docstring).

    Args:
        module: the engine's module (fetch hooks are named by its ``named_modules()`` positions).
        slots: the reducer's parameter slots (objects with ``param`` and ``index``).
    """

    def __init__(self, module: torch.nn.Module, slots: Iterable[Any]) -> None:
        self.positions = {id(m): i for i, m in enumerate(module.modules())}
        self.names = {i: n or "<root>" for i, (n, _) in enumerate(module.named_modules())}
        self.slot_of = {id(s.param): s.index for s in slots}
        self.outputs: list[weakref.ref] = []  # weak: the engine never keeps a graph alive
        self.phantom_backwards = 0  # backwards that added zero-gradient roots (for tests and reports)
        self.seconds = 0.0  # wall time spent reading graphs in plan() (for the cost report)

    def record(self, out: Any) -> None:
        """Called with what a forward with grad enabled returned."""
        found = tensors_in(out, lambda t: t.grad_fn is not None)
        self.outputs.extend(weakref.ref(t) for t in found)

    def plan(self, loss: torch.Tensor, walk: bool = True) -> BackwardPlan:
        """Read the graph of ``loss`` and of this rank's phantom outputs (forgets the outputs).
        ``walk=False`` (a single rank): nothing to agree on, a plan without a walk."""
        outputs = [t for t in (r() for r in self.outputs) if t is not None]
        self.outputs = []
        if not walk:
            return BackwardPlan(loss, [], set(), {}, [])
        t0 = time.perf_counter()
        nodes: dict[int, Any] = {}
        params: set[int] = set()
        fetches: dict[int, int] = {}
        positions, slot_of = self.positions, self.slot_of
        opaque = _walk([loss.grad_fn], nodes, params, fetches, positions)
        loss_params = set(params)
        phantom = list({id(t): t for t in outputs if id(t.grad_fn) not in nodes}.values())
        if phantom and not opaque:
            _walk([t.grad_fn for t in phantom], nodes, params, fetches, positions)
        else:
            phantom = []
        slots = sorted(slot_of[p] for p in params if p in slot_of)
        self.seconds += time.perf_counter() - t0
        return BackwardPlan(loss, phantom, loss_params, fetches, slots)

    def backward(self, plan: BackwardPlan, retain_graph: bool, presence: _Presence) -> None:
        """``loss.backward(retain_graph)``, plus zero-gradient roots for the phantom outputs."""
        if not plan.phantom:
            plan.loss.backward(retain_graph=retain_graph)
            return
        before = presence.presence_flags().clone()
        zeros = [torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape) for t in plan.phantom]
        torch.autograd.backward([plan.loss, *plan.phantom], [None, *zeros], retain_graph=retain_graph)
        presence.restrict_presence(before, plan.loss_params)
        self.phantom_backwards += 1
