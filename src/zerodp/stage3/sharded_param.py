"""The type of a stage-3 parameter while its unit is SHARDED: full metadata, no storage, no compute.

[Note: sharded parameters] While its unit (see :mod:`zerodp.stage3.units`) is SHARDED, a partitioned
parameter keeps its full ``shape``, ``dtype``, ``device``, ``numel()`` and ``stride()``, as FSDP2's
DTensor parameters do: its ``.data`` stays a view of the unit's full flat buffer, whose storage then
holds 0 bytes, and its class is :class:`ShardedParameter` (a subclass of its own class, swapped in by
:func:`mark_sharded` and out by :func:`mark_unsharded`, i.e. only by the unit's state transitions).
Shape-based code therefore sees the same model with and without stage 3 / ``zerodp.zero.Init``
(nanoGPT's ``[p for p in params if p.dim() >= 2]`` weight-decay groups, ``sum(p.numel() ...)``).

A sharded parameter holds no values, so everything but metadata is refused *before* it runs (a torch
kernel on storage-less data would crash or read garbage): :meth:`ShardedParameter.__torch_function__`
lets through the metadata in :data:`METADATA` (shape, dtype, device, numel, stride, ``requires_grad``,
``grad``, hook registration, ...) and raises :class:`PartitionedParameterError`, naming the parameter
and what to do instead, for any compute, copy, view, in-place edit or ``p.data = ...`` re-binding.
``p.data`` and ``p.detach()`` return a :class:`ShardedData`: a storage-less tensor with the same
metadata whose every operation raises the same error, so ``p.data.mul_(2)`` outside
``GatheredParameters`` raises instead of silently editing nothing. A gathered parameter (in its
module's forward/backward, inside ``GatheredParameters``, a persistent one) is of its own class again
and costs nothing extra.

Pickling a sharded parameter or its state-dict value (``torch.save(module.state_dict())``) does what the
parameter's save policy says (:data:`SAVE_ATTR`, set once, when the parameter is partitioned): zerodp's
own API refuses (:class:`RefuseSave`); ``zerodp.deepspeed`` writes DeepSpeed's placeholders
(:mod:`zerodp.stage3.placeholder`). safetensors reads a tensor's memory at ``data_ptr()`` without a torch
op: a sharded parameter refuses ``data_ptr()``/``untyped_storage()`` when safetensors asks
(:data:`_RAW_READERS`), and answers them (0 bytes) for zerodp's and torch's own use.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerodp.runtime.refusal import RefusedError

#: attribute holding the qualified name of a sharded parameter (for messages)
NAME_ATTR = "_zerodp_name"
#: attribute holding the class a parameter had before it was first sharded
CLASS_ATTR = "_zerodp_unsharded_class"
#: attribute holding a partitioned parameter's save policy (what pickling it while sharded does;
#: :data:`REFUSE_SAVE` where unset); a :class:`ShardedData` of it carries the same policy
SAVE_ATTR = "_zerodp_save"


class PartitionedParameterError(RefusedError):
    """An operation needing the values of a stage-3 parameter while only its shard exists."""


def _message(name: str, what: str) -> str:
    return (
        f"parameter '{name}' is partitioned (ZeRO stage 3): outside its module's forward/backward "
        f"each rank holds only a shard of it, so {what} cannot run on it. Read or edit it inside "
        "`with zerodp.zero.GatheredParameters([param], modifier_rank=0):` (modifier_rank keeps "
        "in-place edits; None discards them), or use the collective accessors "
        "zerodp.zero.safe_get_full_fp32_param(param) / safe_set_full_fp32_param(param, value)"
    )


def _func_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)
    owner = getattr(getattr(func, "__self__", None), "__name__", None)  # a property's __get__/__set__
    if name in ("__get__", "__set__", "__delete__") and owner:
        return {"__get__": "reading", "__set__": "re-binding", "__delete__": "deleting"}[name] + f" '.{owner}'"
    return f"'{name}'"


#: Tensor properties that read metadata only
_METADATA_GETTERS = (
    "shape",
    "dtype",
    "device",
    "ndim",
    "layout",
    "names",
    "is_leaf",
    "grad_fn",
    "_version",
    "is_cuda",
    "is_cpu",
    "is_meta",
    "is_sparse",
    "is_quantized",
    "is_mkldnn",
    "is_nested",
    "is_mps",
    "is_xpu",
    "itemsize",
    "nbytes",
    "output_nr",
    "_base",
    "retains_grad",
    "name",
    "_is_view",
)
#: Tensor properties that read or set metadata only
_METADATA_SETTABLE = ("requires_grad", "grad", "_grad", "_backward_hooks", "_post_accumulate_grad_hooks")
#: Tensor methods that read or set metadata only
_METADATA_METHODS = (
    "size",
    "dim",
    "numel",
    "nelement",
    "stride",
    "is_contiguous",
    "element_size",
    "is_floating_point",
    "is_complex",
    "is_signed",
    "storage_offset",
    "get_device",
    "requires_grad_",
    "register_hook",
    "register_post_accumulate_grad_hook",
    "retain_grad",
    "__hash__",
    "__len__",
    "__dir__",
    "_is_view",
    "untyped_storage",
    "data_ptr",
    "is_shared",
)


def _metadata() -> frozenset:
    """The Tensor functions that read or set metadata only (never the values): the accessors of
    :data:`_METADATA_GETTERS` and :data:`_METADATA_SETTABLE`, and :data:`_METADATA_METHODS`."""
    T = torch.Tensor
    out: set = set()
    for n in _METADATA_GETTERS + _METADATA_SETTABLE:
        d = getattr(T, n, None)
        if d is None:
            continue
        for m in ("__get__",) + (("__set__", "__delete__") if n in _METADATA_SETTABLE else ()):
            f = getattr(d, m, None)
            if f is not None:
                out.add(f)
    out.update(getattr(T, n) for n in _METADATA_METHODS if hasattr(T, n))
    return frozenset(out)


METADATA = _metadata()
#: what reads a tensor's memory without computing on it (safetensors, numpy, DLPack, storage sharing)
_MEMORY_ACCESS = frozenset({torch.Tensor.untyped_storage, torch.Tensor.data_ptr, torch.Tensor.is_shared})
#: the metadata a :class:`ShardedData` (a state-dict value at stage 3) answers; anything else raises
_DATA_METADATA = METADATA - _MEMORY_ACCESS
#: libraries that serialise a tensor by reading its memory at ``data_ptr()`` (no torch op): a partitioned
#: *parameter* handed to them (``save_file(dict(model.named_parameters()))``, ``state_dict(keep_vars=True)``)
#: is refused there with :data:`SAVE_HINT`; zerodp and torch read these pointers of parameters themselves
_RAW_READERS = ("safetensors",)


def _read_by_raw_reader() -> bool:
    """Whether the code that called the refused or memory-reading Tensor function (the first frame above
    this one outside ``torch``: ``Tensor.storage`` goes through torch's Python dispatch) is one of
    :data:`_RAW_READERS`."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        module = frame.f_globals.get("__name__", "")
        if module != "torch" and not module.startswith("torch."):
            return module.split(".")[0] in _RAW_READERS
        frame = frame.f_back  # type: ignore[assignment]
    return False


#: how to save a stage-3 model instead (every refusal of a state-dict value names these)
SAVE_HINT = (
    "; to save the model at stage 3 use engine.save_16bit_model(save_dir) (gathers the full "
    "weights once, in the module's dtype; needs zero_optimization.stage3_gather_16bit_weights_on_model_save), "
    "engine.module_state_dict() (full fp32 values, collective), zerodp.zero.GatheredParameters "
    "around module.state_dict(), or `zerodp consolidate CHECKPOINT_DIR OUT` on a checkpoint "
    "written by engine.save_checkpoint"
)


#: number of active ``zerodp.zero.Init`` contexts (set by :class:`zerodp.zero.Init`): refusals under
#: Init name the construct that cannot be built there instead of advising GatheredParameters
INIT_ACTIVE = [0]
#: the code of ``nn.Parameter.__new__``: ``nn.Parameter(p)`` on a partitioned parameter detaches it
_PARAMETER_NEW = nn.Parameter.__new__.__code__


def _deepcopy_error(name: str, hint: str = "") -> PartitionedParameterError:
    """The refusal of ``copy.deepcopy`` of partitioned parameter ``name``; under ``zero.Init`` it names
    the modules that deep-copy a built layer and what to build instead."""
    if not INIT_ACTIVE[0]:
        return PartitionedParameterError(_message(name, "copy.deepcopy") + hint)
    return PartitionedParameterError(
        f"copy.deepcopy of parameter '{name}' under zerodp.zero.Init: Init has already partitioned it "
        "(each rank holds only a shard), so a copy would have no values. Modules that deep-copy a built "
        "layer cannot be built under zero.Init: nn.TransformerEncoder / nn.TransformerDecoder (they copy "
        "the encoder_layer / decoder_layer given), copy.deepcopy(module) of a module built there. Build that "
        "module outside `with zerodp.zero.Init(...)` (zerodp.initialize partitions it at stage 3), or "
        "build each copy separately, e.g. nn.ModuleList([nn.TransformerEncoderLayer(...) for _ in range(n)])"
    )


def _parameter_from_sharded_error(name: str) -> PartitionedParameterError:
    """The refusal of ``nn.Parameter(p)`` on partitioned parameter ``name`` (what a torch
    parametrization whose ``right_inverse`` returns the weight itself, such as ``weight_norm``, does)."""
    where = "under zerodp.zero.Init" if INIT_ACTIVE[0] else "at ZeRO stage 3"
    return PartitionedParameterError(
        f"nn.Parameter(...) of parameter '{name}' {where}: it is partitioned (each rank holds only a shard), "
        "so no new parameter can be made from its values. Torch parametrizations that register the weight "
        "as a new parameter (nn.utils.parametrizations.weight_norm, register_parametrization with several "
        "originals) cannot register on a partitioned parameter: build that module outside "
        "`with zerodp.zero.Init(...)` with its parametrization and let zerodp.initialize partition it at "
        "stage 3 (it trains there), or use a parametrization that keeps one original "
        "(parametrizations.orthogonal, spectral_norm), which works under Init"
    )


def refuse_parameter_from_sharded(func: Callable, args: tuple) -> None:
    """Raise :func:`_parameter_from_sharded_error` when ``func(*args)`` is ``nn.Parameter.__new__``
    detaching a partitioned parameter (called by :class:`ShardedParameter` and by ``zero.Init``'s
    torch-function mode, which sees the call first)."""
    if func == _DETACH and args and isinstance(args[0], ShardedParameter) and _called_by_parameter_new():
        raise _parameter_from_sharded_error(_name(args[0]))


def _called_by_parameter_new() -> bool:
    """Whether a caller a few frames up is ``nn.Parameter.__new__`` (it detaches its ``data``)."""
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return False
        if frame.f_code is _PARAMETER_NEW:
            return True
    return False


class SavePolicy:
    """What pickling a sharded parameter or its state-dict value does (a parameter's :data:`SAVE_ATTR`)."""

    def reduce(self, tensor: torch.Tensor, name: str, what: str) -> Any:
        """``tensor.__reduce_ex__`` for the partitioned parameter ``name``; ``what`` names the use."""
        raise NotImplementedError


class RefuseSave(SavePolicy):
    """zerodp's own API: pickling raises :class:`PartitionedParameterError` naming the parameter and
    :data:`SAVE_HINT`, since a file without its values would be a silently unusable checkpoint
    (``zerodp.deepspeed`` sets :class:`zerodp.stage3.placeholder.PlaceholderSave`, DeepSpeed's way)."""

    def reduce(self, tensor: torch.Tensor, name: str, what: str) -> Any:
        raise PartitionedParameterError(_message(name, what) + SAVE_HINT)


REFUSE_SAVE = RefuseSave()
_DATA_GET = torch.Tensor.data.__get__  # type: ignore[attr-defined]  # a C property; its stub types it as a Tensor
_DATA_SET = torch.Tensor.data.__set__  # type: ignore[attr-defined]  # idem
_DETACH = torch.Tensor.detach
#: conversions that return the tensor itself when they change nothing (``module.to(device)`` on a
#: module already there, ``module.float()`` on an fp32 one): a partitioned parameter allows those
_DTYPE_OF = {
    torch.Tensor.float: torch.float32,
    torch.Tensor.double: torch.float64,
    torch.Tensor.half: torch.float16,
    torch.Tensor.bfloat16: torch.bfloat16,
}


def _noop_conversion(p: torch.Tensor, func: Any, args: tuple, kwargs: dict) -> bool:
    """``func(p, *args, **kwargs)`` is one of the conversions above and would return ``p`` itself."""
    if func in _DTYPE_OF:
        return not args and not kwargs.get("memory_format") and p.dtype == _DTYPE_OF[func]
    if func == torch.Tensor.cpu:
        return not args and not kwargs.get("memory_format") and p.device.type == "cpu"
    if func == torch.Tensor.to:
        if kwargs.get("copy") or (len(args) > 2 and args[-1] is True):
            return False
        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except (TypeError, RuntimeError):
            return False
        return (
            (device is None or torch.device(device) == p.device)
            and (dtype is None or dtype == p.dtype)
            and memory_format in (None, torch.preserve_format)
        )
    return False


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``deepspeed.runtime.zero.partition_parameters.ZeroParamStatus`` (same values): what
    ``param.ds_status`` says of a stage-3 parameter (see :attr:`ShardedParameter.ds_status`)."""

    AVAILABLE = 1  # gathered: the full values are here
    NOT_AVAILABLE = 2  # only this rank's shard exists
    INFLIGHT = 3  # being gathered (zerodp reports NOT_AVAILABLE until the gather is finished)


class ShardedParameter(nn.Parameter):
    """A partitioned parameter while only its shard exists (see the module docstring).

    Never constructed directly: :func:`mark_sharded` sets a parameter's class to this (or to a subclass
    of this and the parameter's own ``nn.Parameter`` subclass).
    """

    @property
    def ds_status(self) -> ZeroParamStatus:
        """DeepSpeed's ``param.ds_status`` while only the shard exists. A gathered parameter is of its
        own class again and reads ``AVAILABLE`` (set by ``zerodp.deepspeed``, which gives partitioned
        parameters DeepSpeed's ``ds_*`` attributes)."""
        return ZeroParamStatus.NOT_AVAILABLE

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in METADATA and func not in _MEMORY_ACCESS:
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs)
        if func in _MEMORY_ACCESS:  # a raw reader would serialise 0 bytes or fail inside itself
            if not _read_by_raw_reader():
                return torch._C._disabled_torch_function_impl(func, types, args, kwargs)
            raise PartitionedParameterError(
                _message(_name(args[0]), f"{_func_name(func)} (reading its memory)") + SAVE_HINT
            )
        if (func == _DATA_GET or func == _DETACH) and args and isinstance(args[0], ShardedParameter):
            refuse_parameter_from_sharded(func, args)
            return ShardedData.of(args[0])
        if args and isinstance(args[0], ShardedParameter) and _noop_conversion(args[0], func, args[1:], kwargs):
            return args[0]  # module.to(device)/.float()/.cpu() that changes nothing
        if func == _DATA_SET and len(args) == 2 and args[0] is args[1]:
            return None  # module._apply's ``param.data = param`` after such a conversion
        if func is torch._has_compatible_shallow_copy_type:  # module._apply's check: tensor types only
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs)
        sharded = next((a for a in _flat(args, kwargs) if isinstance(a, ShardedParameter)), None)
        hint = SAVE_HINT if _read_by_raw_reader() else ""  # safetensors' fallback to Tensor.storage()
        raise PartitionedParameterError(_message(_name(sharded), _func_name(func)) + hint)

    def __repr__(self) -> str:  # type: ignore[override]  # Tensor.__repr__ takes a keyword tensor_contents
        return (
            f"ShardedParameter('{_name(self)}', shape={tuple(self.shape)}, dtype={self.dtype}, "
            "partitioned: gather it with zerodp.zero.GatheredParameters to read its values)"
        )

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __reduce_ex__(self, proto: Any) -> Any:
        return getattr(self, SAVE_ATTR, REFUSE_SAVE).reduce(self, _name(self), "pickling/saving (torch.save)")

    def __deepcopy__(self, memo: dict) -> Any:
        raise _deepcopy_error(_name(self))


class ShardedData(torch.Tensor):
    """``p.data`` / ``p.detach()`` of a :class:`ShardedParameter` (so also each parameter's value in
    ``module.state_dict()`` at stage 3): the same shape, dtype, device and strides, no storage. Its
    metadata reads work; every other use, including what reads memory without computing
    (``untyped_storage()``, ``data_ptr()``, ``numpy()``, ``storage()``, DLPack: safetensors'
    ``save_file``, ``torch.save``, ``copy.deepcopy``), raises :class:`PartitionedParameterError` naming
    the parameter and how to save the model instead (:data:`SAVE_HINT`)."""

    _zerodp_name: str
    _zerodp_save: SavePolicy  # the parameter's (SAVE_ATTR)

    @staticmethod
    def __new__(cls, name: str, like: torch.Tensor, save: SavePolicy = REFUSE_SAVE) -> ShardedData:
        with torch._C.DisableTorchFunctionSubclass():
            shape, stride, dtype, device = like.shape, like.stride(), like.dtype, like.device
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, dtype=dtype, device=device, requires_grad=False
        )
        t._zerodp_name = name
        t._zerodp_save = save
        return t

    @classmethod
    def of(cls, param: ShardedParameter) -> ShardedData:
        return cls(_name(param), param, getattr(param, SAVE_ATTR, REFUSE_SAVE))

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: Any = None):
        if func in _DATA_METADATA or func == _DETACH or func == _DATA_GET:
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})
        name = next((a._zerodp_name for a in _flat(args, kwargs or {}) if isinstance(a, ShardedData)), "?")
        raise PartitionedParameterError(
            _message(name, f"{_func_name(func)} (on its .data or state-dict value)") + SAVE_HINT
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None):  # type: ignore[override]  # torch's stub is an instance method
        src = args[0] if args else None
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) and isinstance(src, ShardedData):
            return ShardedData(src._zerodp_name, src, src._zerodp_save)
        name = next((a._zerodp_name for a in _flat(args, kwargs or {}) if isinstance(a, ShardedData)), "?")
        raise PartitionedParameterError(_message(name, f"'{func}' (on its .data)") + SAVE_HINT)

    def __reduce_ex__(self, proto: Any) -> Any:  # torch.save of model.state_dict() at stage 3
        return self._zerodp_save.reduce(self, self._zerodp_name, "pickling/saving (torch.save)")

    def __deepcopy__(self, memo: dict) -> Any:
        raise _deepcopy_error(self._zerodp_name, SAVE_HINT)

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"ShardedData('{self._zerodp_name}', shape={tuple(self.shape)}, dtype={self.dtype}, "
            "partitioned: no values on this rank)"
        )


def _name(p: torch.Tensor | None) -> str:
    return getattr(p, NAME_ATTR, "?") if p is not None else "?"


def _flat(args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


_SHARDED_CLASSES: dict[type, type] = {nn.Parameter: ShardedParameter}


def _sharded_class(cls: type) -> type:
    """ShardedParameter for ``nn.Parameter``; for a subclass of it, a cached subclass of both."""
    out = _SHARDED_CLASSES.get(cls)
    if out is None:
        out = type(f"Sharded{cls.__name__}", (ShardedParameter, cls), {})
        _SHARDED_CLASSES[cls] = out
    return out


def mark_sharded(param: nn.Parameter, name: str) -> None:
    """Make ``param`` (whose ``.data`` holds no storage now) a :class:`ShardedParameter` named ``name``."""
    if not isinstance(param, ShardedParameter):
        setattr(param, CLASS_ATTR, type(param))
        param.__class__ = _sharded_class(type(param))
    setattr(param, NAME_ATTR, name)


def mark_unsharded(param: nn.Parameter) -> None:
    """Give ``param`` its own class back (call before its ``.data`` is pointed at gathered values)."""
    if isinstance(param, ShardedParameter):
        own: type = getattr(param, CLASS_ATTR, nn.Parameter)
        param.__class__ = own


def is_sharded(param: torch.Tensor) -> bool:
    """True while ``param`` is a partitioned parameter whose unit is not gathered (no values here)."""
    return isinstance(param, ShardedParameter)
