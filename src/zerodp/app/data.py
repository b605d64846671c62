"""The training corpus as UTF-8 bytes, and the batch samplers the train job draws from it.

Default corpus: the English documentation prose that ships inside CPython's standard library,
``pydoc_data.topics.topics`` (the text ``help('topic')`` prints), joined in sorted-key order: about
0.47 MB, present on every Python install, nothing to download.

Tokens are bytes: :func:`encode` gives a ``torch.uint8`` tensor (one element per UTF-8 byte) and the
samplers return ``torch.long`` windows ready for :class:`zerodp.app.model.GPT`.

Batches are defined globally: :class:`GlobalBatches` draws, for micro-step ``s``, the whole
``micro_batch_size * world_size`` rows from a generator seeded with ``(seed, s)``, and
:func:`rank_slice` hands rank ``r`` rows ``[r*micro, (r+1)*micro)``. So ranks read disjoint rows of
each global batch, and a single process can rebuild exactly what all ranks trained on together.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

#: fewest bytes a corpus may have (anything smaller cannot hold a useful train/held-out split).
MIN_CORPUS_BYTES = 1024

Batch = tuple[torch.Tensor, torch.Tensor]


def default_text() -> str:
    """The stdlib documentation prose (``pydoc_data.topics``), values joined in sorted-key order."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


def load_text(path: str | os.PathLike | None = None, min_bytes: int = MIN_CORPUS_BYTES) -> str:
    """Read the corpus: ``path`` (any UTF-8 text file) or, when ``None``, :func:`default_text`.

    Args:
        path: file to read, or ``None`` for the stdlib prose.
        min_bytes: the text must encode to at least this many UTF-8 bytes (the caller passes a bound
            derived from ``seq_len``, see :func:`min_corpus_bytes`).

    Raises:
        ValueError: the file cannot be read, is not valid UTF-8, or is shorter than ``min_bytes``.
    """
    if path is None:
        text, where = default_text(), "pydoc_data.topics"
    else:
        where = os.fspath(path)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read data file {where!r}: {exc.strerror or exc}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"data file {where!r} is not UTF-8 text (invalid byte at offset {exc.start})") from None
    n = len(text.encode("utf-8"))
    if n < min_bytes:
        raise ValueError(f"corpus {where!r} has {n} bytes; at least {min_bytes} are needed")
    return text


def min_corpus_bytes(seq_len: int, heldout_fraction: float = 0.1) -> int:
    """Smallest corpus (bytes) whose held-out part still holds one ``seq_len + 1`` window."""
    return max(MIN_CORPUS_BYTES, int((seq_len + 2) / heldout_fraction) + 1)


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D ``torch.uint8`` tensor of length ``len(text.encode())``."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def decode(tokens: torch.Tensor) -> str:
    """Inverse of :func:`encode` for any integer tensor of byte values (flattened); invalid UTF-8
    sequences (e.g. a multi-byte character cut by sampling) become U+FFFD.

    Raises:
        ValueError: a value outside ``[0, 255]``.
    """
    flat = tokens.detach().reshape(-1).cpu()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) > 255):
        raise ValueError("decode expects byte values in [0, 255]")
    return bytes(flat.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def split(tokens: torch.Tensor, heldout_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous split: the first ``1 - heldout_fraction`` of ``tokens`` trains, the rest is held out.

    Returns:
        ``(train, heldout)``, 1-D views of ``tokens`` (same dtype).

    Raises:
        ValueError: ``heldout_fraction`` not in (0, 1) or ``tokens`` not 1-D.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    cut = int(round(tokens.numel() * (1.0 - heldout_fraction)))
    return tokens[:cut], tokens[cut:]


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> Batch:
    offsets = torch.arange(seq_len + 1)
    rows = tokens[starts[:, None] + offsets[None, :]].long()  # [n, seq_len + 1]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _check_len(tokens: torch.Tensor, seq_len: int, what: str) -> None:
    if tokens.dim() != 1:
        raise ValueError(f"{what} tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if tokens.numel() < seq_len + 1:
        raise ValueError(
            f"{what} split has {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            f"use a larger corpus or a smaller seq_len"
        )


@dataclass
class GlobalBatches:
    """Random ``seq_len`` windows for every rank of a data-parallel job, reproducible per micro-step.

    Attributes:
        tokens: 1-D integer tensor (e.g. ``uint8`` from :func:`encode`), the training split.
        seq_len: window length T.
        micro_batch_size: rows per rank per micro-step.
        world_size: number of ranks.
        seed: base seed; micro-step ``s`` uses a ``torch.Generator`` seeded from ``(seed, s)``.

    Raises:
        ValueError: sizes < 1, or ``tokens`` shorter than ``seq_len + 1``.
    """

    tokens: torch.Tensor
    seq_len: int
    micro_batch_size: int
    world_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        _check_len(self.tokens, self.seq_len, "training")

    @property
    def global_batch_size(self) -> int:
        """Rows per micro-step over all ranks: ``micro_batch_size * world_size``."""
        return self.micro_batch_size * self.world_size

    def generator(self, step: int) -> torch.Generator:
        """CPU generator for micro-step ``step``, seeded from ``(seed, step)`` alone."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return torch.Generator().manual_seed((self.seed * 1_000_003 + step) % (2**63 - 1))

    def batch(self, step: int) -> Batch:
        """The global batch of micro-step ``step``.

        Returns:
            ``(x, y)``, each ``[micro_batch_size * world_size, seq_len]`` ``torch.long``, with
            ``y[i, t] == x[i, t + 1]`` (next-byte targets).
        """
        high = self.tokens.numel() - self.seq_len  # window start in [0, high)
        starts = torch.randint(0, high, (self.global_batch_size,), generator=self.generator(step))
        return _windows(self.tokens, starts, self.seq_len)

    def __iter__(self) -> Iterator[Batch]:
        """Global batches of micro-steps 0, 1, 2, ... (endless)."""
        step = 0
        while True:
            yield self.batch(step)
            step += 1


T_ = TypeVar("T_", torch.Tensor, tuple[torch.Tensor, ...])


def rank_slice(global_batch: T_, rank: int, world_size: int) -> T_:
    """Rank ``rank``'s rows ``[rank*micro, (rank+1)*micro)`` of a global batch (a tensor or a tuple of
    tensors with equal first dimension ``micro * world_size``).

    Raises:
        ValueError: rank out of ``[0, world_size)`` or a first dimension not divisible by world_size.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if isinstance(global_batch, tuple):
        return tuple(rank_slice(t, rank, world_size) for t in global_batch)
    n = global_batch.shape[0]
    if n % world_size:
        raise ValueError(f"global batch of {n} rows does not split evenly over {world_size} ranks")
    micro = n // world_size
    return global_batch[rank * micro : (rank + 1) * micro]


def heldout_batches(heldout: torch.Tensor, seq_len: int, batch: int, n_batches: int) -> list[Batch]:
    """Deterministic evaluation batches: ``batch * n_batches`` windows whose starts are spread evenly
    over the held-out split (no randomness, so every run and every rank sees the same data).

    Returns:
        ``n_batches`` pairs ``(x, y)``, each ``[batch, seq_len]`` ``torch.long``, ``y`` shifted by one.

    Raises:
        ValueError: ``batch`` or ``n_batches`` < 1, or ``heldout`` shorter than ``seq_len + 1``.
    """
    if batch < 1 or n_batches < 1:
        raise ValueError(f"batch and n_batches must be >= 1, got {batch} and {n_batches}")
    _check_len(heldout, seq_len, "held-out")
    n = batch * n_batches
    last = heldout.numel() - seq_len - 1
    starts = torch.linspace(0, last, n).round().long()
    x, y = _windows(heldout, starts, seq_len)
    return [(x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]) for i in range(n_batches)]
