"""Collectives used by the engine, each recorded in a :class:`CommLedger`.

These are thin wrappers over ``torch.distributed``'s own collectives (never a hand-written one); they
take their process group and buffers as arguments so they can be tested alone, and every call appends
``(op, elements, bytes)`` to the ledger the engine reports from.

Traffic convention (ZeRO paper, section 7): the volume of one collective is the number of elements of
the full (unpartitioned) tensor it operates on. A reduce-scatter or an all-gather of a Psi-element
buffer moves Psi elements per rank; an all-reduce moves 2 Psi (reduce-scatter + all-gather).
"""

from __future__ import annotations

import atexit
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp, Work

from zerodp.runtime import control

# torch >= 2.13 renamed the tensor-in/tensor-out collectives and the old names warn FutureWarning on every
# call; older releases only have the old names. The public names are for the rest of zerodp (control
# tensors, the DeepSpeed comm facade); the private ones carry the model traffic (zerodp bench patches them).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_torch_reduce_scatter_single = reduce_scatter_single
_all_gather_single = all_gather_single


class _SumOnWait:
    """The ``Work`` of an all-to-all whose received chunks still have to be summed: ``wait()`` waits
    for the exchange, then sums the rows of ``received`` (one per rank) into ``output``, once."""

    def __init__(self, work: Work, received: torch.Tensor, output: torch.Tensor) -> None:
        self.work, self._output = work, output
        self._received: torch.Tensor | None = received

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._received is not None:
            if timeout is None:
                self.work.wait()
            else:  # a slice's timeout raises here and leaves the sum to the next wait
                self.work.wait(timeout)
            received, self._received = self._received, None
            torch.sum(received.view(-1, self._output.numel()), dim=0, out=self._output)
        return True

    def __getattr__(self, name: str):
        return getattr(self.work, name)


class AllOf:
    """One ``Work`` standing for several: ``wait()`` waits for each in order (each at most once)."""

    def __init__(self, works: list[Work]) -> None:
        self.works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        while self.works:
            if timeout is None:
                self.works[0].wait()
            else:
                self.works[0].wait(timeout)
            self.works.pop(0)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def sums_by_all_to_all(tensor: torch.Tensor, group: ProcessGroup | None) -> bool:
    """Whether :func:`reduce_scatter` of ``tensor`` runs as an all-to-all and a local sum (host
    tensors on gloo; see [Note: gloo reduce-scatter]). Such calls cannot be coalesced by torch's
    ``_coalescing_manager``: launch them one by one (their ``Work``s together: :class:`AllOf`)."""
    return tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def _reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    received: torch.Tensor | None = None,
) -> Work | None:
    """torch's ``reduce_scatter_single``, except for a SUM of host tensors on gloo: there it is an
    all-to-all (rank r receives every rank's chunk r) followed by a local sum of the received chunks.

    [Note: gloo reduce-scatter] gloo's own reduce-scatter copies its input and costs more than its
    all-reduce of the same buffer, and the all-to-all plus the sum less than either, also for a
    coalesced group of stage-3 units (figures and command: docs/benchmarks/2026-12-01-bench.md,
    "Reduce-scatter on gloo"). Each rank sends and receives the (N-1)/N of the
    buffer that a reduce-scatter moves, so the traffic is the same. The received chunks are summed in rank order;
    with 2 ranks the result equals the reduce-scatter's bit for bit (a + b = b + a). The receive
    buffer (``received``, or a new tensor like ``input``) is held until the wait, as gloo's own copy of
    the input was; ``received`` is ignored on the other path.

    Raises:
        ValueError: ``input`` does not hold N x ``output.numel()`` elements (torch's reduce-scatter
            refuses it too; summing the received rows would give a wrong result silently), or
            ``received`` is not like ``input``.
    """
    if op != ReduceOp.SUM or not sums_by_all_to_all(input, group):
        return _torch_reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    world = dist.get_world_size(group)
    if input.numel() != world * output.numel():
        raise ValueError(
            f"reduce-scatter: input must hold {world} x output.numel() = "
            f"{world * output.numel()} elements, got {input.numel()}"
        )
    if output.dim() != 1:  # summed as one row: keep the caller's shape (a contiguous output, as torch's)
        output = output.view(-1)
    if received is None:
        received = torch.empty_like(input)
    elif received.shape != input.shape or received.dtype != input.dtype:
        raise ValueError(
            f"received must be like input ({tuple(input.shape)}, {input.dtype}), "
            f"got ({tuple(received.shape)}, {received.dtype})"
        )
    work = dist.all_to_all_single(received, input, group=group, async_op=True)
    summed = _SumOnWait(work, received, output)
    if async_op:
        return summed  # type: ignore[return-value]
    summed.wait()
    return None


#: how many "Psi-equivalents" of traffic each op counts per element of its full tensor.
TRAFFIC_FACTOR: dict[str, int] = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1}


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Initialise the default process group from torchrun's environment variables.

    Uses NCCL for CUDA tensors and gloo for host tensors when CUDA is available (``"cpu:gloo,cuda:nccl"``:
    the engine's flags, norms and guards, and offloaded partitions, are host tensors), gloo otherwise
    (``backend`` overrides). Does nothing when the default group is already initialised. ``timeout_s`` bounds how long a
    collective waits for the other ranks (torch's default when None). Without ``RANK``/``WORLD_SIZE`` in the environment
    (a plain ``python script.py``), initialises a world of one rank on a free local port.

    Raises:
        RuntimeError: torch.distributed is not available in this build.
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if dist.is_initialized():
        return
    if backend is None:
        # CUDA tensors on NCCL, host tensors (flags, norms, guards, offloaded partitions) on gloo
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    kwargs: dict = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if "RANK" not in os.environ:
        # a plain script: a world of one, without touching os.environ (a later torchrun-style check
        # of RANK in this process must not be fooled)
        kwargs.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, **kwargs)
    if settle_worker_threads not in _AT_EXIT:  # once per process: atexit runs before finalization
        atexit.register(settle_worker_threads)
        _AT_EXIT.append(settle_worker_threads)


#: what :func:`init_distributed` registered with atexit (once per process)
_AT_EXIT: list[Callable[[], None]] = []


def shutdown_distributed() -> None:
    """Barrier, then destroy the default process group (no-op when none is initialised).

    Call it at the end of a script instead of ``destroy_process_group()`` alone: the barrier makes every
    rank finish its collectives first, then zerodp drops its own references to the groups and lets
    gloo's worker threads finish (see [Note: gloo teardown abort]). Do not call it on an error path
    where other ranks may never arrive.
    """
    if not dist.is_initialized():
        return
    if SHUTDOWN_CHECK:  # the latest engine's collective guard: agree that every rank is shutting down
        SHUTDOWN_CHECK[-1]()
    dist.barrier()
    SHUTDOWN_CHECK.clear()
    dist.destroy_process_group()
    control.forget()
    settle_worker_threads()


# [Note: gloo teardown abort] Seen here as a rare "terminate called without an active exception"
# (SIGABRT) at exit, after every rank had finished (7 in 217 runs of tests/config_agreement_worker.py
# --case lr). A core dump showed the main thread in Py_FinalizeEx and a ProcessGroupGloo worker
# thread (runLoop) destroying a finished barrier work that still held the previous all_gather's
# tensors: their Python objects were owned by C++ by then (Python had dropped its references while
# the work was in flight), so the decref took the GIL, and a thread that takes the GIL during
# finalization exits through a forced unwind that std::terminate stops. torch knows the kind
# (destroy_process_group's comment on _wait_for_pending_works; pytorch/pytorch#179291). The worker
# only needs the GIL once more: releasing it for a moment after the last collective, before
# finalization starts, lets it finish (the same worker: 0 aborts in 150 runs with this, load 5-12).

#: seconds the main thread sleeps (GIL released) so gloo's worker threads can drop their last works
SETTLE_S = 0.05


def settle_worker_threads() -> None:
    """Release the GIL for :data:`SETTLE_S` so process-group worker threads drop their finished works
    while the interpreter is alive ([Note: gloo teardown abort]); also run at interpreter exit
    (registered by :func:`init_distributed`), before finalization, for scripts that never call
    :func:`shutdown_distributed`."""
    time.sleep(SETTLE_S)


#: set by :mod:`zerodp.runtime.collective_guard` (the latest engine's guard): run before the final
#: barrier so a rank shutting down while another is still in a collective engine call raises instead
#: of waiting for the process-group timeout.
SHUTDOWN_CHECK: list = []


class WatchedWork:
    """A ``Work`` whose ``wait()`` is the watch's bounded wait; everything else passes through.
    ``on_device``: the collective's tensors are on an accelerator (its ``wait()`` orders streams and
    does not block the host; see [Note: guard waits])."""

    def __init__(self, work: Work, wait: Callable[[Work, bool], None], on_device: bool = False) -> None:
        self.work, self._wait, self.on_device = work, wait, on_device

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._wait(self.work, self.on_device)
        return True

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def _watched(work: Work | None, async_op: bool, ledger: CommLedger, tensor: torch.Tensor | None = None) -> Work | None:
    """Route ``work`` through ``ledger``'s active watch (see :attr:`CommLedger.watch`); a synchronous
    call waits. ``tensor``: one of the collective's tensors (where it lives decides how it is waited for)."""
    if ledger.watch is None or work is None:
        return work
    watched = WatchedWork(work, ledger.watch, tensor is not None and tensor.device.type != "cpu")
    if async_op:
        return cast(Work, watched)  # duck-typed: wait() here, every other member via __getattr__
    watched.wait()
    return None


def watch(work: Work | None, ledger: CommLedger, device: torch.device | None = None) -> Work | None:
    """``work`` (issued outside this module, e.g. a coalesced group's, on ``device``: where its tensors
    are, the CPU when None) routed through ``ledger``'s active watch."""
    if ledger.watch is None or work is None:
        return work
    return cast(Work, WatchedWork(work, ledger.watch, device is not None and device.type != "cpu"))  # duck-typed


#: seconds between two looks at the agreements completed meanwhile, while a watched host wait goes on
POLL_S = 0.05
#: the first and the longest pause (seconds) between two ``is_completed()`` polls of a host wait
FIRST_PAUSE_S, MAX_PAUSE_S = 2e-5, 1e-3


def wait_polling(
    work: Work,
    timeout_s: float,
    what: str,
    on_failure: Callable[[BaseException], NoReturn],
    between: Callable[[], None],
    on_device: bool = False,
) -> None:
    """Wait for ``work`` without ever giving it a timeout, calling ``between()`` (the guard's
    agreements compare the tags completed meanwhile) every :data:`POLL_S` seconds.

    [Note: guard waits] A ``Work.wait(timeout)`` that times out on NCCL marks the work failed and
    aborts the communicator (torch's "... before timing out" message), so no wait here has a timeout:

    - host collectives (gloo, CPU tensors: the caller reads the result next): poll
      ``work.is_completed()`` (non-blocking), pausing from :data:`FIRST_PAUSE_S` doubling up to
      :data:`MAX_PAUSE_S`, with ``between()`` every :data:`POLL_S` seconds, then ``work.wait()`` (which
      returns at once, or raises the collective's own failure). Past ``timeout_s`` seconds, or on a
      failure, ``on_failure`` raises.
    - device collectives (``on_device``: NCCL): ``between()`` once (non-blocking), then ``work.wait()``,
      which makes the current stream wait for the collective and does not block the host; no host
      sync per collective. A rank whose peer diverged or is gone is not told by this wait, but by
      the tags: every collective in the guarded call has a tag on the guard's gloo group, and the
      call's end waits for all of them within ``timeout_s`` (mismatch, timeout and lost rank are
      decided from the agreed tags, never from local completion timing, which differs by rank).
    """
    if on_device:
        between()
        try:
            work.wait()
        except Exception as exc:  # a failure the backend already knows of
            on_failure(exc)
        return
    now = time.monotonic()
    deadline, look = now + timeout_s, now + POLL_S
    pause = FIRST_PAUSE_S
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            on_failure(TimeoutError(f"{what} collective timed out after {timeout_s:g} s"))
        if now >= look:
            between()
            look = time.monotonic() + POLL_S
        time.sleep(pause)
        pause = min(2 * pause, MAX_PAUSE_S)
    try:
        work.wait()  # completed: returns at once (an all-to-all's sum runs here) or raises its failure
    except Exception as exc:  # a lost peer, gloo's size check on a mis-paired collective
        on_failure(exc)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class CommRecord:
    """Totals of one collective kind since the ledger's last reset."""

    op: str
    count: int
    elements: int  # elements of the full tensors operated on (see module docstring)
    bytes: int  # bytes of the full tensors operated on
    purpose: str


@dataclass
class CommLedger:
    """Counts every collective the engine issues, per (op, purpose); passed with every collective, it
    also carries the engine's active watch.

    ``watch``: set by the engine's forward and backward agreements (:mod:`zerodp.runtime.forward_agreement`,
    :mod:`zerodp.runtime.backward_agreement`) while they run: a callable that waits for one ``Work``
    within a bounded time (checking the ranks' agreement while it waits). Every collective issued with
    this ledger then runs asynchronously and its ``wait()`` goes through that callable, so no rank waits
    for a collective that a diverged peer never issues until the process-group timeout. None: plain waits.
    """

    _totals: dict[tuple[str, str], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))
    steps: int = 0  # optimizer steps since the last reset
    watch: Callable[[Work, bool], None] | None = field(default=None, repr=False, compare=False)

    def record(self, op: str, tensor_numel: int, element_size: int, purpose: str) -> None:
        t = self._totals[(op, purpose)]
        t[0] += 1
        t[1] += tensor_numel
        t[2] += tensor_numel * element_size

    def reset(self) -> None:
        self._totals.clear()
        self.steps = 0

    def records(self) -> list[CommRecord]:
        return [
            CommRecord(op=op, count=c, elements=e, bytes=b, purpose=p)
            for (op, p), (c, e, b) in sorted(self._totals.items())
        ]

    def traffic_elements(self, purpose: str | None = None) -> int:
        """Psi-equivalent element traffic per rank (all-reduce counted twice), optionally one purpose."""
        return sum(
            TRAFFIC_FACTOR[op] * e for (op, p), (_, e, _) in self._totals.items() if purpose is None or p == purpose
        )


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    ledger: CommLedger,
    purpose: str,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    async_op: bool = False,
) -> Work | None:
    """In-place all-reduce of ``tensor`` (any shape) across ``group`` (a host tensor on an NCCL-only
    group: over its gloo side group, see [Note: control group])."""
    ledger.record("all_reduce", tensor.numel(), tensor.element_size(), purpose)
    group = control.route(tensor, group)
    return _watched(
        dist.all_reduce(tensor, op=op, group=group, async_op=async_op or ledger.watch is not None),
        async_op,
        ledger,
        tensor,
    )


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    ledger: CommLedger,
    purpose: str,
    async_op: bool = False,
    received: torch.Tensor | None = None,
) -> Work | None:
    """Sum ``input`` (1-D, N x ``output.numel()`` elements) across ranks; rank r gets chunk r in ``output``.
    ``received``: scratch like ``input`` for the all-to-all of host tensors on gloo (see
    [Note: gloo reduce-scatter]); unused otherwise."""
    kw = {} if received is None else {"received": received}
    group = control.route(input, group)
    work = _reduce_scatter_single(
        output, input, op=ReduceOp.SUM, group=group, async_op=async_op or ledger.watch is not None, **kw
    )
    ledger.record("reduce_scatter", input.numel(), input.element_size(), purpose)  # once launched
    return _watched(work, async_op, ledger, input)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    ledger: CommLedger,
    purpose: str,
    async_op: bool = False,
) -> Work | None:
    """Concatenate every rank's 1-D ``input`` into ``output`` (N x ``input.numel()``); may be in place."""
    ledger.record("all_gather", output.numel(), output.element_size(), purpose)
    group = control.route(output, group)
    return _watched(
        _all_gather_single(output, input, group=group, async_op=async_op or ledger.watch is not None),
        async_op,
        ledger,
        output,
    )


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None, ledger: CommLedger, purpose: str) -> None:
    """Overwrite ``tensor`` on every rank with global rank ``src``'s copy."""
    ledger.record("broadcast", tensor.numel(), tensor.element_size(), purpose)
    group = control.route(tensor, group)
    dist.broadcast(tensor, src=src, group=group)
