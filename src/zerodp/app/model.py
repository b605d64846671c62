"""A small decoder-only GPT over a byte-level vocabulary, the model the ``zerodp train`` job trains.

Shapes use ``B`` (batch), ``T`` (sequence length, at most ``GPTConfig.seq_len``), ``D`` (``d_model``),
``H`` (``n_head``) and ``V`` (``vocab_size``, 256 for UTF-8 bytes). Token ids are ``torch.long``;
activations, logits and the loss are in the parameters' dtype (``torch.float32`` by default).

:func:`count_parameters` gives the exact parameter count from a :class:`GPTConfig` without building the
model (``zerodp estimate`` uses it), and :func:`generate` samples from any callable that returns
``(logits, loss)``, so it works on a bare :class:`GPT` and on a zerodp engine wrapping one alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPT`.

    Attributes:
        n_layer: number of transformer blocks, >= 1.
        n_head: attention heads per block, >= 1; must divide ``d_model``.
        d_model: residual stream width, >= 1.
        seq_len: longest context in tokens (size of the learned position table), >= 1.
        vocab_size: number of token ids, >= 1 (256 for bytes).
        tie_embeddings: share one ``[V, D]`` matrix between ``tok_emb`` and ``head``.
        dropout: dropout probability in [0, 1) on embeddings, attention and residual branches.

    Raises:
        ValueError: a field has the wrong type or is out of range; the message names the field and
            the allowed values.
    """

    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 128
    vocab_size: int = 256
    tie_embeddings: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an integer >= 1, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by GPTConfig.n_head "
                f"({self.n_head}); allowed n_head values for this d_model: "
                f"{[h for h in range(1, self.d_model + 1) if self.d_model % h == 0]}"
            )
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"GPTConfig.tie_embeddings must be True or False, got {self.tie_embeddings!r}")
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, (int, float))
            or not 0.0 <= float(self.dropout) < 1.0
        ):
            raise ValueError(f"GPTConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        self.dropout = float(self.dropout)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Build from a mapping of field names (e.g. a JSON model config).

        Raises:
            ValueError: an unknown key (the message lists the allowed ones) or an invalid value.
        """
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(allowed))
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s) {unknown}; allowed fields: {allowed}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``[B, T, D] -> [B, T, D]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # [D] -> [3D] (q, k, v)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)  # each [B, T, D]
        # [B, T, D] -> [B, H, T, D/H]
        q, k, v = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # [B, H, T, D/H]
        y = y.transpose(1, 2).reshape(B, T, D)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward ``D -> 4D -> D`` with GELU: ``[B, T, D] -> [B, T, D]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``; ``[B, T, D]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Submodules: ``tok_emb`` (``nn.Embedding(V, D)``), ``pos_emb`` (``nn.Embedding(seq_len, D)``),
    ``blocks`` (``nn.ModuleList`` of :class:`Block`), ``ln_f`` (``nn.LayerNorm(D)``) and ``head``
    (``nn.Linear(D, V, bias=False)``; its weight *is* ``tok_emb.weight`` when ``tie_embeddings``).

    Weights are initialised GPT-2 style from the global torch RNG (normal, std 0.02; residual output
    projections scaled by ``1/sqrt(2 n_layer)``), so seeding with ``torch.manual_seed`` before
    construction gives identical models on every rank.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits and, given targets, their mean cross-entropy.

        Args:
            idx: ``[B, T]`` ``torch.long`` token ids in ``[0, V)``, ``T <= seq_len``.
            targets: optional ``[B, T]`` ``torch.long`` ids of the next token at each position.

        Returns:
            ``(logits, loss)``: logits ``[B, T, V]`` float; loss a float scalar (nats per token, mean
            over all ``B*T`` positions) or ``None`` without targets.

        Raises:
            ValueError: ``idx`` is not 2-D or ``T`` exceeds ``seq_len``.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must be [B, T], got shape {tuple(idx.shape)}")
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # [B, T, D]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # [B, T, V]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def count_parameters(cfg: GPTConfig) -> int:
    """Exact number of parameter elements of ``GPT(cfg)``, the tied matrix counted once.

    Per block: two LayerNorms (``2 * 2D``), qkv (``3D^2 + 3D``), attention projection (``D^2 + D``),
    MLP (``4D^2 + 4D`` and ``4D^2 + D``): ``12 D^2 + 13 D``. Plus embeddings ``V D + seq_len D``, the
    final LayerNorm ``2D`` and, untied, the head ``V D``.
    """
    d, v = cfg.d_model, cfg.vocab_size
    per_block = 12 * d * d + 13 * d
    total = v * d + cfg.seq_len * d + cfg.n_layer * per_block + 2 * d
    if not cfg.tie_embeddings:
        total += v * d
    return total


@torch.no_grad()
def generate(
    model_callable: Callable[[torch.Tensor], tuple[torch.Tensor, Any]],
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Autoregressively extend ``idx`` by sampling from ``model_callable``.

    Args:
        model_callable: ``f(idx [B, t] long) -> (logits [B, t, V], anything)``: a :class:`GPT`, or a
            zerodp engine wrapping one (``engine(idx)``); put it in eval mode first.
        idx: ``[B, T0]`` ``torch.long`` prompt ids (``T0 >= 1``).
        max_new_tokens: tokens to append, >= 0.
        temperature: logits are divided by it; ``0`` means greedy (argmax).
        top_k: sample only among the ``top_k`` most likely tokens (``None``: all).
        generator: torch RNG for sampling; pass one seeded identically on every rank so that ranks
            running generation together produce the same text.
        seq_len: longest context fed to the model; the context is cropped to its last ``seq_len``
            tokens. Default: ``cfg.seq_len`` of the callable (or of its ``.module``).

    Returns:
        ``[B, T0 + max_new_tokens]`` ``torch.long``: the prompt followed by the sampled tokens.

    Raises:
        ValueError: negative ``max_new_tokens`` or ``temperature``, ``top_k < 1``, or no ``seq_len``
            given and none found on the callable.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if seq_len is None:
        seq_len = _find_seq_len(model_callable)
    for _ in range(max_new_tokens):
        context = idx[:, -seq_len:]
        logits, _ = model_callable(context)
        logits = logits[:, -1, :].float()  # [B, V]
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def _find_seq_len(model_callable: Any) -> int:
    for obj in (model_callable, getattr(model_callable, "module", None)):
        cfg = getattr(obj, "cfg", None)
        if isinstance(cfg, GPTConfig):
            return cfg.seq_len
    raise ValueError("cannot find GPTConfig.seq_len on model_callable (or its .module); pass seq_len=")
