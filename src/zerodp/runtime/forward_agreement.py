"""Agreement on the stage-3 module fetches of a training forward: asynchronous tags, checked in batches.

The collective guard (:mod:`zerodp.runtime.collective_guard`) agrees on ``gather(<module name>)``
before each stage-3 module fetch, so that ranks fetching different modules raise instead of issuing
all-gathers that pair up wrongly (a hang, a gloo size-mismatch abort, or, for two units of the same
size, silently wrong parameters). A synchronous agreement costs a round trip per fetch on the forward
path (19 per step on the bench's small GPT). This module replaces it, for the fetches where that is
safe, by a running digest of the fetched modules and by *asynchronous* all-gathers (tags) on the
guard's gloo group, posted before the all-gathers they protect and not waited for; the tags are
waited for and compared in batches.

When the synchronous agreement is replaced: the fetch belongs to a training iteration whose module
trace is *complete* (recorded in an earlier iteration and compared across ranks by the stage-3
coordinator) and the module is the one the trace expects next on this rank (``on_trace``). The
coordinator then launches its all-gathers (the module's own, if not prefetched, and the prefetch
groups of the modules ahead) from the trace, the cursor and the units' states, identical on every
rank that is also on the trace (the prefetch pairing already relies on this). Such a fetch is folded
into the forward's digest (:meth:`ForwardAgreement.note_fetch`) and posts a ``gather`` tag only when
it launches an all-gather, just before the launch (:meth:`ForwardAgreement.before_launch`); a fetch
that launches nothing only waits for all-gathers that every on-trace rank launched at an earlier
fetch. A rank that leaves the trace (another module, one module too many) agrees *synchronously*
before launching anything; that agreement pairs with its peers' next tag (every guard all-gather,
tag or agreement, is the same five int64), so the divergence is seen before any data collective could
pair up wrongly: the diverged rank launches nothing more, and its peers' later all-gathers are never
paired (they raise when their tag, which met that agreement, is compared). Every other fetch
(recording the trace, an invalid trace, a forward outside training, a forward nested in another
engine call) keeps the synchronous agreement.

A tag is the agreement's own row ``(call code, crc32(detail), step, micro-step, aux)`` with ``aux`` < 0
marking it as a tag: ``gather`` with ``aux = -1 - position`` (the module's position in
``named_modules()``), and one ``forward`` tag when the forward ends, whose detail holds the number of
on-trace fetches and the digest of their positions (compared) and ``aux = -1 - fetches``. Any row is
comparable with any other: a synchronous agreement that meets a tag compares the same columns, and
names the tag's module from the table alone (:func:`describe_row`) instead of exchanging descriptions
(the tagging peer is not in a synchronous exchange). The module a message names for a tagging rank is
the fetch where it launched next (or the end of its forward), not necessarily the fetch at which the
other rank diverged.

When they are checked (every rank receives the same tables, so every rank reaches the same verdict):

- When the forward ends (:meth:`ForwardAgreement.finish`, before the engine returns the forward's
  output, so before any loss, gradient or optimizer step uses it): the ``end`` tag is posted and every
  tag is waited for, within the guard's ``timeout_s``. A rank that ran fewer modules posts ``end``
  where its peers post a ``gather`` tag, or an ``end`` with another count: mismatch.
- When more than :data:`MAX_IN_FLIGHT` are outstanding (a long forward): the oldest is waited for.
- While a rank waits for a data collective inside the forward (every ``zerodp.runtime.comm`` wait,
  coalesced prefetch groups included, then goes through :meth:`ForwardAgreement.wait_data`, see
  ``comm.CommLedger.watch``): polling its ``is_completed()``, comparing the tags that completed every
  ``comm.POLL_S``, at most ``timeout_s`` in all (a device collective: no host wait, see [Note: guard
  waits] in :mod:`zerodp.runtime.comm`). A rank waiting for an all-gather that a diverged peer never launches therefore
  raises as soon as its tag that met the peer's agreement completes.

Errors: :class:`~zerodp.runtime.collective_guard.CollectiveMismatchError` naming each rank's module (or
call), or, through the guard's post-mortem, ``CollectiveTimeoutError`` / ``RankLostError`` when a
tag does not complete in time or a peer is gone. After a divergence found by a tag, a rank may have
launched all-gathers its peers never launch: the engine's process group is then unusable too (the
synchronous agreement left it clean); the job must restart, as after any guard error.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist
from torch.distributed import Work

from zerodp.runtime import comm

WIDTH = 5  # int64 per rank: the synchronous agreement's row (see collective_guard._WIDTH)
MAX_IN_FLIGHT = 64  # tags outstanding before the oldest is waited for
END_DETAIL = "end"


class _Guard(Protocol):
    """What the tags need of a :class:`~zerodp.runtime.collective_guard.CollectiveGuard`."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    timeout_s: float
    ledger: comm.CommLedger  # the engine's: its ``watch`` is set while the agreement runs

    def check_usable(self) -> None: ...

    def fail_at(self, detail: str, step: int, micro_step: int, exc: BaseException) -> NoReturn: ...

    def mismatch(self, message: str) -> NoReturn: ...


def crc(detail: str) -> int:
    """The detail hash of an agreement row (int, 31 bits)."""
    return zlib.crc32(detail.encode()) & 0x7FFFFFFF


def is_tag(row: torch.Tensor) -> bool:
    """Row (int64[WIDTH]) posted by :class:`ForwardAgreement` rather than a synchronous agreement."""
    return int(row[4]) < 0


def describe_row(row: torch.Tensor, calls: Sequence[str], names: dict[int, str], details: dict[int, str]) -> str:
    """``gather(blocks.2) at step 3 (micro-step 3)`` from one agreement row alone.

    Args:
        row: int64[WIDTH], ``(call code, crc32(detail), step, micro-step, aux)``.
        calls: the guard's call names by code. names: module position -> qualified name (tags).
        details: crc32 -> detail for the details this rank knows (module names), for synchronous rows.
    """
    code, digest, step, micro, aux = (int(v) for v in row)
    call = calls[code] if 0 <= code < len(calls) else f"call #{code}"
    if aux < 0 and call == "forward":
        what = f"the end of forward (after {-1 - aux} module fetches)"
    elif aux < 0:
        what = f"{call}({names.get(-1 - aux, f'module #{-1 - aux}')})"
    else:
        detail = details.get(digest)
        what = f"{call}({detail})" if detail else call
    return f"{what} at step {step} (micro-step {micro})"


@dataclass
class _Tag:
    send: torch.Tensor  # int64[WIDTH]
    recv: torch.Tensor  # int64[world * WIDTH]
    work: Work


class TagWaits:
    """What the forward and backward agreements share: explaining a failed or timed-out data
    collective by the tags posted so far. Subclasses hold ``guard`` (with ``timeout_s``), ``_tags``
    and ``_checked`` (tags compared so far) and define ``_check_completed`` and ``_fail``."""

    guard: Any
    _tags: list
    _checked: int

    def _check_completed(self) -> None:
        raise NotImplementedError

    def _fail(self, i: int, exc: BaseException) -> NoReturn:
        raise NotImplementedError

    def _explain_failure(self, exc: BaseException) -> NoReturn:
        """A data collective failed or timed out: the tags explain it if they disagree (waiting for
        them a little), otherwise the guard's post-mortem does."""
        deadline = time.monotonic() + min(3.0, self.guard.timeout_s)
        while time.monotonic() < deadline and self._checked < len(self._tags):
            self._check_completed()
            time.sleep(0.02)
        self._fail(max(self._checked, len(self._tags) - 1), exc)


class ForwardAgreement(TagWaits):
    """The fetch tags of one engine's forward (see the module docstring).

    Args:
        guard: the engine's collective guard (its gloo group carries the tags; errors go through it).
        calls: the guard's call names by code (the index is exchanged).
        names: module position (``named_modules()`` order) -> qualified name (``<root>`` for the root).
    """

    def __init__(self, guard: _Guard, calls: Sequence[str], names: dict[int, str]) -> None:
        self.guard = guard
        self.calls = tuple(calls)
        self.names = names
        self.details = {crc(n): n for n in names.values()}
        self.active = False
        self.step = 0
        self.micro_step = 0
        self.posted = 0  # tags posted in this forward
        self.fetches = 0  # on-trace fetches noted in this forward
        self.digest = 0  # crc32 of their module positions, in order
        self.pending: tuple[int, str] | None = None  # the last noted fetch, not yet tagged
        self.tags_total = 0  # tags posted over the engine's life (for the cost report)
        self.sync_waits = 0  # blocking waits for tags (forward ends and MAX_IN_FLIGHT), engine's life
        self._tags: list[_Tag] = []
        self._checked = 0

    # ---- forward boundaries --------------------------------------------------------------------------
    def begin(self, step: int, micro_step: int) -> None:
        """Start of an agreed top-level ``forward``: route every comm wait through :meth:`wait_data`."""
        self.active, self.step, self.micro_step = True, step, micro_step
        self.posted, self._tags, self._checked = 0, [], 0
        self.fetches, self.digest, self.pending = 0, 0, None
        self.guard.ledger.watch = self.wait_data

    def finish(self) -> None:
        """The forward's modules have run: post ``end``, wait for and compare every tag (at most the
        guard's ``timeout_s``). Raises CollectiveMismatchError / CollectiveTimeoutError / RankLostError."""
        self._post(self.calls.index("forward"), f"{END_DETAIL} {self.fetches} {self.digest}", -1 - self.fetches)
        self.sync_waits += 1
        self._wait_until(len(self._tags))

    def end(self) -> None:
        """Leave the forward (normally or by an exception): comm waits are plain again."""
        if self.active:
            self.active = False
            self.guard.ledger.watch = None

    # ---- tags ----------------------------------------------------------------------------------------
    def note_fetch(self, position: int, name: str) -> None:
        """A fetch of the module at ``position``, the next one of the agreed trace: folded into the
        forward's digest; tagged by :meth:`before_launch` if it launches an all-gather."""
        self.fetches += 1
        self.digest = zlib.crc32(position.to_bytes(8, "little", signed=True), self.digest)
        self.pending = (position, name)

    def before_launch(self) -> None:
        """An all-gather is about to be launched: tag the fetch that launches it (see the module
        docstring: a fetch that launches nothing only waits for gathers every on-trace rank launched)."""
        if not self.active or self.pending is None:
            return
        position, name = self.pending
        self.pending = None
        if len(self._tags) - self._checked >= MAX_IN_FLIGHT:
            self.sync_waits += 1
            self._wait_until(self._checked + 1)
        self._post(self.calls.index("gather"), name, -1 - position)

    def _post(self, code: int, detail: str, aux: int) -> None:
        g = self.guard
        g.check_usable()
        send = torch.tensor([code, crc(detail), self.step, self.micro_step, aux], dtype=torch.int64)
        recv = torch.empty(g.world_size * WIDTH, dtype=torch.int64)
        try:
            work = comm.all_gather_single(recv, send, group=g.group, async_op=True)
        except Exception as exc:
            self._fail(len(self._tags), exc, send)
        self._tags.append(_Tag(send, recv, work))
        self.posted += 1
        self.tags_total += 1

    # ---- waiting -------------------------------------------------------------------------------------
    def _wait_until(self, n: int) -> None:
        deadline = time.monotonic() + self.guard.timeout_s
        while self._checked < n:
            tag = self._tags[self._checked]
            try:
                tag.work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except Exception as exc:  # the peer never posted a matching all-gather in time, or is gone
                self._fail(self._checked, exc)
            self._compare(self._checked)
            self._checked += 1

    def wait_data(self, work: Work, on_device: bool = False) -> None:
        """Wait for one data collective issued inside the forward, at most the guard's ``timeout_s``,
        comparing the tags that complete meanwhile."""
        comm.wait_polling(
            work, self.guard.timeout_s, "forward", self._explain_failure, self._check_completed, on_device
        )

    def _check_completed(self) -> None:
        while self._checked < len(self._tags) and self._tags[self._checked].work.is_completed():
            self._wait_until(self._checked + 1)

    # ---- verdicts ------------------------------------------------------------------------------------
    def _compare(self, i: int) -> None:
        table = self._tags[i].recv.view(self.guard.world_size, WIDTH)
        if bool((table[:, :4] == table[0, :4]).all()):
            return
        self.guard.mismatch(mismatch_message(table, self.guard.rank, self.calls, self.names, self.details))

    def _fail(self, i: int, exc: BaseException, send: torch.Tensor | None = None) -> NoReturn:
        row = send if send is not None else (self._tags[i].send if i < len(self._tags) else None)
        what = (
            describe_row(row, self.calls, self.names, self.details).split(" at step")[0]
            if row is not None
            else "forward"
        )
        self.guard.fail_at(f"{what}, fetch tag #{i}", self.step, self.micro_step, exc)
        raise AssertionError("unreachable")  # fail_at always raises


def mismatch_message(
    table: torch.Tensor,
    rank: int,
    calls: Sequence[str],
    names: dict[int, str],
    details: dict[int, str],
    mine: str | None = None,
) -> str:
    """The guard's mismatch message from an agreement table (int64[world, WIDTH]) alone, used when a
    row is a tag (its rank is not in a synchronous exchange of descriptions). ``mine``: this rank's
    own description when it is in a synchronous agreement."""
    me = mine or describe_row(table[rank], calls, names, details)
    others = "; ".join(
        f"rank {r} is in {describe_row(table[r], calls, names, details)}" for r in range(table.shape[0]) if r != rank
    )
    return (
        f"collective mismatch: rank {rank} entered {me}; {others}. Every rank must make the same "
        "collective engine calls in the same order; at stage 3 every rank must run the same modules "
        "in the same order in each forward (checked without a round trip per module once the "
        "module trace is recorded), see zerodp.zero.synced_generate for generation loops of "
        "different lengths. No parameter or optimizer state was updated; the job must restart."
    )


def build_names(module: torch.nn.Module) -> dict[int, str]:
    """Module position (``named_modules()`` order) -> qualified name, ``<root>`` for the root."""
    return {i: name or "<root>" for i, (name, _) in enumerate(module.named_modules())}
