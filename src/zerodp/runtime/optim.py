"""Param groups and the torch optimizer that updates this rank's partition.

The optimizer is torch's own (``Adam``, ``AdamW``, ``SGD``, ... see :data:`zerodp.config_keys.OPTIMIZERS`); its
"parameters" are the 1-D pieces of the flat buffers this rank owns (:class:`zerodp.runtime.partition.Piece`), one per
(parameter, owned range), so its per-parameter state and skipping of ``grad is None`` match torch on the unpartitioned
model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zerodp.config import OptimizerConfig, optimizer_options
from zerodp.runtime.partition import FlatGroup

#: options a param-group dict may carry besides ``params``; :func:`build_optimizer` further checks
#: that the configured torch optimizer takes each one.
GROUP_OPTIONS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "name",
    "momentum",
    "dampening",
    "nesterov",
    "amsgrad",
    "maximize",
    "lr_decay",
    "initial_accumulator_value",
    "rho",
    "alpha",
    "centered",
    "momentum_decay",
    "decoupled_weight_decay",
    "etas",
    "step_sizes",
    "lambd",
    "t0",
)


@dataclass
class ParamGroupSpec:
    """One user param group: trainable named parameters and per-group optimizer options."""

    params: list[tuple[str, nn.Parameter]]
    options: dict[str, Any] = field(default_factory=dict)


def _refuse_non_tensors(items: list[Any], where: str, allowed: str) -> None:
    """Raises ValueError naming the first entry of ``items`` that is not a tensor (a (name, parameter)
    pair of ``model.named_parameters()``, a name...) and saying what ``allowed`` is."""
    odd = next((x for x in items if not isinstance(x, torch.Tensor)), None)
    if odd is None:
        return
    if isinstance(odd, tuple) and len(odd) == 2 and isinstance(odd[0], str):
        what = f"({odd[0]!r}, parameter): from model.named_parameters()?"
    else:
        what = repr(odd)[:60]
    raise ValueError(f"{where} holds a {type(odd).__name__} ({what}); {allowed}")


def _raw_groups(module: nn.Module, model_parameters: Iterable[Any] | None) -> list[dict[str, Any]]:
    """``model_parameters`` as a list of param-group dicts (all of ``module``'s parameters for None).

    Raises ValueError: an entry is neither a parameter nor a dict (or they are mixed).
    """
    if model_parameters is None:
        return [{"params": list(module.parameters())}]
    items = list(model_parameters)
    if items and all(isinstance(x, dict) for x in items):
        return [dict(x) for x in items]
    _refuse_non_tensors(
        items,
        "model_parameters",
        "it must be an iterable of parameters (model.parameters()) or of param-group dicts "
        "({'params': [...], 'weight_decay': ...}), not a mix",
    )
    return [{"params": items}]


def normalize_param_groups(module: nn.Module, model_parameters: Iterable[Any] | None) -> list[ParamGroupSpec]:
    """Turn ``model_parameters`` (None, parameters, or param-group dicts) into named groups.

    Frozen parameters (``requires_grad=False``) are dropped from the groups; they stay in the module,
    replicated. Raises ValueError for a parameter not in ``module``, one listed twice, a group without
    ``params`` or with an option outside :data:`GROUP_OPTIONS`, and for a ``model_parameters`` that
    lists no parameter at all (an empty list, an exhausted generator, groups with empty ``params``).
    """
    names = {id(p): n for n, p in module.named_parameters()}
    raw = _raw_groups(module, model_parameters)
    seen: set[int] = set()
    specs = []
    for gi, group in enumerate(raw):
        if "params" not in group:
            raise ValueError(f"param group {gi} has no 'params' key")
        unknown = sorted(set(group) - {"params", *GROUP_OPTIONS})
        if unknown:
            raise ValueError(
                f"param group {gi} has unsupported option(s) {unknown}; allowed: {', '.join(GROUP_OPTIONS)}"
            )
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        named = []
        _refuse_non_tensors(
            params, f"param group {gi}", "its 'params' must be parameters of the model (model.parameters())"
        )
        for p in params:
            if id(p) not in names:
                raise ValueError(
                    f"param group {gi} holds a tensor of shape {tuple(p.shape)} that is not "
                    "a parameter of the model passed to initialize()"
                )
            if id(p) in seen:
                raise ValueError(f"parameter '{names[id(p)]}' appears in more than one param group")
            seen.add(id(p))
            if p.requires_grad:
                named.append((names[id(p)], p))
        options = {k: v for k, v in group.items() if k != "params"}
        if "betas" in options:
            options["betas"] = tuple(options["betas"])
        specs.append(ParamGroupSpec(named, options))
    if model_parameters is not None and not seen:
        raise ValueError(
            "model_parameters holds no parameter (an exhausted generator? model.parameters() can be iterated "
            "only once); torch's optimizers refuse an empty parameter list as well. Pass model.parameters() "
            "afresh or a list of parameters, or leave model_parameters out to train every parameter"
        )
    return [s for s in specs if s.params] or specs[:1]


def build_optimizer(
    cfg: OptimizerConfig, specs: list[ParamGroupSpec], groups: list[FlatGroup]
) -> torch.optim.Optimizer:
    """The configured torch optimizer over this rank's pieces: one torch param group per user param
    group, in the user's order (possibly empty on this rank), so group hyperparameters and schedulers
    line up.

    Raises:
        ValueError: a param group carries an option that ``cfg.type``'s torch class does not take.
    """
    defaults = cfg.params.torch_kwargs()
    cls = cfg.torch_class()
    allowed = set(optimizer_options(cfg.type)) | {"name"}
    for gi, s in enumerate(specs):
        unknown = sorted(set(s.options) - allowed)
        if unknown:
            raise ValueError(
                f"param group {gi} has option(s) {unknown} that torch.optim.{cfg.type} does not "
                f"take; allowed: {', '.join(sorted(allowed))}"
            )
    torch_groups: list[dict[str, Any]] = [{"params": [], **s.options} for s in specs] or [{"params": []}]
    for g in groups:
        for piece in g.pieces:
            torch_groups[piece.slot.group_index]["params"].append(piece.opt_tensor)
    return cls(torch_groups, **defaults)
