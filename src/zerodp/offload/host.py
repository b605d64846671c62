"""ZeRO-Offload to CPU memory (``offload_optimizer.device = "cpu"``): this rank's fp32 master
partition, Adam moments and gradient partition live in host memory, and the Adam step runs there.

Source: Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training" (USENIX ATC 2021),
section 4 (the fp32 optimizer states and gradients on the CPU, parameters streamed back after the
CPU update). DeepSpeed key: ``zero_optimization.offload_optimizer``.

Every owned piece (:class:`zerodp.runtime.partition.Piece`) gets an fp32 ``master`` in host memory
(also in fp32 training, where the non-offloaded engine updates views of the parameters) and a host
gradient buffer of the same size. The pipeline (:class:`zerodp.offload.stream.CopyStream`):

1. During the boundary backward, as each bucket's reduce-scatter completes, the engine calls
   :meth:`HostOptimizerOffload.stream_grad` for the bucket's pieces: the reduced gradient is copied
   into its host buffer asynchronously (a side CUDA stream and an event; on a CPU-only machine a
   worker thread between the module's tensors and the host partition) while backward goes on.
2. At the step, :meth:`HostOptimizerOffload.stage_grad` marks the pieces that have a gradient (and
   copies any piece that was not streamed); a piece's copy is waited for when the CPU first reads
   its host gradient, not before.
3. torch's Adam/AdamW runs on the masters chunk by chunk (:data:`STEP_CHUNKS`), each chunk once the
   copies of its own pieces have arrived; each chunk's updated masters are copied host -> device
   into the module's parameters (cast to its dtype) asynchronously while the next chunk is updated;
   :meth:`HostOptimizerOffload.finish_step` waits for the last.

[Note: lazy scaling] Loss unscaling and clipping (:meth:`HostOptimizerOffload.scale_grads`) and the
global norm (:meth:`HostOptimizerOffload.norm_grads`) come before the update, so if they read the host
gradients the host would wait for every copy before the first chunk (or NVMe sub-group) is updated.
Instead the factors are recorded, in order, and each host gradient is multiplied by them
(``Tensor.mul_``, fp32, the same operations in the same order as an eager scaling) right after the
host waited for its copy (:meth:`HostOptimizerOffload._host_grad`): bitwise what scaling them at once
gives. The norm reads the reduced gradients the copies read (on the engine's device), made fp32 and
scaled the same way: the same values, summed where they are (on a device as without offload; in the
CPU tests, the same bits as a norm of the host copies).

The kernel is torch's fused CPU Adam/AdamW by default (``offload_optimizer.cpu_adam = "fused"``,
:mod:`zerodp.offload.cpu_adam`): same formula, different rounding order, so the result equals the
non-offloaded engine's within about 1e-6 relative. With ``cpu_adam = "same"`` the arithmetic is the
non-offloaded engine's: same torch optimizer, same kernel, per-parameter updates (a chunk is a subset
of whole optimizer tensors), fp32 masters, exact copies, so the result is bitwise equal. In-place edits of the module's
parameters between steps are folded into the masters before the update (:meth:`HostOptimizerOffload.fold_edits`, as
:mod:`zerodp.runtime.guards` does for non-offloaded masters).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from zerodp.offload.cpu_adam import CpuAdam, cpu_adam_kernel
from zerodp.offload.edits import EditWatch, fold_edit
from zerodp.offload.report import offload_formula
from zerodp.offload.shard_window import ShardAccess
from zerodp.offload.stream import CopyStream
from zerodp.runtime import device as devices
from zerodp.runtime.device import host_empty
from zerodp.runtime.grad_spill import GradSpill, SpillingGradReducer
from zerodp.runtime.partition import FlatGroup, Piece
from zerodp.runtime.topology import GradOrNorms


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (measured from live storage)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


#: the CPU step is cut into at most this many chunks of whole pieces, so the host -> device copy of
#: one chunk's updated parameters overlaps the update of the next
STEP_CHUNKS = 4
#: ... of at least this many elements each (smaller chunks cost more optimizer calls than they hide)
MIN_CHUNK_NUMEL = 1 << 18


class HostOptimizerOffload:
    """Optimizer states, fp32 masters and gradients of this rank's pieces in host memory.

    Lifecycle, driven by the engine: :meth:`attach` once after the pieces are assigned; per step
    :meth:`begin_grads` before the boundary backward, :meth:`stream_grad` for each piece of a bucket
    whose reduction completed, then :meth:`check_health` (collective; nothing to check for host
    memory), :meth:`fold_edits`, then either :meth:`skipped_step` (fp16 overflow) or
    :meth:`stage_grad` for each piece that has a gradient, :meth:`scale_grads` (loss unscaling),
    :meth:`norm_grads` (the global norm), :meth:`scale_grads` (clipping), :meth:`step`,
    :meth:`finish_step`.
    """

    device = "cpu"
    #: the boundary backward's reduced gradients are copied here bucket by bucket (:meth:`stream_grad`),
    #: so a ``clip_grad_norm_`` factor is deferred to the step (it scales these copies)
    streams_grads = True
    #: the engine's parameter offload when the step makes shards resident itself (NVMe subclass only);
    #: None: the engine keeps every shard resident for the whole step
    shard_access: object | None = None
    #: on a device, a pinned module-dtype staging buffer per piece (:attr:`staging`); the NVMe offload
    #: stages one sub-group at a time instead (:class:`zerodp.offload.nvme_device.ModuleWriter`)
    stages_per_piece = True

    def __init__(self, pin_memory: bool, cpu_adam: CpuAdam = "fused", train_device: torch.device | str = "cpu") -> None:
        self.pin = pin_memory  # page-locked host buffers (masters, gradients, staging)
        self.cpu_adam = cpu_adam  # the Adam/AdamW kernel of the CPU step (zerodp.offload.cpu_adam)
        #: where the module's pieces live (the engine's device); not the CPU: the copy stream's device
        #: mode, edits found by fingerprints, module-dtype staging buffers (see the module docstring)
        self.train_device = torch.device(train_device)
        self.on_device = devices.is_accelerator(self.train_device)
        self.pieces: list[Piece] = []
        self.grad_buffers: list[torch.Tensor] = []  # host fp32, one per piece
        #: per piece, on a device with a module dtype other than fp32: the pinned host buffer the updated
        #: master is cast into before its host -> device copy (a non_blocking copy cannot cast)
        self.staging: list[torch.Tensor | None] = []
        self._index: dict[int, int] = {}  # id(piece) -> position in self.pieces
        self._present: list[bool] = []
        self._streamed: list[bool] = []  # gradient copy submitted during this step's backward
        self._grad_ticket: list[object | None] = []  # per piece: its gradient copy, until the host waited
        #: per piece: the reduced gradient its copy reads (the engine's device); the norm reads it there
        self._dev_grads: list[torch.Tensor | None] = []
        self._host_factors: list[float] = []  # this step's scale factors, in order (see [Note: lazy scaling])
        self._scaled: list[int] = []  # per piece: how many of them its host gradient has taken
        self._param_tickets: list[object] = []  # the last step's host -> device copies (read masters, staging)
        self.copies = CopyStream(self.train_device)
        self.edits: EditWatch | None = EditWatch() if self.on_device else None

    # ---- construction --------------------------------------------------------------------------
    def attach(self, groups: list[FlatGroup]) -> None:
        """Give every owned piece a host fp32 master (a copy of its current value) and a host
        gradient buffer."""
        for g in groups:
            for piece in g.pieces:
                self._add_piece(piece)
                self._make_master(piece)
        if self.edits is not None:
            self.edits.take([p.tensor for p in self.pieces])

    def _add_piece(self, piece: Piece) -> None:
        self._index[id(piece)] = len(self.pieces)
        self.pieces.append(piece)
        self.grad_buffers.append(self._grad_buffer(piece))
        self._present.append(False)
        self._streamed.append(False)
        self._grad_ticket.append(None)
        self._dev_grads.append(None)
        self._scaled.append(0)
        fp32 = piece.tensor.dtype == torch.float32
        self.staging.append(
            None
            if fp32 or not self.on_device or not self.stages_per_piece
            else host_empty(piece.hi - piece.lo, piece.tensor.dtype, self.pin)
        )

    def _grad_buffer(self, piece: Piece) -> torch.Tensor:
        """``piece``'s host fp32 gradient buffer (ZeRO-Offload's host gradient)."""
        return host_empty(piece.hi - piece.lo, torch.float32, self.pin)

    def _make_master(self, piece: Piece) -> None:
        source = piece.master if piece.master is not None else piece.tensor
        master = host_empty(piece.hi - piece.lo, torch.float32, self.pin)
        master.copy_(source.detach())
        piece.master = master

    def holds_master(self, piece: Piece) -> bool:
        """Every owned piece has a host fp32 master (also under fp32 training)."""
        return True

    def refresh_master(self, piece: Piece) -> None:
        """The module's value of ``piece`` was edited (GatheredParameters): copy it into the master."""
        piece.master_copy.copy_(piece.tensor)
        if self.edits is not None:
            self.edits.retake(self._index[id(piece)], piece.tensor)

    def fold_edits(self) -> None:
        """Before the update: every element of a module parameter that no longer equals its master's
        cast was edited in place since the last step (``w.mul_(0.5)`` under ``no_grad``, also through
        ``w.data``); copy it into the fp32 master, keeping the fp32 value of the other elements
        (the rule :meth:`zerodp.runtime.guards.TrainingGuards.before_update` applies without offload).
        On a device only the pieces whose fingerprint changed are compared (see [Note: edit
        fingerprints] in :mod:`zerodp.offload.edits`): no copy of the partition to the host per step."""
        if self.edits is None:
            for piece in self.pieces:
                fold_edit(piece.tensor, piece.master_copy)
            return
        changed = self.edits.changed([p.tensor for p in self.pieces])
        for i, (piece, edited) in enumerate(zip(self.pieces, changed, strict=True)):
            if edited:
                fold_edit(piece.tensor, piece.master_copy)
                self.edits.retake(i, piece.tensor)

    def skipped_step(self) -> None:
        """The update was skipped (fp16 overflow); :meth:`fold_edits` already folded every edit."""

    # ---- one step ------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Collective in subclasses that can fail between steps; host memory cannot."""

    def begin_grads(self) -> None:
        """Before a boundary backward: forget what was streamed (on the CPU, finish the copies still
        in flight first; on a device the last step's copies are waited for where they matter)."""
        if not self.on_device:
            self.copies.wait()
        self._streamed = [False] * len(self.pieces)
        self._forget_factors()

    def gradient_spill(self, reducer: SpillingGradReducer) -> GradSpill | None:
        """No gradient swap file: host offload keeps the fp32 host gradients (see the NVMe offload's)."""
        return None

    def stream_grad(self, piece: Piece, grad: torch.Tensor) -> None:
        """Start copying ``piece``'s reduced gradient (module or fp32 dtype, any device) into its host
        fp32 buffer; called as its bucket's reduction completes. ``grad`` must stay unchanged until
        the step (a later reduction of the same bucket streams it again, in order)."""
        i = self._index[id(piece)]
        self._grad_ticket[i] = self.copies.copy(self.grad_buffers[i], grad)
        self._dev_grads[i] = grad
        self._streamed[i] = True

    def stage_grad(self, piece: Piece, grad: torch.Tensor | None) -> None:
        """``piece`` has a gradient this step: use the streamed copy, or copy ``grad`` now."""
        i = self._index[id(piece)]
        if not self._streamed[i]:
            assert grad is not None  # None only from a gradient spill, which only the NVMe offload makes
            self._grad_ticket[i] = self.copies.copy(self.grad_buffers[i], grad)
        if grad is not None:
            self._dev_grads[i] = grad
        self._present[i] = True

    def grads(self) -> list[torch.Tensor]:
        """The host gradients staged this step, every copy waited for and every factor applied."""
        self._sync_copies()
        return [b for b, present in zip(self.grad_buffers, self._present, strict=True) if present]

    def scale_grads(self, factor: float) -> None:
        """Multiply this step's staged gradients by ``factor`` (fp32, ``Tensor.mul_``): loss unscaling
        with ``1 / scale``, then clipping with ``max_norm / (norm + 1e-6)``. Recorded, and applied to
        each host gradient when the host has waited for its copy ([Note: lazy scaling])."""
        self._host_factors.append(factor)

    def norm_grads(self, pieces: list[Piece]) -> Iterable[GradOrNorms]:
        """The fp32 gradients of those of ``pieces`` that have one this step, in order, as the global
        norm reads them (a generator: :func:`zerodp.runtime.topology.global_grad_norm` reads each one
        before the next is produced). Made from the reduced gradients the copies read, on the engine's
        device, not from the host copies: the norm makes the host wait for no copy ([Note: lazy
        scaling]). Each is ``copy_`` into an fp32 scratch of the largest piece on that device (one per
        call, freed at its end), then ``mul_`` by each recorded factor: the host copy's operations,
        so the same values (an fp32 gradient without a factor is read in place)."""
        scratch: torch.Tensor | None = None
        for piece in pieces:
            i = self._index[id(piece)]
            ref = self._dev_grads[i]
            if not self._present[i]:
                continue
            assert ref is not None, "a staged gradient on the host offload has its reduced gradient"
            if ref.dtype == torch.float32 and not self._host_factors:
                yield ref
                continue
            if scratch is None or scratch.device != ref.device:
                scratch = torch.empty(max(p.hi - p.lo for p in self.pieces), dtype=torch.float32, device=ref.device)
            out = scratch[: ref.numel()]
            out.copy_(ref)
            for f in self._host_factors:
                out.mul_(f)
            yield out

    def set_shard_access(self, access: ShardAccess) -> None:
        """The engine's parameter offload (stage 3, ``offload_param``). Host memory updates every piece
        at once, so the engine keeps the shards resident for the step: nothing to do here."""

    def grad_of(self, piece: Piece) -> torch.Tensor | None:
        """``piece``'s host gradient staged this step (its copy waited for, the factors applied), or
        None if it has none."""
        i = self._index[id(piece)]
        return self._host_grad(i) if self._present[i] else None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Run ``optimizer`` (whose parameters are the masters) on the staged host gradients, chunk
        by chunk, each chunk once its gradients have arrived (the later ones may still be on their way);
        each chunk's updated masters start streaming into the module's parameters while the next chunk
        is updated (on a device, cast into the pinned staging buffer first)."""
        for ticket in self._param_tickets:  # the last step's copies still reading masters / staging
            self.copies.host_wait(ticket)
        self._param_tickets = []
        for chunk in _chunks(self.pieces, self._present):
            for i, piece in enumerate(self.pieces):
                piece.master_copy.grad = self._host_grad(i) if i in chunk else None
            with cpu_adam_kernel(optimizer, self.cpu_adam):
                optimizer.step()
            for i in sorted(chunk):
                self._param_tickets.append(self._copy_to_module(i))

    def _copy_to_module(self, i: int) -> object | None:
        """Start the copy of piece ``i``'s master into the module's piece; returns its ticket."""
        src, staging = self.pieces[i].master_copy, self.staging[i]
        if staging is not None:
            staging.copy_(src)  # the cast, on the host, into pinned memory
            src = staging
        return self.copies.copy(self.pieces[i].tensor, src)

    def _grad_arrived(self, i: int) -> None:
        """The host waits for piece ``i``'s gradient copy (if one is in flight)."""
        ticket, self._grad_ticket[i] = self._grad_ticket[i], None
        self.copies.host_wait(ticket)

    def _host_grad(self, i: int) -> torch.Tensor:
        """Piece ``i``'s host fp32 gradient, ready for the CPU: its copy waited for, then multiplied
        by the factors recorded since it was last read, in order ([Note: lazy scaling])."""
        self._grad_arrived(i)
        buf = self.grad_buffers[i]
        for f in self._host_factors[self._scaled[i] :]:
            buf.mul_(f)
        self._scaled[i] = len(self._host_factors)
        return buf

    def _forget_host_grads(self) -> None:
        """After a step: every gradient copy done (also of pieces without a gradient this step, before the
        reducer reuses their memory); no factor recorded, no reduced gradient referenced."""
        for i in range(len(self.pieces)):
            self._grad_arrived(i)
        self._forget_factors()

    def _forget_factors(self) -> None:
        """A new step's gradients: no factor recorded, no reduced gradient referenced."""
        self._host_factors = []
        self._scaled = [0] * len(self.pieces)
        self._dev_grads = [None] * len(self.pieces)

    def settle(self) -> None:
        """Nothing to finish: :meth:`step` updates everything before it returns."""

    def when_updated(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now (the step's updates are done when :meth:`step` returns)."""
        fn()

    def finish_step(self) -> None:
        """The module's parameters hold the updated masters for any later use: on a device the compute
        stream waits for the copies (an event wait: the host goes on, and the next forward's kernels run
        after the copies) and the pieces' fingerprints are taken after them; on the CPU the host waits.
        Forget this step's gradients."""
        self.copies.device_wait()
        if self.edits is not None:
            self.edits.take([p.tensor for p in self.pieces])
        self._forget_host_grads()
        for i, piece in enumerate(self.pieces):
            piece.master_copy.grad = None
            self._present[i] = False
            self._streamed[i] = False

    def _sync_copies(self) -> None:
        """The host waits for every copy in flight (all gradients have arrived) and applies the
        recorded factors to every staged host gradient."""
        self.copies.wait()
        self._grad_ticket = [None] * len(self.pieces)
        for i, present in enumerate(self._present):
            if present:
                self._host_grad(i)

    # ---- checkpoints and reports ---------------------------------------------------------------
    @contextlib.contextmanager
    def resident(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Masters and optimizer states as ordinary tensors for a checkpoint (already so here)."""
        yield

    def adjust_formula(self, formula: dict[str, float], numel_per_rank: float) -> None:
        """The paper's model-state formula (:func:`zerodp.runtime.accounting.model_state_bytes`) for an
        offloaded partition: fp32 masters always (4 bytes per owned element, also under fp32)."""
        formula["master_weights"] = 4 * numel_per_rank

    def host_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Host bytes by category, measured from the live storages."""
        states = [
            t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0
        ]
        return {
            "master_weights": storage_bytes([p.master_copy for p in self.pieces if p.master_copy.numel()]),
            "optimizer_states": storage_bytes(states),
            "gradients": storage_bytes(self.grad_buffers),
            "swap_buffers": 0,
        }

    def nvme_bytes(self) -> dict[str, int]:
        return {"master_weights": 0, "optimizer_states": 0}

    def formula(self, numel_per_rank: float, host: dict[str, int]) -> dict[str, dict[str, float]]:
        """The expected host / NVMe bytes (:func:`zerodp.offload.report.offload_formula`) for this
        offload, ``host`` being :meth:`host_bytes`."""
        return offload_formula(self.device, numel_per_rank, host["swap_buffers"])

    def close(self) -> None:
        """Finish the copies in flight and stop the copy thread."""
        self.copies.close()


def _chunks(pieces: list[Piece], present: list[bool]) -> list[set[int]]:
    """Positions of the present pieces, in order, cut into at most :data:`STEP_CHUNKS` chunks of at
    least :data:`MIN_CHUNK_NUMEL` elements (the last may be smaller)."""
    todo = [i for i, p in enumerate(present) if p]
    total = sum(pieces[i].hi - pieces[i].lo for i in todo)
    target = max(MIN_CHUNK_NUMEL, -(-total // STEP_CHUNKS))
    chunks: list[set[int]] = []
    current: set[int] = set()
    numel = 0
    for i in todo:
        current.add(i)
        numel += pieces[i].hi - pieces[i].lo
        if numel >= target:
            chunks.append(current)
            current, numel = set(), 0
    if current:
        chunks.append(current)
    return chunks


__all__ = ["HostOptimizerOffload", "MIN_CHUNK_NUMEL", "STEP_CHUNKS", "storage_bytes"]
