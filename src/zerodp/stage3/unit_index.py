"""Which stage-3 units each module's forward and backward need: its own parameters' unit, plus the
units of tied parameters it shares and of external parameters it uses (registered by
:func:`zerodp.zero.register_external_parameter`, or found used inside its forward by the coordinator);
persistent units are never listed (they stay gathered). See [Note: units] in :mod:`zerodp.stage3.units`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from zerodp.stage3.aliases import AliasTable
from zerodp.stage3.units import ShardedUnit


@dataclass
class UnitIndex:
    """Which units each module needs: its own, plus those of tied and external parameters."""

    units: list[ShardedUnit] = field(default_factory=list)
    by_param: dict[int, ShardedUnit] = field(default_factory=dict)  # id(param) -> unit
    by_module: dict[int, list[ShardedUnit]] = field(default_factory=dict)  # id(module) -> units
    #: storages of the units' buffers, for views that outlive a release (see :mod:`zerodp.stage3.aliases`)
    aliases: AliasTable = field(default_factory=AliasTable)

    def add_module(self, module: nn.Module) -> None:
        needed: list[ShardedUnit] = []
        for p in module.parameters(recurse=False):
            u = self.by_param.get(id(p))
            if u is not None and not u.persistent and u not in needed:
                needed.append(u)
        if needed:
            self.by_module[id(module)] = needed

    def register_external(self, module: nn.Module, param: nn.Parameter) -> bool:
        """Make ``module``'s forward gather ``param``'s unit too. Returns False if already so."""
        u = self.by_param.get(id(param))
        if u is None or u.persistent:
            return False
        needed = self.by_module.setdefault(id(module), [])
        if u in needed:
            return False
        needed.append(u)
        return True


__all__ = ["UnitIndex"]
