"""zerodp.runtime.guards' per-forward checks, written for speed (they run at every forward and
backward), give the answers of their plain forms: the walk for parameters added after initialize
agrees with ``named_parameters()``, and the re-binding check (an integer address per slot) still
adopts ``p.data = t`` and refuses a re-binding to another shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerodp
from zerodp.runtime.guards import _has_unknown_trainable
from zerodp.runtime.refusal import RefusedError

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "device": "cpu"}


def plain_answer(m: nn.Module, known: set[int]) -> bool:
    return any(id(p) not in known and p.requires_grad for _, p in m.named_parameters())


class ListsNothing(nn.Sequential):
    """A submodule that hides its children from ``named_modules`` (as a wrapper might)."""

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):  # type: ignore[override]
        yield prefix, self


def structures() -> list[tuple[str, nn.Module, set[int]]]:
    """(what, module, known ids) pairs: the known ids are those of the module as first built."""
    out = []

    def add(what: str, build, change) -> None:
        m = build()
        known = {id(p) for p in m.parameters()}
        change(m)
        out.append((what, m, known))

    seq = lambda: nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 2), nn.ReLU()), nn.Linear(2, 1))  # noqa: E731
    add("unchanged", seq, lambda m: None)
    add("deep parameter", seq, lambda m: m[1][0].register_parameter("extra", nn.Parameter(torch.zeros(2))))
    add("frozen parameter", seq, lambda m: m[1][0].register_parameter("extra", nn.Parameter(torch.zeros(2), False)))
    add("new submodule", seq, lambda m: m.add_module("head", nn.Linear(1, 1)))
    add("None entries", seq, lambda m: (m[1].add_module("gap", None), m[0].register_parameter("b2", None)))

    def shared(m: nn.Module) -> None:
        m.add_module("again", m[1])  # the same submodule twice: nothing new

    add("shared submodule", seq, shared)
    add(
        "hidden by an override",
        lambda: nn.Sequential(nn.Linear(3, 3), ListsNothing(nn.Linear(3, 3))),
        lambda m: m[1][0].register_parameter("extra", nn.Parameter(torch.zeros(1))),
    )
    return out


@pytest.mark.parametrize("what, module, known", structures(), ids=lambda v: v if isinstance(v, str) else "")
def test_walk_agrees_with_named_parameters(what: str, module: nn.Module, known: set[int]) -> None:
    assert _has_unknown_trainable(module, known) == plain_answer(module, known)
    expect = {"deep parameter": True, "new submodule": True}.get(what, False)
    assert plain_answer(module, known) == expect  # the structures test what they say


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_added_parameter_refused_at_forward_by_its_name(world1, stage: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    engine = zerodp.initialize(model, {**CONFIG, "zero_optimization": {"stage": stage}})
    engine.backward(engine(torch.randn(3, 4)).sum())
    engine.step()
    model[1].register_parameter("late", nn.Parameter(torch.zeros(2)))
    model[0].register_parameter("later", nn.Parameter(torch.zeros(2)))
    with pytest.raises(RefusedError, match=r"parameter '0\.later' was added to the module after zerodp.initialize"):
        engine(torch.randn(3, 4))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_rebinding_adopted_and_wrong_shape_refused(world1, stage: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    engine = zerodp.initialize(model, {**CONFIG, "zero_optimization": {"stage": stage}})
    g = engine.groups[0]
    slot = next(s for s in g.slots if s.param is model[1].bias)
    model[1].bias.data = torch.tensor([0.25, -0.5])
    engine(torch.randn(3, 4))
    view = g.buffer[slot.offset - g.shard_offset : slot.offset - g.shard_offset + slot.numel]
    assert model[1].bias.data_ptr() == view.data_ptr()  # pointed back at the flat buffer
    assert torch.equal(view, torch.tensor([0.25, -0.5]))
    model[1].bias.data = torch.zeros(3)
    with pytest.raises(RefusedError, match=r"'1\.bias' was re-bound"):
        engine(torch.randn(3, 4))
