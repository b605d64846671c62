"""Agreement on the collectives issued inside ``engine.backward``: asynchronous tags, checked lazily.

Inside backward every rank issues its data collectives in the order its autograd graph asks for them:
stage-3 *backward fetches* (all-gathers of a module's unit when its output gradient arrives) and the
*gradient bucket reductions* (reduce-scatter at stages 1-3, all-reduce at stage 0) when a bucket is
complete. If the ranks' graphs differ (a loss that uses a module's output on some ranks only, a
parameter used on some ranks only) those collectives no longer pair up: the job hangs, gloo reports a
size mismatch, or, worst, two different units of the same size are paired and the gradients are
silently wrong. The ``backward`` agreement already compares what each rank's graph reaches (see
:mod:`zerodp.runtime.backward_roots`), so what is left here is the *order*: the same modules and
parameters reached in another order (forward operations that differ between ranks). A synchronous
agreement before each of them (as the forward's per-fetch agreement)
would cost a round trip each; here each costs one *asynchronous* all-gather of four int64 per rank on
the guard's gloo group, posted just before the data collective it describes and not waited for:

    (kind, identity, index in this backward, optimizer step)

``kind`` is ``gather`` (identity: the module's position in ``named_modules()``), ``reduce``
(identity: the bucket) or ``end``. Tags pair up in posting order exactly as the data collectives do,
so the first differing tag names the first mis-paired data collective, on every rank, from the table
alone (names are looked up by identity, identical on every rank).

Only launches are tagged. A backward fetch that finds its units gathered (or in flight) issues no
collective and posts no tag; it is folded into a running digest of every backward fetch (module
positions, in order), and the ``end`` tag's identity holds that digest beside the number of tags, so
ranks that fetched modules in another order without launching differently still raise at
:meth:`BackwardAgreement.finish`. A fetch that launches all-gathers posts one ``gather`` tag (the
module's position) just before them (the coordinator's ``before_launch``; the units it launches follow
from the fetches so far and the agreed trace, which the digest covers). A coalesced reduce-scatter of
several stage-3 units posts one ``reduce`` tag whose identity is a 62-bit hash of all of its buckets
(:meth:`BackwardAgreement.group_identity`), so a group that differs in any bucket differs in the tag.
On the bench's small GPT this is 7 tags per step instead of 39 (one per fetch and one per unit;
``tools/backward_tag_count.py``): docs/benchmarks/2026-12-01-collective-guard.md, "Backward".

When they are checked:

- While a rank waits for any data collective inside backward (every ``zerodp.runtime.comm`` wait goes
  through :meth:`BackwardAgreement.wait_data` then, see ``comm.CommLedger.watch``), it polls the collective's
  ``is_completed()`` and checks the tags that have completed every ``comm.POLL_S`` (never a timed
  ``wait``: on NCCL that aborts the communicator; a device collective is not waited for on the host at
  all, see [Note: guard waits] in :mod:`zerodp.runtime.comm`); a rank waiting for a collective that a
  diverged peer never issues therefore raises as soon as that peer's next tag (or its ``end`` tag)
  arrives, and at the latest after the guard's ``timeout_s`` (:class:`CollectiveTimeoutError` naming
  what each rank was doing, through the guard's post-mortem).
- At the end of backward (after the last gradient reduction, before ``engine.backward`` returns and so
  before any gradient is used or any state changes), :meth:`BackwardAgreement.finish` posts the ``end``
  tag and waits for every tag: a same-size mis-pairing that completed silently raises
  :class:`CollectiveMismatchError` here, on every rank (they all receive the same tables).

A data collective that fails is explained by the tags when they disagree, and by the guard's
post-mortem otherwise (a lost peer). Not prevented: gloo aborts the *receiving process* when a
mis-paired collective has another size ("Received data size doesn't match", a C++ abort that no
Python code sees); the other ranks then raise ``RankLostError``. Tags stop a same-size mis-pairing
from going unnoticed; they cannot stop that abort, which only a synchronous agreement before each
collective would. After any of these errors the
engine is unusable (as for every guard error): the job must restart.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn, Protocol

import torch
import torch.distributed as dist
from torch.distributed import Work

from zerodp.runtime import comm
from zerodp.runtime.collective_guard import CallSite, CollectiveError, CollectiveMismatchError
from zerodp.runtime.forward_agreement import TagWaits

KINDS: tuple[str, ...] = ("end", "gather", "reduce")


class _Guard(Protocol):
    """What the agreement needs of a :class:`~zerodp.runtime.collective_guard.CollectiveGuard`."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    timeout_s: float
    ledger: comm.CommLedger  # the engine's: its ``watch`` is set while the agreement runs
    broken: CollectiveError | None
    backward_gather: Callable[[int], None] | None
    backward_launch: Callable[[], None] | None

    def _fail(self, site: CallSite, exc: BaseException) -> None: ...

    def _raise(self, err: CollectiveError, cause: BaseException | None = None) -> None: ...


@dataclass
class _Tag:
    send: torch.Tensor  # int64[4]
    recv: torch.Tensor  # int64[world * 4]
    work: Work


class BackwardAgreement(TagWaits):
    """The tags of one engine's backward collectives (see the module docstring).

    Args:
        guard: the engine's collective guard (its gloo group carries the tags; its post-mortem and
            error state are shared).
        gather_names: module position (``named_modules()`` order) -> qualified name.
        reduce_names: bucket identity (see :meth:`reduce_identity`) -> what the bucket holds.
    """

    def __init__(self, guard: _Guard, gather_names: dict[int, str], reduce_names: dict[int, str]) -> None:
        self.guard = guard
        self.names = {1: gather_names, 2: reduce_names}
        self.active = False
        self.step = 0
        self.micro_step = 0
        self.posted = 0  # tags posted in this backward
        self.tags_total = 0  # tags posted over the engine's life (for the cost report)
        self._tags: list[_Tag] = []
        self._checked = 0  # tags already compared
        self._fetches = 0  # backward fetches in this backward
        self._digest = 0  # crc32 of their module positions, in order
        self._last_position = -1  # the latest fetch's module position (what a launch is tagged with)

    @staticmethod
    def reduce_identity(group_index: int, bucket_index: int) -> int:
        return group_index * (1 << 20) + bucket_index

    @staticmethod
    def group_identity(buckets: list[tuple[int, int]]) -> int:
        """Identity of one collective reducing several ``(group index, bucket index)`` buckets: bit 62
        set (single buckets' identities are below 2**40) and a 62-bit hash of the ordered list."""
        digest = hashlib.blake2b(repr(buckets).encode(), digest_size=8).digest()
        return (1 << 62) | (int.from_bytes(digest, "little") & ((1 << 62) - 1))

    @staticmethod
    def end_identity(posted: int, fetches: int, digest: int) -> int:
        """The ``end`` tag's identity: tags posted before it (20 bits), backward fetches (10 bits) and
        the crc32 of their positions (32 bits), so that a differing fetch order or count differs."""
        return ((digest & 0xFFFFFFFF) << 30) | ((fetches & 0x3FF) << 20) | (posted & 0xFFFFF)

    def attach(self) -> None:
        """Tag the guard's backward fetches and launches (the reducer's bucket reductions are tagged
        through :meth:`note_reduce`, its ``launch_check`` given at its construction)."""
        self.guard.backward_gather = self.note_gather
        self.guard.backward_launch = self.before_launch

    # ---- backward boundaries -------------------------------------------------------------------------
    def begin(self, step: int, micro_step: int) -> None:
        """Start of ``engine.backward``: route every comm wait through :meth:`wait_data`."""
        self.active, self.step, self.micro_step = True, step, micro_step
        self.posted, self._tags, self._checked = 0, [], 0
        self._fetches, self._digest, self._last_position = 0, 0, -1
        self.guard.ledger.watch = self.wait_data

    def finish(self) -> None:
        """End of backward (every gradient reduction done): post ``end``, wait for and compare every
        tag. Raises CollectiveMismatchError / CollectiveTimeoutError / RankLostError."""
        self._post(0, self.end_identity(self.posted, self._fetches, self._digest))
        deadline = time.monotonic() + self.guard.timeout_s
        while self._checked < len(self._tags):
            tag = self._tags[self._checked]
            try:
                tag.work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except Exception as exc:  # the peer never posted this tag in time, or is gone
                self._fail(self._checked, exc)
            self._compare(self._checked)
            self._checked += 1

    def end(self) -> None:
        """Leave backward (normally or by an exception): comm waits are plain again."""
        self.active = False
        self.guard.ledger.watch = None

    # ---- tags ----------------------------------------------------------------------------------------
    def note_gather(self, position: int) -> None:
        """A backward fetch of the module at ``position`` (folded into the digest; no tag)."""
        if self.active:
            self._fetches += 1
            self._digest = zlib.crc32(position.to_bytes(8, "little", signed=True), self._digest)
            self._last_position = position

    def before_launch(self) -> None:
        """All-gathers are about to be launched inside backward: tag them with the latest fetch."""
        if self.active:
            self._post(1, self._last_position)

    def note_reduce(self, buckets: list[tuple[int, int]]) -> None:
        """One reduction of ``buckets`` (``(group index, bucket index)`` in launch order: one bucket, or a
        coalesced stage-3 group) is about to be launched: one tag, identified by the bucket
        (:meth:`reduce_identity`) or by all of the group's (:meth:`group_identity`)."""
        if not self.active:
            return
        if len(buckets) == 1:
            self._post(2, self.reduce_identity(*buckets[0]))
            return
        ident = self.group_identity(buckets)
        names = self.names[2]
        if ident not in names:
            names[ident] = " + ".join(names.get(self.reduce_identity(*b), f"#{b}") for b in buckets)
        self._post(2, ident)

    def _post(self, kind: int, ident: int) -> None:
        g = self.guard
        if g.broken is not None:
            raise type(g.broken)(f"{g.broken} (an earlier collective error left this engine unusable)")
        send = torch.tensor([kind, ident, self.posted, self.step], dtype=torch.int64)
        recv = torch.empty(g.world_size * 4, dtype=torch.int64)
        try:
            work = comm.all_gather_single(recv, send, group=g.group, async_op=True)
        except Exception as exc:
            self._fail(self.posted, exc)
        self._tags.append(_Tag(send, recv, work))
        self.posted += 1
        self.tags_total += 1

    # ---- waiting for data collectives ----------------------------------------------------------------
    def wait_data(self, work: Work, on_device: bool = False) -> None:
        """Wait for one data collective issued inside backward, at most the guard's ``timeout_s``,
        comparing the tags that complete meanwhile (a diverged peer is seen as soon as its tag is)."""
        comm.wait_polling(
            work, self.guard.timeout_s, "backward", self._explain_failure, self._check_completed, on_device
        )

    def _check_completed(self) -> None:
        while self._checked < len(self._tags) and self._tags[self._checked].work.is_completed():
            try:
                self._tags[self._checked].work.wait()
            except Exception as exc:
                self._fail(self._checked, exc)
            self._compare(self._checked)
            self._checked += 1

    # ---- verdicts ------------------------------------------------------------------------------------
    def _describe(self, kind: int, ident: int) -> str:
        if kind == 0:
            posted, fetches, digest = ident & 0xFFFFF, (ident >> 20) & 0x3FF, ident >> 30
            return (
                f"the end of backward (after {posted} collectives and {fetches} module fetches, "
                f"fetch order digest {digest:08x})"
            )
        name = self.names[kind].get(ident)
        if name is None:
            name = "a coalesced group of other gradient buckets" if ident >> 62 else f"#{ident}"
        return f"{KINDS[kind]}({name})"

    def _compare(self, i: int) -> None:
        tag = self._tags[i]
        table = tag.recv.view(self.guard.world_size, 4)
        if bool((table[:, :2] == table[0, :2]).all()):
            return
        me = self.guard.rank
        mine = self._describe(int(table[me, 0]), int(table[me, 1]))
        others = "; ".join(
            f"rank {r} is in {self._describe(int(table[r, 0]), int(table[r, 1]))}"
            for r in range(self.guard.world_size)
            if r != me
        )
        self.guard._raise(
            CollectiveMismatchError(
                f"collective mismatch in backward at step {self.step} (micro-step {self.micro_step}), "
                f"collective #{i} of this backward: rank {me} entered {mine}; {others}. The ranks agreed on "
                "what their backward passes reach, but reach it in another order (forward operations that "
                "differ between ranks), so their collectives no longer pair up; no parameter or optimizer "
                "state was updated, the job must restart. Make the order of the forward's operations the "
                "same on every rank; see README, 'Collective safety'."
            )
        )

    def _fail(self, i: int, exc: BaseException) -> NoReturn:
        kind, ident = (int(self._tags[i].send[0]), int(self._tags[i].send[1])) if i < len(self._tags) else (0, 0)
        site = CallSite("backward", f"{self._describe(kind, ident)}, collective #{i}", self.step, self.micro_step)
        self.guard._fail(site, exc)
        raise AssertionError("unreachable")  # _fail always raises


def build_backward_agreement(guard: _Guard, module: torch.nn.Module, groups: list, stage3: bool) -> BackwardAgreement:
    """The agreement of one engine: names by module position and by gradient bucket (``groups``: the
    engine's :class:`~zerodp.runtime.partition.FlatGroup` list; at stage 3 one per unit, named by
    its first parameter's module)."""
    gather_names = {i: name or "<root>" for i, (name, _) in enumerate(module.named_modules())}
    reduce_names: dict[int, str] = {}
    for g in groups:
        for b in g.buckets:
            first = b.slots[0].name if b.slots else "?"
            what = first.rsplit(".", 1)[0] if stage3 and "." in first else f"bucket {g.index}.{b.index}: {first}"
            if len(b.slots) > 1 and not stage3:
                what += f" +{len(b.slots) - 1} more"
            reduce_names[BackwardAgreement.reduce_identity(g.index, b.index)] = what
    return BackwardAgreement(guard, gather_names, reduce_names)
