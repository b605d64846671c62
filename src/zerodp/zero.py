"""``zerodp.zero``: stage-3 utilities with DeepSpeed's names.

- :class:`GatheredParameters`: gather partitioned parameters outside forward (to read, initialise or
  edit them); with ``modifier_rank`` set, that rank's edits are broadcast and re-partitioned on exit.
- :func:`register_external_parameter`: declare that ``module``'s forward uses a parameter owned by
  another module, so it is gathered with ``module``. (Uses inside an engine forward are also detected
  automatically, see :class:`zerodp.stage3.hooks.ExternalParameterMode`.)
- :class:`Init`: partition each module's parameters as soon as its construction is over.
- :class:`TiledLinear`: a linear layer computed tile by tile, so at stage 3 only one tile is gathered
  at a time (memory-centric tiling, see :mod:`zerodp.tiling`).
- :func:`full_numel`, :func:`is_partitioned`: the real size and the state of a partitioned parameter.
- ``safe_get_full_grad`` / ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` /
  ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``: DeepSpeed's accessors, at every
  stage (see :mod:`zerodp.accessors`).
- :func:`synced_generate`: a generation loop whose ranks finish at different steps (or that only
  rank 0 needs) keeps every rank's forwards, hence stage-3 gathers, in step.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parameter import is_lazy

from zerodp.accessors import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from zerodp.config import ConfigError, load_config
from zerodp.offload.config import OffloadParamConfig
from zerodp.offload.param_home import HostShards
from zerodp.offload.param_swap import ParamSwapper
from zerodp.runtime import comm
from zerodp.runtime import device as devices
from zerodp.runtime.comm import CommLedger
from zerodp.runtime.device import pinning_available, resolve_device, resolve_pin_memory
from zerodp.stage3 import sharded_param
from zerodp.stage3.allocator import pin_mmap_threshold
from zerodp.stage3.gathered import GatheredParameters, number_init_parameter
from zerodp.stage3.init_writes import InitTouchMode
from zerodp.stage3.ownership import (
    Owner,
    add_pending_external,
    full_numel,
    is_partitioned,
    materialize,
    owner_of,
    set_owner,
)
from zerodp.stage3.synced import synced_generate
from zerodp.stage3.units import ShardedUnit, shard_unit
from zerodp.tiling import TiledLinear


def _refuse_rebound_shards(units: list[ShardedUnit]) -> None:
    """A partitioned parameter that holds memory once ``Init`` is done was re-bound while only its
    shard existed (``p.set_(t)`` bypasses torch's function hooks, so ``Init`` cannot see it): its values
    would be silently replaced by the shard's. Raises :class:`PartitionedParameterError` naming it."""
    from zerodp.stage3.sharded_param import PartitionedParameterError
    from zerodp.stage3.units import ShardState

    for u in units:
        if u.state is not ShardState.SHARDED:
            continue
        for s in u.slots:
            with torch._C.DisableTorchFunctionSubclass():
                held = s.param.untyped_storage().nbytes()
            if held:
                raise PartitionedParameterError(
                    f"parameter '{u._param_name(s)}' was re-bound with set_() after zerodp.zero.Init partitioned "
                    "it (its values would be lost): inside Init write values with `with torch.no_grad(): "
                    "p.copy_(t)` or `p.data = t`, which are kept"
                )


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Gather ``param`` (owned by another module) whenever ``module`` runs forward or backward.

    May be called anywhere DeepSpeed allows it: in a module's ``__init__`` (under :class:`Init` or not)
    or any time before or after :func:`zerodp.initialize`; a declaration made before a stage-3 engine
    owns ``param`` is applied when the engine adopts the model. At stages 0-2 every parameter is always
    full, so the declaration has nothing to do.

    Raises:
        TypeError: ``module`` is not a Module or ``param`` not a tensor.
    """
    if not isinstance(module, nn.Module) or not isinstance(param, torch.Tensor):
        raise TypeError(
            "register_external_parameter(module, param) takes an nn.Module and a parameter, got "
            f"{type(module).__name__} and {type(param).__name__}"
        )
    owner = owner_of(param)
    if owner is None or owner.coordinator is None:
        add_pending_external(module, param)
        return
    owner.coordinator.index.register_external(module, param)


class Init:
    """Partition parameters while the model is being built, so it never exists in full on one rank.

    Under ``with zerodp.zero.Init(config=ds_config):``, each module's own parameters (those larger than
    ``stage3_param_persistence_threshold``) are broadcast from rank 0 and partitioned as soon as that
    module's construction is over, which ``Init`` reads from torch's global parameter and module
    registration hooks (installed on ``__enter__``, removed on ``__exit__``; nothing is patched): a
    module that registered parameters is *pending* until another module registers a parameter while
    no ``__init__`` of the pending module is running any more (read from the call stack), it is
    assigned to a parent, or ``Init`` exits, whichever comes first. Its own initialisation in
    ``__init__`` (``reset_parameters``) has then run on the full tensors in their own dtype, and
    ``nn.Sequential(*layers)`` (every layer built before its parent exists), a free-standing
    ``nn.Linear`` and the root module's own parameters are partitioned too. Every rank keeps only its
    shard, and the parameter keeps its full shape, dtype and numel but holds no storage (see
    :mod:`zerodp.stage3.sharded_param`): shape-based code such as nanoGPT's ``p.dim() >= 2``
    weight-decay groups sees the same model as without ``Init``. With bf16/fp16 the partition is where
    the parameter is cast, once, as :func:`zerodp.initialize` casts a model built without ``Init``.
    Each partitioned parameter is moved to the engine's device first (config key ``device``:
    ``cuda:LOCAL_RANK`` on a CUDA machine with NCCL), so its shard is allocated there, unless the shard
    has a remote home (``remote_device``, else the config's ``offload_param.device``; DeepSpeed's
    ``zero.Init(remote_device=...)``): ``"nvme"`` writes each new shard to this rank's parameter swap
    file as soon as it is built and frees its memory (the engine adopts the file), ``"cpu"`` keeps it in
    host memory: on a CPU engine the shard is allocated there (page-locked when ``pin_memory`` and CUDA
    is available), on a device it is copied to a host home (:mod:`zerodp.offload.param_home`,
    page-locked when ``pin_memory``, unset: on CUDA) and its device memory freed at once. Only the module being built
    exists in full at any time, so peak memory is about one module's parameters, not the model's.

    Code that changes a module's weights after it was partitioned (HF's ``post_init()``,
    ``self.apply(init_fn)`` at the end of the root ``__init__``, ``nn.init.*`` on a child's weight)
    needs no change: while ``Init`` is active, the first torch call on a partitioned parameter gathers
    it (in the dtype it was built in), the call edits the full tensor as it would without ``Init``
    (same random draws), and the edit is cast and re-partitioned from rank 0's values later (see
    :mod:`zerodp.stage3.init_writes`). The weights are then bit-identical to those the constructor
    gives without ``Init`` followed by :func:`zerodp.initialize`.

    Args:
        config: the engine config (dict, JSON path or parsed); must be stage 3 when ``enabled``.
        enabled: False makes this a no-op (same code for every stage).
        process_group: data-parallel group (default: the whole world, initialised from torchrun's
            environment if needed).
        remote_device: where each shard lives once built: None or ``"none"`` (the config's
            ``offload_param.device``), ``"cpu"`` or ``"nvme"`` (needs the config's
            ``offload_param.nvme_path``); see :func:`resolve_remote_device`.
        pin_memory: page-lock host shards (``"cpu"``) and swap buffers (``"nvme"``) where CUDA is
            available; None takes the config's ``offload_param.pin_memory`` (unset: true when the
            engine's device is CUDA).

    Raises:
        ConfigError: invalid config, a stage other than 3 with ``enabled=True``, or a ``remote_device``
            that disagrees with the config's ``offload_param.device`` or lacks its ``nvme_path``.
        ValueError: ``remote_device`` is none of None, "none", "cpu", "nvme".
        DeviceError: (on enter) the config key ``device`` cannot be used here.
    """

    def __init__(
        self,
        config: object = None,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
        remote_device: str | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        self.config = load_config(config)  # type: ignore[arg-type]
        self.enabled = enabled
        if enabled and self.config.zero_optimization.stage != 3:
            raise ConfigError(
                "zerodp.zero.Init partitions parameters at construction, which needs "
                f"zero_optimization.stage 3 (got stage {self.config.zero_optimization.stage}); "
                "pass enabled=False for other stages"
            )
        #: where each shard goes as it is built (``offload_param`` with ``remote_device`` applied)
        self.remote = resolve_remote_device(self.config.zero_optimization.offload_param, remote_device, pin_memory)
        self.pg = process_group
        #: where each shard is allocated: the engine's device (config key ``device``), set on enter
        self.device = torch.device("cpu")
        self.ledger = CommLedger()
        self.units: list[ShardedUnit] = []
        self._handles: list = []
        self._touch: InitTouchMode | None = None
        self._touch_gathers = 0
        #: modules that registered parameters and are not partitioned yet (id -> weak reference)
        self._pending: dict[int, weakref.ref] = {}
        #: the units Init built for each module (a module registering parameters after its partition
        #: gets one unit holding all of them, as the engine lays it out)
        self._units_of: weakref.WeakKeyDictionary[nn.Module, list[ShardedUnit]] = weakref.WeakKeyDictionary()
        #: offload_param nvme: the swap file each new unit's shard is written to at once (the engine
        #: moves the shards into its own swap file when it adopts the units)
        self.swapper: ParamSwapper | None = None
        #: offload_param cpu with the engine on a device: the host homes of the shards (the engine adopts them)
        self.host_shards: HostShards | None = None

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        from torch.nn.modules.module import (
            register_module_module_registration_hook,
            register_module_parameter_registration_hook,
        )

        comm.init_distributed()
        self.device = resolve_device(self.config.device, self.pg)  # each shard is allocated there
        self.remote = po = self.remote.model_copy(
            update={"pin_memory": resolve_pin_memory(self.remote.pin_memory, self.device)}
        )
        if po.device == "cpu" and devices.is_accelerator(self.device) and self.host_shards is None:
            self.host_shards = HostShards(self.device, bool(po.pin_memory))  # the shards' host homes
        pin_mmap_threshold()  # each module's full values are freed once partitioned: return them
        if po.device == "nvme" and self.swapper is None:
            self.swapper = ParamSwapper(po, self.config.aio, dist.get_rank(self.pg), self.pg)
            self.swapper.open()
        self._touch = InitTouchMode(self.pg, self.config.zero_optimization.stage3_max_live_parameters)
        self._handles = [
            register_module_parameter_registration_hook(self._on_parameter),
            register_module_module_registration_hook(self._on_register),
        ]
        self._touch.__enter__()
        sharded_param.INIT_ACTIVE[0] += 1  # refusals under Init name what cannot be built here
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._touch is not None:
            sharded_param.INIT_ACTIVE[0] -= 1
            touch = self._touch
            try:
                if exc[0] is None:
                    self._seal_pending()  # free-standing modules and the root's own parameters
                    touch.flush_all()
                    _refuse_rebound_shards(self.units)
            finally:
                self._touch = None
                self._touch_gathers = touch.gathers  # units gathered because the constructor touched them
                touch.__exit__(None, None, None)
        self._pending.clear()

    def _on_parameter(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        """A parameter is registered on ``module``: the construction of every other pending module is
        over (partition them); ``module`` is pending until its own construction is."""
        if param is None or self._touch is None:
            return None
        number_init_parameter(param)  # orders GatheredParameters' broadcast of the persistent ones
        if self._touch.busy:
            return None
        self._seal_pending(keep=module)
        self._pending[id(module)] = weakref.ref(module)
        return None

    def _on_register(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is None or self._touch is None or self._touch.busy:
            return
        self._pending.pop(id(child), None)
        self._seal(child, name)

    def _seal_pending(self, keep: nn.Module | None = None) -> None:
        """Partition the pending modules but ``keep`` and those whose ``__init__`` is still running (a
        parent that registered a parameter and now builds a child); on exit (``keep`` None), all."""
        for key in [k for k in self._pending if keep is None or k != id(keep)]:
            module = self._pending[key]()
            if module is not None and keep is not None and _constructing(module):
                continue
            del self._pending[key]
            if module is not None:
                self._seal(module, type(module).__name__)

    def _seal(self, module: nn.Module, name: str) -> None:
        assert self._touch is not None
        self._touch.busy = True
        try:
            self._partition(module, name)
        finally:
            self._touch.busy = False

    def _partition(self, module: nn.Module, name: str) -> None:
        threshold = self.config.zero_optimization.stage3_param_persistence_threshold
        params = [p for _, p in module.named_parameters(recurse=False) if not is_lazy(p)]
        if not any(p.numel() > threshold and owner_of(p) is None for p in params):
            return
        before = self._units_of.get(module, [])
        if before:  # parameters registered after the module was partitioned: one unit for all of them
            self._undo_units(before, params)
        named = [
            (n, p)
            for n, p in module.named_parameters(recurse=False)
            if not is_lazy(p) and p.numel() > threshold and owner_of(p) is None
        ]
        rank = dist.get_rank(self.pg)
        world = dist.get_world_size(self.pg)
        src = dist.get_global_rank(self.pg, 0) if self.pg is not None else 0

        def sync(full: torch.Tensor) -> None:
            if world > 1:
                comm.broadcast(full, src, self.pg, self.ledger, "init")

        dtype = torch.bfloat16 if self.config.bf16.enabled else torch.float16 if self.config.fp16.enabled else None
        built = named[0][1].dtype
        for _, p in named:  # to the engine's device (a no-op on the CPU); the one cast, after the
            # module's own init (as initialize casts)
            cast = dtype if dtype is not None and p.is_floating_point() else p.dtype
            if p.device != self.device or cast != p.dtype:
                p.data = p.data.to(self.device, cast)
        # a host shard (CPU engine) is page-locked where asked and possible; a device shard's host home is
        pin = (
            self.remote.device == "cpu"
            and bool(self.remote.pin_memory)
            and self.host_shards is None
            and pinning_available()
        )
        unit = shard_unit(name, named, 0, [-1] * len(named), rank, world, sync=sync, pin_memory=pin)
        if built.is_floating_point and built != unit.shard.dtype:
            assert self._touch is not None  # entered: set in __enter__
            self._touch.built_dtype[id(unit)] = built  # touched later: gathered in this dtype
        if self.swapper is not None:  # offload_param nvme: straight to the swap file
            unit.home = self.swapper.add(name, unit.shard)
        elif self.host_shards is not None:  # offload_param cpu, the engine on a device: to host memory
            unit.home = self.host_shards.add(name, unit.shard)
        self.units.append(unit)
        self._units_of[module] = [unit]
        for s in unit.slots:
            set_owner(s.param, Owner(unit, self.pg, self.ledger, None), module)
        self._partitioned(unit)

    def _undo_units(self, before: list[ShardedUnit], params: list[nn.Parameter]) -> None:
        """Parameters were registered on a module after it was partitioned into ``before``: bring its
        partitioned ``params`` back in full, in the dtype they were built in (exact; cast once when
        partitioned again), out of Init's homes, and drop ``before`` from :attr:`units`."""
        mine = {id(s.param) for u in before for s in u.slots}
        again = [p for p in params if id(p) in mine]
        assert self._touch is not None  # entered: set in __enter__
        widen = [self._touch.forget(u) for u in before]
        for u in before:
            if u.home is not None:
                u.home.swapper.forget(u.home)  # type: ignore[attr-defined]  # Init's homes are param_swap's
                u.home = None
        materialize(again)
        built_as = next((d for d in widen if d is not None), None)
        for p in again:  # back to the dtype they were built in (exact), cast once below
            if built_as is not None and p.is_floating_point():
                p.data = p.data.to(built_as)
        self.units[:] = [u for u in self.units if all(u is not b for b in before)]

    def _partitioned(self, unit: ShardedUnit) -> None:
        """Called once per unit Init builds (subclasses add attributes to its parameters)."""


#: the values of ``zero.Init(remote_device=...)`` (None: the config's ``offload_param.device``)
REMOTE_DEVICES = ("none", "cpu", "nvme")


def resolve_remote_device(
    po: OffloadParamConfig, remote_device: str | None, pin_memory: bool | None
) -> OffloadParamConfig:
    """The ``offload_param`` section :class:`Init` builds with: the config's, with ``remote_device``
    (None or "none": the config's device, as DeepSpeed reads an unset one) and ``pin_memory`` (None:
    the config's) applied. A ``str`` enum (DeepSpeed's ``OffloadDeviceEnum``) is read by its value.

    Raises:
        ValueError: ``remote_device`` is not one of :data:`REMOTE_DEVICES` or None (names them).
        ConfigError: ``remote_device`` "cpu"/"nvme" while the config's ``offload_param.device`` is the
            other one (the engine would keep the shards elsewhere), or "nvme" without
            ``offload_param.nvme_path`` in the config.
    """
    remote = getattr(remote_device, "value", remote_device)
    if remote is not None and remote not in REMOTE_DEVICES:
        raise ValueError(
            f"zero.Init(remote_device={remote_device!r}): allowed values are None, "
            f"{', '.join(repr(d) for d in REMOTE_DEVICES)}"
        )
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise ValueError(f"zero.Init(pin_memory={pin_memory!r}): must be True, False or None")
    device = po.device if remote in (None, "none") else remote
    if device != po.device and po.device != "none":
        raise ConfigError(
            f"zero.Init(remote_device={remote!r}) disagrees with the config's "
            f"zero_optimization.offload_param.device {po.device!r}; give one of them, or the same"
        )
    if device == "nvme" and not po.nvme_path:
        raise ConfigError(
            "zero.Init(remote_device='nvme') needs zero_optimization.offload_param.nvme_path in the "
            "config (the directory of the parameter swap file)"
        )
    return po.model_copy(update={"device": device, "pin_memory": po.pin_memory if pin_memory is None else pin_memory})


def _constructing(module: nn.Module) -> bool:
    """Whether an ``__init__`` of ``module`` is on the call stack (its construction is not over)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False


__all__ = [
    "GatheredParameters",
    "Init",
    "REMOTE_DEVICES",
    "resolve_remote_device",
    "TiledLinear",
    "register_external_parameter",
    "full_numel",
    "is_partitioned",
    "safe_get_full_grad",
    "safe_get_full_fp32_param",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "synced_generate",
]
