"""Loading a full ``module.state_dict()``-style dict into a running engine (any stage, any precision).

An engine does not keep parameters where ``module.load_state_dict`` writes: at stages 0-2 with bf16/fp16
the optimizer updates fp32 *master* copies and casts them back after each step (a value written only
into the module's parameters is overwritten by the next step), and at stage 3 each parameter holds no
values outside forward. :func:`load_module_state` writes every value where the engine reads
it: the flat buffer or this rank's shard (module dtype), the fp32 master pieces (from the given values,
not from their rounded module-dtype copies), the gathered buffer of units kept gathered, frozen
parameters and persistent buffers. :func:`guard_module_load_state_dict` makes the plain
``module.load_state_dict`` refuse where it would be silently undone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp
from torch.utils.hooks import RemovableHandle

from zerodp.runtime import comm
from zerodp.runtime.comm import CommLedger
from zerodp.runtime.partition import FlatGroup


class LoadResult(NamedTuple):
    """As torch's ``load_state_dict`` result: keys expected but absent, keys present but unknown."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class GatheredCopy(NamedTuple):
    """A full (gathered) 1-D buffer in ``group``'s flat layout whose ``group.buffer`` is only a shard (a
    stage-3 unit kept gathered): loads are written into both."""

    group: FlatGroup
    full: torch.Tensor


def load_module_state(
    module: nn.Module,
    groups: Sequence[FlatGroup],
    frozen: Sequence[nn.Parameter],
    gathered: Sequence[GatheredCopy],
    state_dict: Mapping[str, torch.Tensor],
    strict: bool,
    pg: ProcessGroup | None,
    ledger: CommLedger,
) -> LoadResult:
    """Collective: load ``state_dict`` (keys and shapes as ``module.state_dict()`` before ``initialize``)
    into the engine's parameters, fp32 masters and buffers. Every rank must pass the same values.

    Args:
        state_dict: name -> tensor (any float dtype: masters get the values in fp32, parameters in the
            module dtype). Tied parameters may appear under any of their names.
        strict: require exactly the module's keys (as ``torch.nn.Module.load_state_dict``).

    Raises:
        RuntimeError: with ``strict``, missing or unexpected keys; a shape that differs from the
            parameter's or buffer's; ranks passing different values (checked with one all-reduce).
    """
    names = _param_names(module)  # id(param) -> every qualified name
    buffers = dict(module.named_buffers(remove_duplicate=False))
    expected = {n for ns in names.values() for n in ns} | {
        n for n in buffers if n.rsplit(".", 1)[-1] not in _non_persistent(module, n)
    }
    missing, unexpected = _check_keys(names, expected, state_dict, strict)
    values = _ParamValues(names, state_dict)
    checksum = torch.zeros(1, dtype=torch.float64)  # every loaded value, summed in load order
    with torch.no_grad():
        _load_groups(groups, gathered, values, checksum)
        for p in frozen:
            v = values.of(p, p.shape)
            if v is not None:
                p.data.copy_(v.view(p.shape))
                checksum += v.double().sum()
        _load_buffers(buffers, expected, state_dict, checksum)
    _check_same_values(checksum, pg, ledger)
    return LoadResult(missing, unexpected)


def _check_keys(
    names: dict[int, list[str]], expected: set[str], state_dict: Mapping[str, torch.Tensor], strict: bool
) -> tuple[list[str], list[str]]:
    """(missing, unexpected) keys; a tied parameter needs one of its names (HF's save_pretrained writes a
    tied weight once). Raises RuntimeError with ``strict`` if either is not empty."""
    aliases = {n: ns for ns in names.values() for n in ns}
    missing = sorted(n for n in expected - set(state_dict) if not any(a in state_dict for a in aliases.get(n, ())))
    unexpected = sorted(set(state_dict) - expected)
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"load_module_state_dict(strict=True): missing keys {missing}, unexpected keys "
            f"{unexpected} (the keys are those of module.state_dict() before initialize)"
        )
    return missing, unexpected


def _flatten(v: torch.Tensor) -> torch.Tensor:
    return v.reshape(-1)


class _ParamValues:
    """A parameter's value in the state dict under any of its names (``names``: id(param) -> names)."""

    def __init__(self, names: dict[int, list[str]], state_dict: Mapping[str, torch.Tensor]) -> None:
        self.names = names
        self.state_dict = state_dict

    def of(
        self, param: nn.Parameter, shape: torch.Size, flat: Callable[[torch.Tensor], torch.Tensor] = _flatten
    ) -> torch.Tensor | None:
        """``flat(value)`` in fp32, or None if no name of ``param`` is in the state dict.

        Raises:
            RuntimeError: the value's shape is not ``shape``."""
        for n in self.names.get(id(param), ()):
            if n in self.state_dict:
                v = self.state_dict[n].detach()
                if tuple(v.shape) != tuple(shape):
                    raise RuntimeError(
                        f"load_module_state_dict: '{n}' has shape {tuple(v.shape)}, the parameter "
                        f"has shape {tuple(shape)}"
                    )
                return flat(v).to(torch.float32)
        return None


def _load_groups(
    groups: Sequence[FlatGroup], gathered: Sequence[GatheredCopy], values: _ParamValues, checksum: torch.Tensor
) -> None:
    """Each trained parameter's value into the flat buffer or this rank's shard, the gathered copy of a
    unit kept gathered, and the fp32 master pieces (from the given values, not their rounded copies)."""
    full_of = {id(c.group): c.full for c in gathered}
    for g in groups:
        base, end = g.shard_offset, g.shard_offset + g.buffer.numel()
        loaded: dict[int, torch.Tensor] = {}
        for s in g.slots:
            v = values.of(s.param, s.shape, s.flat_values)
            if v is None:
                continue
            loaded[id(s)] = v
            checksum += v.double().sum()
            lo, hi = max(s.offset, base), min(s.offset + s.numel, end)
            if lo < hi:
                g.buffer[lo - base : hi - base].copy_(v[lo - s.offset : hi - s.offset])
            full = full_of.get(id(g))
            if full is not None:
                full[s.offset : s.offset + s.numel].copy_(v)
        for piece in g.pieces:
            v = loaded.get(id(piece.slot))
            if v is not None and piece.master is not None:
                piece.master.copy_(v[piece.lo - piece.slot.offset : piece.hi - piece.slot.offset])


def _load_buffers(
    buffers: dict[str, torch.Tensor], expected: set[str], state_dict: Mapping[str, torch.Tensor], checksum: torch.Tensor
) -> None:
    """The persistent buffers given in ``state_dict`` (floating ones counted in ``checksum``)."""
    for n, b in buffers.items():
        if n in state_dict and n in expected:
            v = state_dict[n].detach()
            if v.shape != b.shape:
                raise RuntimeError(
                    f"load_module_state_dict: buffer '{n}' has shape {tuple(v.shape)}, "
                    f"the module's has {tuple(b.shape)}"
                )
            b.copy_(v)
            if v.is_floating_point():
                checksum += v.double().sum()


def _check_same_values(checksum: torch.Tensor, pg: ProcessGroup | None, ledger: CommLedger) -> None:
    """Collective: raise RuntimeError on every rank if the ranks' checksums differ (one MIN, one MAX all-reduce)."""
    if dist.is_initialized() and dist.get_world_size(pg) > 1:
        lo_sum, hi_sum = checksum.clone(), checksum.clone()
        comm.all_reduce(lo_sum, pg, ledger, "load_state_dict", op=ReduceOp.MIN)
        comm.all_reduce(hi_sum, pg, ledger, "load_state_dict", op=ReduceOp.MAX)
        if not torch.equal(lo_sum, hi_sum):
            raise RuntimeError(
                "load_module_state_dict: ranks passed different values (every rank must load "
                "the same state dict; the engine's replicas would diverge)"
            )


def guard_module_load_state_dict(module: nn.Module, stage: int, has_master: bool) -> list[RemovableHandle]:
    """Make ``module.load_state_dict`` (and any submodule's) raise where its writes would be undone: at
    stage 3 (the parameters hold no values outside forward) or with fp32 masters (``has_master``: the
    next step copies them back); nothing is guarded otherwise."""
    if stage != 3 and not has_master:
        return []
    why = (
        "stage 3 keeps each parameter as a shard; outside forward the module's parameters hold no values"
        if stage == 3
        else "the next step would copy the fp32 master weights back over them"
    )

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(
            f"module.load_state_dict on a module wrapped by a zerodp engine would be undone "
            f"({why}); call engine.load_module_state_dict(state_dict) instead (collective: "
            "every rank calls it with the same values)"
        )

    return [m.register_load_state_dict_pre_hook(refuse) for m in module.modules()]


def _param_names(module: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(n)
    return out


def _non_persistent(module: nn.Module, qualified: str) -> set[str]:
    owner = module.get_submodule(qualified.rsplit(".", 1)[0]) if "." in qualified else module
    return set(owner._non_persistent_buffers_set)
