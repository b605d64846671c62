"""Collective safety: every rank must be in the same engine call before a collective is issued.

The guard owns one extra gloo process group (``dist.new_group``, with the guard's own short timeout)
and one *agreement* per engine entry point that issues collectives (``forward`` at stage 3,
``backward``, ``step`` at a gradient accumulation boundary, ``save_checkpoint``, ``load_checkpoint``,
``module_state_dict``, ``shutdown_distributed``) and, at stage 3, per module fetch in a forward
(``gather(<module name>)``); once the stage-3 module trace is recorded and agreed, a training
forward's fetches are agreed by asynchronous tags instead, compared in batches and at the latest
before the forward returns (:mod:`zerodp.runtime.forward_agreement`). The collectives inside backward
(stage-3 backward fetches, gradient bucket reductions) are not agreed synchronously one by one (that
would double the cost): each posts an asynchronous tag on the same gloo group, checked while waiting
and before backward returns
(:mod:`zerodp.runtime.backward_agreement`). An agreement is one all-gather of five int64 per rank:
``(call code, hash of the call's detail, optimizer step, micro-step, aux)``; ``aux`` is exchanged, not
compared (``backward`` puts the digest of the parameters its graph reaches there, and the digest of its
stage-3 fetches into the detail; see :mod:`zerodp.runtime.backward_roots`).

- All equal: the call proceeds; the real collectives pair up because every rank is in the same call.
- Different (e.g. rank 0 in ``save_checkpoint``, rank 1 in ``backward``): every rank received the same
  table, so every rank raises :class:`CollectiveMismatchError` together, naming each rank's call and
  step; the job's real collectives never started, so nothing hangs.
- A rank does not arrive within ``timeout_s`` (stuck outside zerodp's calls, or dead): the waiting
  ranks raise :class:`CollectiveTimeoutError` or :class:`RankLostError`; before raising, each failing
  rank writes what it was doing into the default rendezvous store and waits briefly for the others, so
  the message names the ranks that never answered (lost) and what the answering ones were doing.

Everything here is ``torch.distributed``: an extra gloo group, ``all_gather_single``,
``all_gather_object`` on the error path only, and the job's existing rendezvous store for the
post-mortem. The cost is measured by ``python -m zerodp.app.guard_bench``
(docs/benchmarks/2026-12-01-collective-guard.md).
"""

from __future__ import annotations

import contextlib
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from zerodp.runtime import comm
from zerodp.runtime.forward_agreement import ForwardAgreement, build_names, crc, is_tag, mismatch_message

#: calls the guard knows; the index is the code exchanged between ranks (same on every rank).
CALLS: tuple[str, ...] = (
    "forward",
    "backward",
    "step",
    "gather",
    "save_checkpoint",
    "load_checkpoint",
    "module_state_dict",
    "shutdown_distributed",
    "synced_generate",
    "clip_grad_norm_",
)
_WIDTH = 5  # int64 per rank in an agreement: call, crc32(detail), step, micro-step, aux
_STORE_WAIT_S = 3.0  # how long a failing rank waits for the others' post-mortem reports


class CollectiveError(RuntimeError):
    """Base class: ranks disagreed about, or did not all reach, a collective engine call."""


class CollectiveMismatchError(CollectiveError):
    """Ranks entered different collective calls (or the same call at different steps)."""


class CollectiveTimeoutError(CollectiveError):
    """Some rank did not reach the call within the guard's timeout (it is alive but elsewhere)."""


class RankLostError(CollectiveError):
    """A rank's process is gone (killed, crashed or exited) while the others needed it."""


@dataclass(frozen=True)
class CallSite:
    """What one rank is doing: ``call`` (one of :data:`CALLS`), its ``detail`` (a module name, a
    directory), the optimizer ``step`` and the ``micro_step``. ``aux`` is exchanged but not compared
    (the table is kept in :attr:`CollectiveGuard.aux_differs`); ``reach`` names what this rank's call
    touches, compared only on the error path to say what differs (see ``engine.backward``)."""

    call: str
    detail: str
    step: int
    micro_step: int
    aux: int = 0
    reach: Callable[[], list[str]] | None = field(default=None, compare=False)
    #: (optimizer steps, micro-steps) done, shown instead of ``step``/``micro_step`` (which stay -1 in the
    #: agreement) by a call outside the training loop (``shutdown_distributed``); None: not known
    done: tuple[int, int] | None = field(default=None, compare=False)

    def describe(self) -> str:
        what = f"{self.call}({self.detail})" if self.detail else self.call
        if self.done is not None:
            return f"{what} after {self.done[0]} optimizer step(s) ({self.done[1]} micro-step(s))"
        return f"{what} at step {self.step} (micro-step {self.micro_step})"

    def encode(self) -> torch.Tensor:
        return torch.tensor(
            [
                CALLS.index(self.call),
                zlib.crc32(self.detail.encode()) & 0x7FFFFFFF,
                self.step,
                self.micro_step,
                self.aux,
            ],
            dtype=torch.int64,
        )


class CollectiveGuard:
    """Agreement checks for one engine on its data-parallel group.

    Args:
        process_group: the engine's group (None: the default group). The guard builds a gloo group over
            the same ranks; building it is itself a collective (done in the engine's constructor).
        timeout_s: seconds a rank waits in an agreement for the others before raising (> 0).
        check_gathers: also agree before each stage-3 module fetch (detects per-module divergence).
        enabled: False makes every method a no-op (no extra group is built).
    """

    _instances = 0

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        timeout_s: float,
        check_gathers: bool = True,
        enabled: bool = True,
        ledger: comm.CommLedger | None = None,
    ) -> None:
        """``ledger``: the engine's, passed with every collective it issues; the forward and backward
        agreements set its ``watch`` while they run (a fresh one when None)."""
        if timeout_s <= 0:
            raise ValueError(f"collective guard timeout_s must be > 0 seconds, got {timeout_s}")
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.timeout_s = float(timeout_s)
        self.ledger = ledger if ledger is not None else comm.CommLedger()
        self.enabled = enabled and self.world_size > 1
        self.check_gathers = check_gathers and self.enabled
        self.agreements = 0  # agreements completed (for the cost report)
        self.seconds = 0.0  # wall time spent in agreements on this rank (includes waiting for peers)
        self.current: CallSite | None = None
        self.broken: CollectiveError | None = None
        #: called with the module's position for each stage-3 fetch inside backward (the asynchronous
        #: tag of :mod:`zerodp.runtime.backward_agreement`); None: backward fetches are not checked
        self.backward_gather: Callable[[int], None] | None = None
        #: inside backward, called before the coordinator launches all-gathers (the tag that pairs
        #: with them, :meth:`zerodp.runtime.backward_agreement.BackwardAgreement.before_launch`)
        self.backward_launch: Callable[[], None] | None = None
        #: the asynchronous fetch tags of a training forward (built by :meth:`gather_check`)
        self.forward_tags: ForwardAgreement | None = None
        self._names: dict[int, str] = {}  # module position -> name (messages from a table alone)
        self._details: dict[int, str] = {}  # crc32(module name) -> module name
        CollectiveGuard._instances += 1
        ranks = (
            dist.get_process_group_ranks(process_group)
            if process_group is not None
            else list(range(dist.get_world_size()))
        )
        # post-mortem keys: per guard (same count on every rank of a group) and per group of ranks
        self._key = f"zerodp/guard{CollectiveGuard._instances}/{'-'.join(map(str, ranks))}"
        self.group: dist.ProcessGroup | None = None
        if self.enabled:
            # only this group's ranks build it (a data-parallel subgroup of a larger world)
            self.group = dist.new_group(
                ranks=ranks,
                backend="gloo",
                timeout=timedelta(seconds=timeout_s),
                use_local_synchronization=process_group is not None,
            )
        self._send = torch.zeros(_WIDTH, dtype=torch.int64)
        self._recv = torch.zeros(self.world_size * _WIDTH, dtype=torch.int64)  # gloo: a 1-D output
        self.aux_differs = False  # the last agreement's ``aux`` values were not all equal

    # ---- agreement ---------------------------------------------------------------------------------
    def agree(self, site: CallSite) -> None:
        """Return when every rank is at ``site``; raise on every rank otherwise.

        Raises:
            CollectiveMismatchError: another rank is in a different call, or at another step.
            CollectiveTimeoutError: some rank did not arrive within ``timeout_s``.
            RankLostError: some rank's process is gone.
        """
        if not self.enabled:
            return
        self.check_usable()
        t0 = time.perf_counter()
        self._send.copy_(site.encode())
        try:
            comm.all_gather_single(self._recv, self._send, group=self.group)
        except Exception as exc:  # gloo timeout or a peer's connection closed
            self._fail(site, exc)
        self.agreements += 1
        self.seconds += time.perf_counter() - t0
        table = self._recv.view(self.world_size, _WIDTH)
        if bool((table[:, :4] == table[0, :4]).all()):
            self.aux_differs = bool((table[:, 4] != table[0, 4]).any())
            return
        if any(is_tag(row) for row in table):  # a peer posted a forward fetch tag: it is not exchanging
            self._raise(
                CollectiveMismatchError(
                    mismatch_message(  # descriptions, the table says enough
                        table, self.rank, CALLS, self._names, self._details, mine=site.describe()
                    )
                )
            )
        told: list = [None] * self.world_size
        try:  # every rank is here (the table arrived), so this pairs up
            dist.all_gather_object(told, (site.describe(), site.reach() if site.reach else None), group=self.group)
        except Exception as exc:
            self._fail(site, exc)
        sites = [t[0] for t in told]
        reaches = [t[1] for t in told]
        if all(r is not None for r in reaches) and bool((table[:, [0, 2, 3]] == table[0, [0, 2, 3]]).all()):
            self._raise(CollectiveMismatchError(_reach_message(site, self.rank, reaches)))
        others = "; ".join(f"rank {r} is in {s}" for r, s in enumerate(sites) if r != self.rank)
        self._raise(
            CollectiveMismatchError(
                f"collective mismatch: rank {self.rank} entered {site.describe()}; {others}. Every rank must "
                f"make the same collective engine calls in the same order (e.g. call {site.call} on every "
                "rank, not under `if rank == 0`); at stage 3 every rank must run the same modules, see "
                "zerodp.zero.synced_generate for generation loops of different lengths."
            )
        )

    @contextlib.contextmanager
    def call(
        self,
        name: str,
        step: int,
        micro_step: int,
        detail: str = "",
        aux: int = 0,
        reach: Callable[[], list[str]] | None = None,
    ) -> Iterator[None]:
        """Agree on entry; inside, a failure of a real collective is diagnosed the same way."""
        self.aux_differs = False
        if not self.enabled or self.current is not None:  # nested: the outer call already agreed
            yield
            return
        site = CallSite(name, detail, step, micro_step, aux, reach)
        self.agree(site)
        self.current = site
        tags = self.forward_tags if name == "forward" else None
        if tags is not None:
            tags.begin(step, micro_step)
        try:
            yield
            if tags is not None:
                tags.finish()  # before the forward's output is returned (see forward_agreement)
        except CollectiveError:
            raise
        except RuntimeError as exc:
            if _is_comm_failure(exc):
                self._fail(site, exc)
            raise
        finally:
            self.current = None
            if tags is not None:
                tags.end()

    def gather_check(self, root: nn.Module) -> _FetchCheck | None:
        """The hooks the stage-3 coordinator calls before fetching a submodule of ``root`` and before
        launching any all-gather (None when ``check_gathers`` is off): agree on ``gather(<module
        name>)`` within the current call; inside a top-level forward, when the coordinator says the
        fetch is the next one of its agreed trace (``on_trace``), by an asynchronous tag posted only
        before the fetch launches an all-gather (:mod:`zerodp.runtime.forward_agreement`),
        synchronously otherwise."""
        if not self.check_gathers:
            return None
        names = {id(m): name or "<root>" for name, m in root.named_modules()}
        positions = {id(m): i for i, m in enumerate(root.modules())}
        self._names = build_names(root)
        self._details = {crc(n): n for n in self._names.values()}
        self.forward_tags = tags = ForwardAgreement(self, CALLS, self._names)

        def check(module: nn.Module, on_trace: bool = False) -> None:
            outer = self.current
            if outer is not None and outer.call == "backward":
                if self.backward_gather is not None:  # an asynchronous tag instead (see the docstring)
                    self.backward_gather(positions.get(id(module), -1))
                return
            name = names.get(id(module), type(module).__name__)
            if on_trace and tags.active:
                tags.note_fetch(positions.get(id(module), -1), name)
                return
            self.agree(CallSite("gather", name, outer.step if outer else -1, outer.micro_step if outer else -1))

        def before_launch() -> None:
            outer = self.current
            if outer is not None and outer.call == "backward":
                if self.backward_launch is not None:
                    self.backward_launch()
                return
            tags.before_launch()

        return _FetchCheck(check, before_launch)

    def install_shutdown_check(self, engine: Any = None) -> None:
        """Make :func:`zerodp.shutdown_distributed` agree first (the latest engine's guard wins); a
        mismatch names the step counters (``global_steps``, ``micro_steps``) of ``engine`` (held weakly).

        The check holds this guard strongly, until the next engine's guard replaces it or the shutdown:
        with a weak reference, whether the agreement runs would depend on whether each rank's gc had
        collected a dropped engine yet, and one rank would wait alone for the others (seen in the bench,
        which drops every engine before it shuts down)."""
        if not self.enabled:
            return

        engine_ref = weakref.ref(engine) if engine is not None else None

        def check(guard: CollectiveGuard = self) -> None:
            owner = engine_ref() if engine_ref is not None else None
            done = (int(owner.global_steps), int(owner.micro_steps)) if owner is not None else None
            guard.agree(CallSite("shutdown_distributed", "", -1, -1, done=done))

        comm.SHUTDOWN_CHECK[:] = [check]

    # ---- failure path ------------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise the earlier error again if one left this engine unusable."""
        if self.broken is not None:
            raise type(self.broken)(
                f"{self.broken} (an earlier collective error left this engine unusable; restart the job)"
            )

    def fail_at(self, detail: str, step: int, micro_step: int, exc: BaseException) -> NoReturn:
        """:meth:`_fail` for a forward fetch tag (``detail``: which tag)."""
        self._fail(CallSite("forward", detail, step, micro_step), exc)
        raise AssertionError("unreachable")  # _fail always raises

    def mismatch(self, message: str) -> NoReturn:
        """Raise :class:`CollectiveMismatchError` with ``message`` (the engine becomes unusable)."""
        self._raise(CollectiveMismatchError(message))
        raise AssertionError("unreachable")

    def _fail(self, site: CallSite, exc: BaseException) -> None:
        text = str(exc)
        answered = self._post_mortem(site)
        silent = [r for r in range(self.world_size) if r != self.rank and r not in answered]
        seen = "; ".join(f"rank {r} reported {d}" for r, d in sorted(answered.items()) if r != self.rank)
        where = f"rank {self.rank} was in {site.describe()}"
        advice = (
            f"Every rank must make the same collective engine calls in the same order (e.g. "
            f"{site.call} on every rank). Cause: {_first_line(text)}"
        )
        err: CollectiveError
        if silent and not _is_timeout(text):
            err = RankLostError(
                f"rank(s) {_fmt(silent)} lost: {where} when the connection to it broke, and it did not "
                f"answer within {min(_STORE_WAIT_S, self.timeout_s):g} s (killed, crashed or exited)"
                f"{'; ' + seen if seen else ''}. The job cannot continue; restart it from the last "
                f"checkpoint (a save in progress is never published). Cause: {_first_line(text)}"
            )
        elif silent:
            err = CollectiveTimeoutError(
                f"collective timeout after {self.timeout_s:g} s: {where}; rank(s) {_fmt(silent)} never "
                f"reached a matching call (busy outside zerodp's collective calls, stuck, or dead)"
                f"{'; ' + seen if seen else ''}. {advice}"
            )
        else:
            err = CollectiveTimeoutError(
                f"collective timeout after {self.timeout_s:g} s: {where}; not every rank arrived in "
                f"time and the waiting ones gave up ({seen}, after the wait). {advice}"
            )
        self._raise(err, cause=exc)

    def _raise(self, err: CollectiveError, cause: BaseException | None = None) -> None:
        self.broken = err
        raise err from cause

    def _post_mortem(self, site: CallSite) -> dict[int, str]:
        """Write this rank's call to the rendezvous store; collect what the others wrote (if any)."""
        store = _default_store()
        if store is None:
            return {}
        keys = [f"{self._key}/rank{r}" for r in range(self.world_size)]
        try:
            store.set(keys[self.rank], site.describe())
        except Exception:
            return {}
        found: dict[int, str] = {self.rank: site.describe()}
        deadline = time.monotonic() + min(_STORE_WAIT_S, self.timeout_s)
        while True:
            for r in range(self.world_size):
                if r not in found:
                    try:
                        if store.check([keys[r]]):
                            found[r] = store.get(keys[r]).decode()
                    except Exception:
                        return found
            if len(found) == self.world_size or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


@dataclass(frozen=True)
class _FetchCheck:
    """:class:`zerodp.stage3.coordinator.FetchCheck` of one guard: ``check(module, on_trace)`` before
    each fetch, ``before_launch()`` before each all-gather launch."""

    check: Callable[[nn.Module, bool], None]
    before_launch: Callable[[], None]

    def __call__(self, module: nn.Module, on_trace: bool = False) -> None:
        self.check(module, on_trace)


def _default_store() -> dist.Store | None:
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except Exception:
        return None


def _is_timeout(text: str) -> bool:
    return "timed out" in text.lower() or "timeout" in text.lower()


def _is_connection_loss(text: str) -> bool:
    t = text.lower()
    return any(
        k in t
        for k in (
            "connection closed",
            "connection reset",
            "broken pipe",
            "connection refused",
            "read error",
            "write error",
            "eof",
        )
    )


def _is_comm_failure(exc: RuntimeError) -> bool:
    return (
        isinstance(exc, getattr(dist, "DistBackendError", ()))
        or "gloo" in str(exc).lower()
        or _is_connection_loss(str(exc))
        or "collective mismatch" in str(exc).lower()
    )


def _reach_message(site: CallSite, rank: int, reaches: list[list[str]]) -> str:
    """Ranks in the same call whose ``reach`` differs: name what each rank alone touches."""
    common = set(reaches[0]).intersection(*map(set, reaches[1:]))
    parts = []
    for r, reach in enumerate(reaches):
        only = sorted(set(reach) - common)
        parts.append(f"rank {r}'s {site.call} reaches {', '.join(only) if only else 'nothing more'}")
    return (
        f"collective mismatch in {site.call} at step {site.step} (micro-step {site.micro_step}) on "
        f"rank {rank}: the ranks' losses reach different modules, so the collectives of their "
        f"backward passes would not pair up (nothing was issued or updated): {'; '.join(parts)} "
        "(beyond what every rank's reaches). Make every rank's loss use the same modules' outputs "
        "(an output the engine's forward returns may go unused on some ranks: zerodp then "
        "back-propagates a zero gradient through it); see README, 'Collective safety'."
    )


def _fmt(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300]
