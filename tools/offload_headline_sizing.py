"""The model sizes of tools/gpu_offload_headline.py, computed from the budgets (no GPU, no torch).

Given a device memory budget (what ``torch.cuda.set_per_process_memory_fraction`` lets the caching
allocator hold), the host memory and disk space free, and a time budget with measured host rates, each
mode's GPT is the widest (``d_model`` a multiple of :data:`HEAD_DIM`) whose bytes fit every budget:

- device: ``params x BYTES_PER_PARAM[mode]["device"] + activations + margin <= budget``;
- host: ``params x BYTES_PER_PARAM[mode]["host"] <= HOST_SHARE x host bytes available``;
- NVMe: ``params x BYTES_PER_PARAM[mode]["nvme"] <= DISK_SHARE x free bytes of the swap directory``;
- time: the mode's build, pinned allocations, swap writes and steps at the measured rates fit its
  share of the time budget.

Bytes per parameter (bf16 training, Adam, one GPU; ZeRO paper's 2 + 2 + K with K = 12, section 3.1;
ZeRO-Offload section 4; ZeRO-Infinity section 5), as zerodp lays them out:

- ``none`` (stage 2, no offload): device 16 = bf16 parameters 2 + bf16 gradients 2 + fp32 masters 4 +
  Adam moments 8.
- ``cpu`` (stage 2, ``offload_optimizer.device: cpu``): device 4 = bf16 parameters 2 + the reducer's
  bf16 gradient partition 2; host 16 = fp32 masters 4 + moments 8 + fp32 host gradients 4 (pinned).
- ``nvme`` (stage 3, ``offload_param`` and ``offload_optimizer`` on NVMe): device 2 = the reducer's bf16
  gradient partition, held until the step (parameters: only the gathered window, in the activation
  margin); host 4 = fp32 host gradients (pinned); NVMe 14 = masters 4 + moments 8 + bf16 parameters 2.

These are the formulas; the tool reports the measured peak device memory beside them. On the H200 the
cpu mode's formula budget (228 MiB for 21.5M parameters) was too small: on CUDA a lowered budget is
now measured (gpu_offload_headline.probed_budget).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: bytes per parameter by mode and where (module docstring)
BYTES_PER_PARAM: dict[str, dict[str, int]] = {
    "none": {"device": 16, "host": 0, "nvme": 0},
    "cpu": {"device": 4, "host": 16, "nvme": 0},
    "nvme": {"device": 2, "host": 4, "nvme": 14},
}
#: width of one attention head; ``d_model`` is a multiple of it (``n_head = d_model / HEAD_DIM``)
HEAD_DIM = 64
#: share of the device budget kept for the allocator's fragmentation, cuBLAS workspaces, the stage-3
#: gather window and the persistent parameters
DEVICE_MARGIN = 0.10
#: share of the host memory available and of the disk space free a mode may take
HOST_SHARE = 0.5
DISK_SHARE = 0.5
#: the time model's safety factor (the estimate leaves out the device's arithmetic and the copies)
TIME_SAFETY = 1.5
#: seconds a child process takes before it builds anything (interpreter, torch, CUDA context)
STARTUP_S = 8.0


@dataclass
class Shape:
    """A GPT's shape (zerodp.app.model.GPTConfig fields) and the batch it trains on."""

    n_layer: int
    d_model: int
    seq_len: int
    micro_batch: int
    vocab_size: int = 256

    @property
    def n_head(self) -> int:
        return max(1, self.d_model // HEAD_DIM)

    def params(self) -> int:
        """Exact parameter count (zerodp.app.model.count_parameters, tied embeddings)."""
        d, v = self.d_model, self.vocab_size
        return v * d + self.seq_len * d + self.n_layer * (12 * d * d + 13 * d) + 2 * d

    def activation_bytes(self) -> int:
        """Activations kept for backward in bf16 (Korthikanti et al. 2022, no recomputation:
        ``s b d L (34 + 5 a s / d)``) plus the fp32 logits, their softmax and gradient (``12 b s V``)."""
        s, b, d, L = self.seq_len, self.micro_batch, self.d_model, self.n_layer
        return int(s * b * d * L * (34 + 5 * self.n_head * s / d) + 12 * b * s * self.vocab_size)

    def model(self) -> dict[str, int]:
        """The GPTConfig keyword arguments."""
        return {
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "d_model": self.d_model,
            "seq_len": self.seq_len,
            "vocab_size": self.vocab_size,
        }


@dataclass
class Rates:
    """Host seconds per unit, measured by the tool before it sizes anything (0: not measured, free)."""

    init_s_per_param: float = 0.0  # building a parameter (normal_ in bf16)
    adam_s_per_param: float = 0.0  # torch's fused CPU AdamW, per fp32 element
    pin_s_per_byte: float = 0.0  # page-locked host allocation (CUDA only)
    write_s_per_byte: float = 0.0  # direct-I/O write to the swap directory
    read_s_per_byte: float = 0.0  # direct-I/O read from it


def seconds_per_param(mode: str, rates: Rates, steps: int) -> float:
    """Estimated host seconds per parameter of one run of ``mode`` (build, pinned buffers, the initial
    swap write, ``steps`` steps of CPU Adam and swap traffic), times :data:`TIME_SAFETY`."""
    b = BYTES_PER_PARAM[mode]
    once = rates.init_s_per_param + b["host"] * rates.pin_s_per_byte + b["nvme"] * rates.write_s_per_byte
    per_step = 0.0 if mode == "none" else rates.adam_s_per_param
    per_step += b["nvme"] * (rates.read_s_per_byte + rates.write_s_per_byte)
    return TIME_SAFETY * (once + steps * per_step)


def time_cap(modes: tuple[str, ...], seconds: float, rates: Rates, steps: int) -> int | None:
    """The most parameters one model can have for the runs of ``modes`` (each a child process with
    :data:`STARTUP_S`) to fit ``seconds`` together; None when the rates say nothing (all zero)."""
    per = sum(seconds_per_param(m, rates, steps) for m in modes)
    if per <= 0:
        return None
    return max(0, int((seconds - len(modes) * STARTUP_S) / per))


def estimate_s(mode: str, params: int, rates: Rates, steps: int) -> float:
    """Estimated seconds of one child run of ``mode`` on ``params`` parameters."""
    return STARTUP_S + params * seconds_per_param(mode, rates, steps)


@dataclass
class Choice:
    """One mode's size: the shape, its parameter count, the formula's bytes, each cap, the binding one."""

    mode: str
    shape: Shape
    params: int
    device_bytes: int  # the formula's device bytes: params x bytes/param + activations
    caps: dict[str, int | None]
    limited_by: str

    def record(self) -> dict:
        out = asdict(self)
        out["shape"] = self.shape.model() | {"micro_batch": self.shape.micro_batch}
        return out


def choose(mode: str, budget: int, n_layer: int, seq_len: int, micro_batch: int, caps: dict[str, int | None]) -> Choice:
    """The widest GPT of ``n_layer`` blocks whose device bytes fit ``budget`` (bytes) for ``mode`` and
    whose parameter count is within every cap of ``caps`` (name -> params, None: no cap).

    Raises:
        ValueError: not even ``d_model = HEAD_DIM`` fits (names the budget and the binding limit).
    """
    per = BYTES_PER_PARAM[mode]["device"]
    best: Shape | None = None
    limit = "device"
    d = HEAD_DIM
    while True:
        shape = Shape(n_layer, d, seq_len, micro_batch)
        need = shape.params() * per + shape.activation_bytes() + DEVICE_MARGIN * budget
        over = [name for name, cap in caps.items() if cap is not None and shape.params() > cap]
        if need > budget or over:
            limit = over[0] if over and need <= budget else "device"
            break
        best = shape
        d += HEAD_DIM
    if best is None:
        raise ValueError(
            f"{mode}: no GPT of {n_layer} layers fits (device budget {budget:,} bytes, caps {caps}); "
            "raise --budget-gib or --time-s"
        )
    dev = best.params() * per + best.activation_bytes()
    return Choice(mode, best, best.params(), dev, dict(caps), limit)


def budget_for(params: int, mode: str, shape: Shape) -> int:
    """The smallest device budget in which ``mode`` fits a model of ``params`` parameters of ``shape``'s
    activations (inverse of :func:`choose`'s device test), rounded up to a MiB."""
    need = (params * BYTES_PER_PARAM[mode]["device"] + shape.activation_bytes()) / (1 - DEVICE_MARGIN)
    return -(-int(need) // 2**20) * 2**20


__all__ = [
    "BYTES_PER_PARAM",
    "Choice",
    "Rates",
    "Shape",
    "budget_for",
    "choose",
    "estimate_s",
    "seconds_per_param",
    "time_cap",
]
