"""What ``zerodp bench`` measures on each rank, independently of the systems' own bookkeeping.

* :func:`live_storage_bytes`: model-state bytes by category, from the live storages of the tensors a
  system holds (``untyped_storage().data_ptr()``, each storage counted once), plus every other tensor
  storage Python's garbage collector can reach (``unattributed``).
* :class:`RssSampler`: peak resident set size of this process while a system runs, sampled from
  ``/proc/self/statm`` on a background thread (every ``interval_s`` seconds, default 2 ms).
* :class:`TrafficCounter`: elements sent through ``torch.distributed`` collectives while active, by
  patching the Python-level collective functions (DDP's C++ reducer is counted through a comm hook,
  :func:`counting_allreduce_hook`, which issues a Python ``all_reduce``).

Traffic is counted in Psi-equivalent elements per rank as in the ZeRO paper, section 7: an all-reduce
of n elements counts 2n (reduce-scatter + all-gather), an all-gather n (its output), a reduce-scatter n
(its input), a broadcast n.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

#: model-state categories, in the order of the ZeRO paper's figure 1 (plus buffers and the rest).
CATEGORIES = ("parameters", "gradients", "optimizer_states", "master_weights", "buffers")

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (FSDP2's sharded parameters), else ``t`` itself."""
    return getattr(t, "_local_tensor", t)


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        s = _local(t).untyped_storage()
        key = (s.data_ptr(), s.nbytes())
    except (RuntimeError, NotImplementedError):  # meta / fake tensors and storage-less wrapper subclasses
        return None  # (zerodp's param.grad placeholders, stage-3 partitioned values) hold no storage
    return None if key[0] == 0 or key[1] == 0 else key


def live_storage_bytes(
    sources: Mapping[str, Iterable[torch.Tensor | None]], baseline: frozenset[tuple[int, int]] = frozenset()
) -> dict[str, int]:
    """Bytes of live storage per category of ``sources``; a storage shared by two categories counts in
    the first one (order of ``sources``). ``unattributed`` adds every other storage reachable from a
    Python tensor object (:func:`gc.get_objects`) that is not in ``baseline`` (storages that existed
    before the system was built, e.g. the batches)."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, int] = {}
    for cat, tensors in sources.items():
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key is not None and key not in seen:
                seen.add(key)
                total += key[1]
        out[cat] = total
    other = 0
    for key in live_storages():
        if key not in seen and key not in baseline:
            seen.add(key)
            other += key[1]
    out["unattributed"] = other
    return out


def live_storages() -> set[tuple[int, int]]:
    """(data_ptr, nbytes) of every storage behind a tensor object Python's gc tracks."""
    gc.collect()
    keys: set[tuple[int, int]] = set()
    with warnings.catch_warnings():  # isinstance on some torch module proxies warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            if isinstance(obj, torch.Tensor):
                key = _storage_key(obj)
                if key is not None:
                    keys.add(key)
        except Exception:  # objects that fail isinstance (lazy modules, proxies)
            continue
    return keys


def current_rss() -> int:
    """Resident set size of this process in bytes (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def release_free_memory() -> None:
    """Collect garbage and return freed heap pages to the OS (glibc ``malloc_trim``), so that the RSS
    of the next system does not start from the previous one's high-water mark."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class RssSampler:
    """Context manager: ``peak`` is the highest RSS (bytes) seen while inside, ``start`` the RSS at
    entry. Samples every ``interval_s`` seconds on a daemon thread (torch releases the GIL in its
    kernels, so the thread samples during the work)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.start = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss())
            time.sleep(self.interval_s)

    def sample(self) -> None:
        """Take one sample now (call it at points known to be high, e.g. after backward)."""
        self.peak = max(self.peak, current_rss())

    def __enter__(self) -> RssSampler:
        self.start = self.peak = current_rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


#: Python-level collectives and how many Psi-equivalent elements one call moves: f(args, kwargs).
def _numel(t: Any) -> int:
    return _local(t).numel() if isinstance(t, torch.Tensor) else 0


def _list_numel(ts: Any) -> int:
    return sum(_numel(t) for t in ts) if isinstance(ts, (list, tuple)) else 0


_COLLECTIVES: dict[str, tuple[str, Callable[[tuple, dict], int]]] = {
    "all_reduce": ("all_reduce", lambda a, k: 2 * _numel(a[0] if a else k.get("tensor"))),
    "broadcast": ("broadcast", lambda a, k: _numel(a[0] if a else k.get("tensor"))),
    "all_gather_single": ("all_gather", lambda a, k: _numel(a[0] if a else k.get("output_tensor"))),
    "all_gather_into_tensor": ("all_gather", lambda a, k: _numel(a[0] if a else k.get("output_tensor"))),
    "_all_gather_base": ("all_gather", lambda a, k: _numel(a[0] if a else k.get("output_tensor"))),
    "all_gather": ("all_gather", lambda a, k: _list_numel(a[0] if a else k.get("tensor_list"))),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: _numel(a[1] if len(a) > 1 else k.get("input"))),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _numel(a[1] if len(a) > 1 else k.get("input"))),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, k: _numel(a[1] if len(a) > 1 else k.get("input"))),
    "reduce_scatter": ("reduce_scatter", lambda a, k: _list_numel(a[1] if len(a) > 1 else k.get("input_list"))),
    # each rank sends (N-1)/N of its input, as a reduce-scatter of that input does (zerodp's
    # reduce-scatter of host tensors on gloo is an all-to-all, see zerodp.runtime.comm)
    "all_to_all_single": ("all_to_all", lambda a, k: _numel(a[1] if len(a) > 1 else k.get("input"))),
}


class TrafficCounter:
    """Context manager counting collectives issued through ``torch.distributed``'s Python functions
    (and through aliases of them held by ``extra_targets``: ``(module, attribute)`` pairs such as
    ``zerodp.runtime.comm._all_gather_single``). Nested calls (one collective implemented by another)
    count once. ``elements`` is the Psi-equivalent element total, ``by_op`` per op name
    ``{op: [calls, elements]}``."""

    def __init__(self, extra_targets: Iterable[tuple[Any, str]] = ()) -> None:
        self.elements = 0
        self.by_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._depth = 0
        self._saved: list[tuple[Any, str, Any]] = []
        self._extra = list(extra_targets)

    def _wrap(self, fn: Callable[..., Any], op: str, count: Callable[[tuple, dict], int]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                n = count(args, kwargs)
                self.elements += n
                rec = self.by_op[op]
                rec[0] += 1
                rec[1] += n
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    def __enter__(self) -> TrafficCounter:
        originals: dict[int, tuple[str, Callable]] = {}
        for name, (op, count) in _COLLECTIVES.items():
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            originals[id(fn)] = (op, count)
            self._saved.append((dist, name, fn))
            setattr(dist, name, self._wrap(fn, op, count))
        for module, attr in self._extra:
            fn = getattr(module, attr, None)
            if fn is not None and id(fn) in originals:
                self._saved.append((module, attr, fn))
                setattr(module, attr, self._wrap(fn, *originals[id(fn)]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, attr, fn in reversed(self._saved):
            setattr(module, attr, fn)
        self._saved.clear()


def counting_allreduce_hook(state, bucket):  # DDP refuses string annotations
    """``(state: ProcessGroup | None, bucket: dist.GradBucket) -> Future[Tensor]``: DDP comm hook equal to DDP's default
    (all-reduce, then divide by the world size) issued through ``dist.all_reduce`` so that :class:`TrafficCounter` sees
    it."""
    group = state if state is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world))
