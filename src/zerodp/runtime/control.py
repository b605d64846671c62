"""The group control tensors travel on: host tensors (flags, norms, presence checks, checkpoint
coordination) always go over gloo.

[Note: control group] The engine's control collectives use small CPU tensors. On a group whose backend
takes CPU tensors (gloo, or :func:`zerodp.init_distributed`'s ``"cpu:gloo,cuda:nccl"`` on a CUDA
machine) they go on that group. A user's own ``init_process_group("nccl")`` (or
``deepspeed.init_distributed(dist_backend="nccl")``) makes an NCCL-only group, which refuses CPU
tensors; for such a group :func:`control_group` builds a gloo side group over the same ranks once
(``dist.new_group(ranks, backend="gloo")``, a collective of those ranks) and every host-tensor
collective of :mod:`zerodp.runtime.comm` goes there (:func:`route`). The collective guard's agreements
have their own gloo group already (:mod:`zerodp.runtime.collective_guard`).

Collectives on two groups are not ordered with each other; every rank issues each group's collectives
in the same order, which is all a pairing needs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zerodp.runtime.device import group_takes

#: id(group) -> (group, the group its host tensors go on); the default group is keyed by its object
#: (dist.group.WORLD), so a destroyed and re-initialised world gets a new entry
_CONTROL: dict[int, tuple[Any, dist.ProcessGroup | None]] = {}

#: gloo side groups built (a test reads it)
SIDE_GROUPS_BUILT: list[dist.ProcessGroup] = []


def control_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group host (CPU) tensors of a collective over ``group`` travel on: ``group`` itself when
    its backend takes CPU tensors, else a gloo side group over the same ranks (built on the first call
    for that group: every rank of ``group`` must make that first call, as for any collective).
    ``group`` None is the world (and is returned as None when the world takes CPU tensors)."""
    key_group = group if group is not None else dist.group.WORLD
    entry = _CONTROL.get(id(key_group))
    if entry is not None and entry[0] is key_group:
        return entry[1]
    if group_takes("cpu", group):
        chosen = group
    else:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        # only this group's ranks build it (a data-parallel subgroup of a larger world)
        chosen = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=group is not None)
        SIDE_GROUPS_BUILT.append(chosen)
    _CONTROL[id(key_group)] = (key_group, chosen)
    return chosen


def route(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group a collective of ``tensor`` over ``group`` is issued on: :func:`control_group` for a
    host tensor, ``group`` for a device tensor. The one place this choice is made."""
    if tensor.device.type != "cpu":
        return group
    return control_group(group)


def prepare(topology: Any) -> None:
    """Build the side groups of ``topology``'s data- and model-parallel groups now (in
    :func:`zerodp.initialize`, where every rank is), not at the first control collective."""
    control_group(topology.dp_group)
    if topology.mp_group is not None:
        control_group(topology.mp_group)


def forget() -> None:
    """Drop every cached choice (tests that fake groups)."""
    _CONTROL.clear()
    SIDE_GROUPS_BUILT.clear()
