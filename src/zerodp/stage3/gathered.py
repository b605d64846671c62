"""Gathering partitioned parameters outside forward: :class:`GatheredParameters` (DeepSpeed's
``deepspeed.zero.GatheredParameters``), re-exported by :mod:`zerodp.zero`.

Inside the context every listed parameter holds its full value on every rank (its unit is gathered);
with ``modifier_rank`` set, that rank's in-place edits are broadcast, written back into every rank's
shard and the fp32 masters refreshed on exit.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

from zerodp.runtime import comm
from zerodp.runtime.guards import acknowledge_edit
from zerodp.runtime.zero_state import refresh_masters
from zerodp.stage3.ownership import Owner, coordinator_busy, owner_of
from zerodp.stage3.units import ShardedUnit, ShardState

#: attribute zero.Init sets on every parameter registered while it is active (its creation number, the same
#: on every rank: modules are built in program order), DeepSpeed numbering every parameter it converts
#: (``ds_id``), persistent ones included; orders the non-partitioned ones built under Init
INIT_SEQ = "_zerodp_init_seq"
_init_seq = itertools.count()


def number_init_parameter(param: torch.Tensor) -> None:
    """Give ``param`` its creation number (see :data:`INIT_SEQ`) unless it has one (zero.Init's hook)."""
    if INIT_SEQ not in param.__dict__:
        param.__dict__[INIT_SEQ] = next(_init_seq)


class GatheredParameters:
    """Context manager: inside it, ``params`` hold their full values on every rank.

    The partitioned parameters are gathered unit by unit in ``ds_id`` order (a number each parameter
    gets when its unit is built, the same on every rank), as DeepSpeed sorts by ``ds_id``: the
    iterable may come in any order, e.g. a list built from a ``set`` (transformers' ``from_pretrained``),
    whose order differs per rank. The ranks must still name the same set of units: they check it with
    one small all-gather and raise ``ValueError`` otherwise, instead of pairing different units'
    collectives.

    Args:
        params: a parameter or an iterable of parameters, in any order, duplicates allowed (of any stage;
            non-partitioned ones are already full and are only broadcast on exit when ``modifier_rank``
            is set: in creation order when all were built under ``zero.Init`` (its persistent ones,
            below ``stage3_param_persistence_threshold``, e.g. in transformers' ``from_pretrained``
            before ``initialize``), as DeepSpeed orders them by ``ds_id``; else (zerodp's addition for
            stages 0-2, where DeepSpeed leaves them alone) in the order given, which must be the same
            on every rank, checked by their shapes). Tensors that are not parameters (``state_dict()``'s
            detached values) are left alone, as DeepSpeed drops tensors without a ``ds_id``.
        modifier_rank: data-parallel rank whose in-place edits are kept: on exit its values are
            broadcast to every rank and re-partitioned. None: edits are discarded (read-only use).
        enabled: False makes this a no-op.

    Raises:
        ValueError: ``modifier_rank`` is outside ``[0, world_size)``; the ranks name different partitioned
            units, or (with ``modifier_rank``) differently shaped non-partitioned parameters in order.
    """

    def __init__(
        self, params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None, enabled: bool = True
    ) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._units: list[tuple[ShardedUnit, Owner]] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        if self.modifier_rank is not None and dist.is_initialized():
            n = dist.get_world_size()
            if not 0 <= self.modifier_rank < n:
                raise ValueError(f"modifier_rank must be in [0, {n}), got {self.modifier_rank}")
        seen: dict[int, tuple[ShardedUnit, Owner]] = {}
        for p in self.params:
            owner = owner_of(p)
            if owner is not None:
                seen.setdefault(id(owner.unit), (owner.unit, owner))
        ordered = sorted(seen.values(), key=lambda uo: uo[0].ds_id_base)
        if ordered:
            _agree(
                [u.ds_id_base for u, _ in ordered],
                ordered[0][1].pg,
                ordered[0][0].shard.device,
                "partitioned units (ds_id of their first parameter)",
            )
        for u, owner in ordered:
            with coordinator_busy(owner):
                if u.state is ShardState.SHARDED:
                    u.start_gather(owner.pg, owner.ledger, "gathered_parameters")
                if u.state is ShardState.GATHERING:
                    u.finish_gather()
            u.users += 1
            self._units.append((u, owner))
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        modify = self.modifier_rank is not None and exc[0] is None
        if modify:  # p.data = t inside the block: kept like an in-place edit
            for u, _ in self._units:
                u.collect_rebound()
        if modify and dist.is_initialized() and dist.get_world_size() > 1:
            partitioned = {id(s.param) for u, _ in self._units for s in u.slots}
            assert self.modifier_rank is not None  # modify
            for u, owner in self._units:
                src = dist.get_global_rank(owner.pg, self.modifier_rank) if owner.pg else self.modifier_rank
                comm.broadcast(u.full_buffer, src, owner.pg, owner.ledger, "gathered_parameters")
            # tensors that are not parameters (e.g. state_dict()'s detached views, which transformers 4.x
            # passes in set order) are left alone, as DeepSpeed keeps only tensors with a ds_id
            plain = list(
                {
                    id(p): p
                    for p in self.params
                    if id(p) not in partitioned and (isinstance(p, torch.nn.Parameter) or INIT_SEQ in p.__dict__)
                }.values()
            )
            if plain:
                _broadcast_plain(plain, self.modifier_rank)
        if modify:
            for u, _ in self._units:
                u.write_back()
            for p in self.params:  # the fp32 masters of the engine training p, if any
                refresh_masters(p)
        for p in self.params:
            acknowledge_edit(p)
        for u, owner in self._units:
            u.users -= 1
            if u.users <= 0 and not u.persistent:
                with coordinator_busy(owner):
                    u.release()
        self._units = []


def _broadcast_plain(plain: list[torch.Tensor], src: int) -> None:
    """Broadcast the non-partitioned ``plain`` from ``src``, paired across ranks by creation number
    when every one has it (built under zero.Init), else in the order given (checked by shapes)."""
    known: list[int] = [p.__dict__[INIT_SEQ] for p in plain if INIT_SEQ in p.__dict__]
    if len(known) == len(plain):
        plain = [p for _, p in sorted(zip(known, plain, strict=True), key=lambda sp: sp[0])]
        _agree(sorted(known), None, plain[0].device, "non-partitioned parameters built under zero.Init")
    else:
        _agree(
            [f"{tuple(p.shape)}:{p.dtype}" for p in plain],
            None,
            plain[0].device,
            "non-partitioned parameters (their shapes, in the order given)",
        )
    for p in plain:
        dist.broadcast(p.data, src=src)


def _agree(keys: list, pg: dist.ProcessGroup | None, device: torch.device, what: str) -> None:
    """Check that every rank of ``pg`` holds the same ``keys`` (one all-gather of two int64 per rank:
    the count and a CRC of the keys); raise ``ValueError`` naming the ranks otherwise. Nothing to do on
    one rank."""
    if not dist.is_initialized() or dist.get_world_size(pg) == 1:
        return
    digest = zlib.crc32(",".join(str(k) for k in keys).encode())
    mine = torch.tensor([len(keys), digest], dtype=torch.int64, device=device)
    table = torch.empty(dist.get_world_size(pg) * 2, dtype=torch.int64, device=device)
    comm.all_gather_single(table, mine, group=pg)
    rows = table.view(-1, 2).tolist()
    if any(r != rows[0] for r in rows):
        counts = ", ".join(f"rank {i}: {r[0]}" for i, r in enumerate(rows))
        raise ValueError(
            f"GatheredParameters: the ranks passed different {what} ({counts} of them; the "
            "lists differ even where the counts agree). Every rank must pass the same "
            "parameters; their order does not matter for partitioned ones"
        )
