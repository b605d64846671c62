"""The partitioned-parameter coordinator (stage 3): fetch, release, trace and prefetch.

Every module hook (see :mod:`zerodp.stage3.hooks`) calls :meth:`ParameterCoordinator.fetch` before the module
runs (forward or backward) and :meth:`ParameterCoordinator.release` after it. The first training
iteration records the order of fetches (forward then backward) as the *trace*; once every rank has
checked that it recorded the same trace (one small all-reduce), later iterations prefetch the units of
the next modules in the trace asynchronously, up to ``stage3_prefetch_bucket_size`` elements ahead and
never beyond ``stage3_max_live_parameters`` gathered elements, so all-gathers overlap compute. A unit
the trace uses again within ``stage3_max_reuse_distance`` elements is not released in between. A fetch
that does not match the trace (data-dependent control flow, a skipped module) invalidates it: no more
prefetch this iteration, and the next iteration records afresh. Collective order stays identical on all
ranks as long as every rank runs the same modules in the same order, which stage 3 requires (as in
DeepSpeed and FSDP).

With parameter offload, :attr:`ParameterCoordinator.read_ahead` (given by the engine at construction:
the parameter offload's, see :mod:`zerodp.offload.param_swap`) is called after each fetch with the units
of the rest of the trace, so reads of offloaded shards start modules ahead of their all-gathers.

Trace modes (DeepSpeed's ZeRoTraceMode): RECORD -> COMPLETE -> (mismatch) INVALID -> RECORD.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import zlib
from collections.abc import Callable
from typing import Protocol, cast

import torch
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp, Work

from zerodp.runtime import comm
from zerodp.runtime.coalesce import coalesced, dtype_device, runs_of_same_kind
from zerodp.runtime.comm import CommLedger
from zerodp.runtime.streams import SideStream
from zerodp.stage3.unit_index import UnitIndex
from zerodp.stage3.units import ShardedUnit, ShardState

#: the prefetch of one pass (forward or backward) over the sharded units goes in about this many
#: coalesced all-gathers (see [Note: coalesced prefetch])
PREFETCH_GROUPS_PER_PASS = 4
#: a pending prefetch group is launched at the latest this many modules before its first use, so at
#: least one module's compute (not a trivial one such as an embedding's backward) hides it
PREFETCH_LEAD_MODULES = 2


class FetchCheck(Protocol):
    """The collective guard's checks of stage-3 fetches (see
    :meth:`zerodp.runtime.collective_guard.CollectiveGuard.gather_check`)."""

    def __call__(self, module: nn.Module, on_trace: bool) -> None:
        """Before a fetch of ``module``; ``on_trace``: it is the next module of the agreed trace."""

    def before_launch(self) -> None:
        """Before any all-gather is launched (a fetch's own, a prefetch group, an external one)."""


def _launch_gather(u: ShardedUnit, pg: ProcessGroup | None, ledger: CommLedger) -> Work | None:
    """Issue ``u``'s all-gather; its Work (one launch of a coalesced group)."""
    u.launch_gather(pg, ledger, "parameters")
    return u.work


class _SharedWork:
    """One Work waited for by several units: the first :meth:`wait` waits and drops it."""

    __slots__ = ("work",)

    def __init__(self, work) -> None:
        self.work = work

    def wait(self, *args) -> bool:
        work, self.work = self.work, None
        if work is not None:
            work.wait(*args)
        return True


class TraceMode(enum.Enum):
    RECORD = "record"
    COMPLETE = "complete"
    INVALID = "invalid"


class ParameterCoordinator:
    """Gathers and releases stage-3 units around each module's forward and backward."""

    def __init__(
        self,
        index: UnitIndex,
        module_positions: dict[int, int],
        pg: ProcessGroup | None,
        ledger: CommLedger,
        prefetch_bucket_size: int,
        max_live_parameters: int,
        max_reuse_distance: int = 0,
        fetch_check: FetchCheck | None = None,
        read_ahead: Callable[[list[list[ShardedUnit]]], None] | None = None,
    ) -> None:
        self.index = index
        self.positions = module_positions  # id(module) -> position in named_modules() (rank-independent)
        self.pg = pg
        self.ledger = ledger
        self.prefetch_bucket_size = prefetch_bucket_size
        self.max_live = max_live_parameters
        self.max_reuse_distance = max_reuse_distance
        units = [u.numel for u in index.units if not u.persistent]
        #: a prefetch group is launched once it holds this many elements (see [Note: coalesced prefetch])
        self.min_prefetch_group = max(units + [-(-sum(units) // PREFETCH_GROUPS_PER_PASS)], default=0)
        self.reuse_hits = 0  # releases skipped because the trace uses the unit again soon
        self.mode = TraceMode.RECORD
        self.trace: list[nn.Module] = []
        self.cursor = 0
        self.active = False  # inside a training iteration (forward with grad, then backward)
        self.prefetches_issued = 0  # all-gathers launched ahead of use
        self.gather_collectives = 0  # collectives those gathers took (consecutive ones coalesced)
        self.prefetch_hits = 0  # fetches served by a prefetch already in flight or done
        self.trace_recordings = 0  # completed, cross-rank-checked recordings
        self.peak_live_elements = 0  # bookkeeping: elements of units not SHARDED (prefetch budget)
        self.peak_gathered_bytes = 0  # measured: bytes of live gathered storage (full + cast buffers)
        self.busy = False  # set while the coordinator itself touches parameters
        #: called with the module before each fetch of a module that has units (the collective guard's
        #: agreement, see :mod:`zerodp.runtime.collective_guard`); None: no check
        self.fetch_check = fetch_check
        #: offload_param: called after each fetch (recorded trace only) with the units of the modules
        #: still to come, in trace order, to read their shards ahead; None: no read-ahead
        self.read_ahead = read_ahead
        #: the all-gather stream (see [Note: comm streams] in :mod:`zerodp.runtime.streams`); None: the
        #: current stream
        self.stream: SideStream | None = None

    # ---- iteration boundaries -----------------------------------------------------------------------
    def begin_iteration(self) -> None:
        if self.active:  # the previous training forward had no backward: drop what it prefetched
            self.release_idle()
        if self.mode is not TraceMode.COMPLETE:
            self.mode = TraceMode.RECORD
            self.trace = []
        self.cursor = 0
        self.active = True

    def end_iteration(self) -> None:
        """After backward: validate a fresh recording across ranks, then release everything."""
        if self.active and self.mode is TraceMode.RECORD and self.trace:
            self._check_same_trace_on_all_ranks()
            self.mode = TraceMode.COMPLETE
            self.trace_recordings += 1
        elif self.active and self.mode is TraceMode.COMPLETE and self.cursor != len(self.trace):
            self.mode = TraceMode.INVALID  # this iteration ran fewer modules than recorded
        self.active = False
        self.release_all()

    def _check_same_trace_on_all_ranks(self) -> None:
        ids = [self.positions[id(m)] for m in self.trace]
        digest = zlib.crc32(str(ids).encode()) & 0x7FFFFFFF
        t = torch.tensor([len(ids), digest], dtype=torch.int64)
        lo, hi = t.clone(), t.clone()
        comm.all_reduce(lo, self.pg, self.ledger, "trace_check", op=ReduceOp.MIN)
        comm.all_reduce(hi, self.pg, self.ledger, "trace_check", op=ReduceOp.MAX)
        if not torch.equal(lo, hi):
            raise RuntimeError(
                "ZeRO stage 3: ranks ran different submodules or in a different order in this iteration "
                f"(this rank: {len(ids)} module fetches). Stage 3 requires every rank to run the same "
                "modules in the same order; make control flow independent of the rank's data."
            )

    # ---- fetch / release ---------------------------------------------------------------------------
    def fetch(self, module: nn.Module) -> None:
        """Make every unit ``module`` needs UNSHARDED (waiting for a prefetch if one is in flight)."""
        units = self.index.by_module.get(id(module))
        if not units:
            return
        if self.fetch_check is not None:  # on the agreed trace: the ranks' gathers follow it (see the guard)
            self.fetch_check(
                module,
                self.active
                and self.mode is TraceMode.COMPLETE
                and self.cursor < len(self.trace)
                and self.trace[self.cursor] is module,
            )
        if self.active:
            self._follow_trace(module)
        self.busy = True
        try:
            started = [u for u in units if u.state is ShardState.SHARDED]
            self._start_gathers(started)
            self.prefetch_hits += sum(1 for u in units if u.state is not ShardState.SHARDED and u.prefetched)
            grew = bool(started)  # gathered memory grows when a gather starts, or casts are re-filled
            for u in units:
                if u.state is ShardState.GATHERING:
                    u.finish_gather()
                    grew = grew or bool(u.casts)
                u.users += 1
                u.prefetched = False
            if grew:  # a prefetched unit's memory was noted when its gather started
                self._note_live()
            if self.active and self.mode is TraceMode.COMPLETE:
                self._read_ahead()  # first: reads of later shards proceed while the next ones gather
                self._prefetch()
        finally:
            self.busy = False

    def release(self, module: nn.Module, held: dict[int, int] | None = None) -> None:
        """``module`` is done with its units; those no other module holds are released. ``held``:
        storage key -> views of it the caller still holds, about to be dropped (see
        :meth:`ShardedUnit.release`)."""
        units = self.index.by_module.get(id(module))
        if not units:
            return
        self.busy = True
        try:
            for u in units:
                u.users -= 1
                if u.users <= 0 and not u.persistent and not self._reused_soon(u):
                    u.release(held)
        finally:
            self.busy = False

    def _reused_soon(self, unit: ShardedUnit) -> bool:
        """``stage3_max_reuse_distance``: the recorded trace fetches ``unit`` again before more than
        that many elements of other units are fetched (and keeping it stays within
        ``stage3_max_live_parameters``). It then stays gathered until that use, or the end of the
        iteration."""
        if self.max_reuse_distance <= 0 or not self.active or self.mode is not TraceMode.COMPLETE:
            return False
        if self.live_elements() > self.max_live:
            return False
        distance = 0
        for module in self.trace[self.cursor :]:
            units = self.index.by_module.get(id(module), ())
            if any(x is unit for x in units):
                self.reuse_hits += 1
                return True
            distance += sum(x.numel for x in units)
            if distance > self.max_reuse_distance:
                return False
        return False

    def fetch_external(self, module: nn.Module, param: nn.Parameter) -> None:
        """A parameter of another module was used inside ``module``'s forward: gather it now and from
        now on with ``module`` (as :func:`zerodp.zero.register_external_parameter` does)."""
        if self.index.register_external(module, param):
            u = self.index.by_param[id(param)]
            self.busy = True
            try:
                if u.state is ShardState.SHARDED:
                    if self.fetch_check is not None:
                        self.fetch_check.before_launch()
                    u.start_gather(self.pg, self.ledger, "parameters")
                if u.state is ShardState.GATHERING:
                    u.finish_gather()
                u.users += 1
                u.prefetched = False
                self._note_live()
            finally:
                self.busy = False

    def release_all(self) -> None:
        """Release every non-persistent unit (end of backward, end of an eval forward)."""
        self._release_where(lambda u: True)

    def release_idle(self) -> None:
        """Release units gathered but not in use by any module (e.g. prefetched, then unused)."""
        self._release_where(lambda u: u.users <= 0)

    def _release_where(self, pick) -> None:
        self.busy = True
        try:
            for u in self.index.units:
                if not u.persistent and pick(u):
                    u.release()
        finally:
            self.busy = False

    # ---- trace and prefetch ------------------------------------------------------------------------
    def _follow_trace(self, module: nn.Module) -> None:
        if self.mode is TraceMode.RECORD:
            self.trace.append(module)
        elif self.mode is TraceMode.COMPLETE:
            if self.cursor < len(self.trace) and self.trace[self.cursor] is module:
                self.cursor += 1
            else:
                self.mode = TraceMode.INVALID

    def _prefetch(self) -> None:
        """Gather released units of the modules ahead in the trace as one coalesced group.

        [Note: coalesced prefetch] The candidates are the SHARDED units of the next modules in trace
        order, up to ``stage3_prefetch_bucket_size`` elements and within ``stage3_max_live_parameters``.
        The group is launched only when it reaches ``min_prefetch_group`` elements (about
        1 / PREFETCH_GROUPS_PER_PASS of the sharded model), when it cannot grow any more (a bound
        stopped it), or when one of the next ``PREFETCH_LEAD_MODULES`` modules needs one of its units
        (the next module's own are then gathered in a collective of their own, so that module waits
        for them only); otherwise it waits for later fetches, where the units released
        in between join it. Launching whatever is SHARDED at every fetch would re-gather each unit
        right after its forward release, one all-gather per unit (22 per step on the bench's small
        GPT), for a use in backward; one group for all of them, launched just before the first
        backward use, would leave too little compute to hide it behind (the training thread then
        waits for it), so groups of about a quarter of the model are launched as they fill."""
        budget = self.prefetch_bucket_size
        live = self.live_elements()
        batch: list[ShardedUnit] = []
        full = False
        needed_next = 0  # how many of ``batch`` (its first ones) the next module in the trace uses
        needed_soon = False  # one of the next PREFETCH_LEAD_MODULES modules uses a unit of ``batch``
        for i, module in enumerate(self.trace[self.cursor : self.cursor + 64]):
            if budget <= 0:
                full = True
                break
            for u in self.index.by_module.get(id(module), ()):
                if u.state is not ShardState.SHARDED or any(x is u for x in batch):
                    continue
                if live + u.numel > self.max_live or u.numel > budget:
                    full = True
                    break
                batch.append(u)
                budget -= u.numel
                live += u.numel
                if i == 0:
                    needed_next += 1
                needed_soon = needed_soon or i < PREFETCH_LEAD_MODULES
            if full:
                break
        if not (full or needed_soon or sum(u.numel for u in batch) >= self.min_prefetch_group):
            return
        # the next module's units first, in their own collective: its fetch then waits for them only,
        # while the rest of the group is gathered during that module's compute
        self._start_gathers(batch[:needed_next], prefetch=True)
        self._start_gathers(batch[needed_next:], prefetch=True)
        for u in batch:
            u.prefetched = True
        self.prefetches_issued += len(batch)
        self._note_live()

    def _start_gathers(self, units: list[ShardedUnit], prefetch: bool = False) -> None:
        """SHARDED -> GATHERING for ``units``; consecutive units of one dtype share one coalesced
        all-gather (see :mod:`zerodp.runtime.coalesce`), issued on the all-gather stream (see [Note:
        comm streams]). A fetch on demand makes that stream wait for the compute stream first (the
        shards may just have been updated); a prefetch of the recorded trace waits only for the
        release events of the slabs it reuses (the iteration's first fetch, always on demand, waited
        for the optimizer step's writes), unless a shard was written back since."""
        if units and self.fetch_check is not None:
            self.fetch_check.before_launch()
        if not units:
            return
        for u in units:  # allocation on the compute stream, before any launch
            u.prepare_gather()
        stream = self.stream
        if stream is not None and (not prefetch or stream.stale):
            stream.after_compute()
        for run in runs_of_same_kind(units, lambda u: dtype_device(u.shard)):
            with stream.issuing() if stream is not None else contextlib.nullcontext():
                work = coalesced(self.pg, [functools.partial(_launch_gather, u, self.pg, self.ledger) for u in run])
            if len(run) > 1:
                # a group's own Work: waited through the agreements' watch too, and dropped by the first
                # unit that waits for it (a Work references the buffers it wrote: one kept alive by the
                # units still GATHERING would look like a view escaping, see [Note: escaping views])
                shared = _SharedWork(comm.watch(work, self.ledger, run[0].shard.device))
                for u in run:
                    u.work = cast(Work, shared)  # duck-typed: wait() is all a unit calls
            self.gather_collectives += 1

    def _read_ahead(self) -> None:
        if self.read_ahead is not None:
            upcoming = self.trace[self.cursor : self.cursor + 64]
            self.read_ahead([self.index.by_module.get(id(m), []) for m in upcoming])

    def live_elements(self) -> int:
        return sum(u.numel for u in self.index.units if u.state is not ShardState.SHARDED)

    def gathered_bytes(self) -> int:
        """Bytes of gathered parameter storage alive now, read from the storages themselves."""
        return sum(u.gathered_bytes() for u in self.index.units)

    def _note_live(self) -> None:
        """Update the peaks after a gather. Only units not SHARDED are read: a SHARDED unit's storages
        hold 0 bytes (its release emptied them; :meth:`gathered_bytes` reads every unit and the
        memory reports and tests rely on it), so the sum is the same at a fraction of the cost of
        reading every unit at every fetch."""
        live = [u for u in self.index.units if u.state is not ShardState.SHARDED]
        self.peak_live_elements = max(self.peak_live_elements, sum(u.numel for u in live))
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, sum(u.gathered_bytes() for u in live))
