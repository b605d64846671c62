"""Memory-centric tiling (ZeRO-Infinity paper, section 5.1.3): :class:`TiledLinear`, a linear layer
computed tile by tile, re-exported as ``zerodp.zero.TiledLinear`` (DeepSpeed's
``deepspeed.zero.TiledLinear``, same arguments and method names).

The ``(out_features, in_features)`` weight is cut into ``out_splits x in_splits`` tiles, each an
``nn.Linear`` submodule of its own. At stage 3 each submodule is its own unit (see [Note: units] in
:mod:`zerodp.stage3.units`), so only the tile that is running is gathered: a layer far larger than the
gather budget (``stage3_max_live_parameters``) trains while at most one tile (plus prefetched ones)
is whole in memory. Under :class:`zerodp.zero.Init` each tile is partitioned as soon as it is
appended to its row, before the next tile is allocated, so the whole weight never exists on a rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from zerodp.stage3.gathered import GatheredParameters


def split_sizes(features: int, splits: int) -> list[int]:
    """``features`` cut into ``splits`` contiguous parts whose sizes differ by at most one (the first
    ``features % splits`` parts get the extra element). Both must satisfy ``1 <= splits <= features``."""
    base, extra = divmod(features, splits)
    return [base + (1 if i < extra else 0) for i in range(splits)]


def _check_splits(name: str, splits: object, features: object, features_name: str) -> None:
    if not isinstance(features, int) or isinstance(features, bool) or features < 1:
        raise ValueError(f"TiledLinear: {features_name} must be a positive int, got {features!r}")
    if not isinstance(splits, int) or isinstance(splits, bool) or not 1 <= splits <= features:
        raise ValueError(f"TiledLinear: {name} must be an int in [1, {features_name}={features}], got {splits!r}")


class TiledLinear(nn.Module):
    """``y = x W^T + b`` computed as ``out_splits x in_splits`` tiles (``nn.Linear`` submodules), so at
    stage 3 only one tile's parameters need to be gathered at a time.

    Tile ``linears[o][i]`` holds ``W[rows_o, cols_i]``; only the last tile of each row
    (``i == in_splits - 1``) has a bias (``b[rows_o]``). Output row block ``o`` is
    ``sum_i x[..., cols_i] @ W[rows_o, cols_i]^T (+ b[rows_o])``, summed in order ``i = 0, 1, ...``;
    the blocks are concatenated along the last dimension. Rows and columns are split into contiguous
    parts whose sizes differ by at most one (:func:`split_sizes`), so any ``features`` works.

    Outputs and gradients equal ``nn.Linear``'s with the same weights up to floating-point summation
    order (with ``in_splits == 1`` the tiles are row blocks of one matmul; with more, partial products
    are added). Newly built tiles are initialised like ``nn.Linear(in_features, out_features)`` (uniform
    in ``+-1/sqrt(in_features)`` for weight and bias, the whole layer's fan-in), not with each tile's
    own fan-in as DeepSpeed's tiles are; ``copy_params_from`` loads exact weights.

    Args:
        in_features, out_features: the full layer's sizes (>= 1).
        bias: whether the layer has a bias (``out_features`` elements).
        in_splits: tiles along the input dimension, in ``[1, in_features]``.
        out_splits: tiles along the output dimension, in ``[1, out_features]``.
        input_is_already_split: ``forward`` receives a sequence of ``in_splits`` tensors, chunk ``i``
            holding columns ``cols_i`` (DeepSpeed's argument).
        combine_out_splits: False: ``forward`` returns the list of ``out_splits`` row blocks instead of
            their concatenation (DeepSpeed's argument).
        linear_cls: the tile class, called as ``linear_cls(in, out, bias=..., **kwargs)`` (default
            ``nn.Linear``; another class keeps its own initialisation).
        init_linear: an ``nn.Linear`` whose weights are copied in (see :meth:`copy_params_from`).
        **kwargs: passed to ``linear_cls`` (e.g. ``dtype``, ``device``).

    Shapes:
        input ``(*, in_features)``; output ``(*, out_features)`` (or ``out_splits`` tensors
        ``(*, len(rows_o))``).

    Raises:
        ValueError: a size is not a positive int or a split count is outside its range.

    Source: DeepSpeed ``deepspeed/runtime/zero/tiling.py`` (``TiledLinear``); ZeRO-Infinity (Rajbhandari
    et al., 2021) section 5.1.3, memory-centric tiling.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls: type = nn.Linear,
        init_linear: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        _check_splits("in_splits", in_splits, in_features, "in_features")
        _check_splits("out_splits", out_splits, out_features, "out_features")
        self.in_features, self.out_features = in_features, out_features
        self.use_bias = bool(bias)
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_sizes = split_sizes(in_features, in_splits)
        self.out_sizes = split_sizes(out_features, out_splits)
        #: CSR-style boundaries (DeepSpeed's names): part p is [parts[p], parts[p + 1])
        self.in_parts = [0, *_cumsum(self.in_sizes)]
        self.out_parts = [0, *_cumsum(self.out_sizes)]
        bound = 1.0 / math.sqrt(in_features)
        self.linears = nn.ModuleList()
        for rows in self.out_sizes:
            row = nn.ModuleList()
            self.linears.append(row)  # registered first: under Init each tile is partitioned on append
            for i, cols in enumerate(self.in_sizes):
                tile = linear_cls(cols, rows, bias=self.use_bias and i == in_splits - 1, **kwargs)
                if linear_cls is nn.Linear:
                    with torch.no_grad():
                        tile.weight.uniform_(-bound, bound)
                        if tile.bias is not None:
                            tile.bias.uniform_(-bound, bound)
                row.append(tile)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        if self.input_is_already_split:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise ValueError(
                    f"TiledLinear: input_is_already_split expects {self.in_splits} chunks, got {len(inputs)}"
                )
        else:
            x = input_
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.in_features:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"TiledLinear: input must be (*, {self.in_features}), got {got}")
            inputs = list(torch.split(x, self.in_sizes, dim=-1)) if self.in_splits > 1 else [x]
        outputs: list[torch.Tensor] = []
        for row in cast(Sequence[nn.ModuleList], self.linears):  # rows of tiles, as built in __init__
            acc = row[0](inputs[0])
            for i in range(1, self.in_splits):
                acc = acc + row[i](inputs[i])
            outputs.append(acc)
        if not self.combine_out_splits:
            return outputs
        return outputs[0] if self.out_splits == 1 else torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Load ``other.weight`` (``(out_features, in_features)``) and ``other.bias`` into the tiles.

        Works on plain modules and on partitioned ones (stage 3, :class:`zerodp.zero.Init`), on either
        side: ``other``'s parameters are gathered once (read only), then each tile in turn is gathered,
        written and re-partitioned (``GatheredParameters(..., modifier_rank=0)``), so at most ``other``
        plus one tile is whole at a time. With several ranks this is a collective (every rank must
        call it) and rank 0's ``other`` is what every rank ends up with (DeepSpeed's semantics).

        Raises:
            ValueError: ``other`` has no weight, its weight's shape differs, or its bias does not match
                this layer's (present with the right shape iff ``bias=True``).
        """
        weight = getattr(other, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"copy_params_from needs a module with a 'weight' tensor, got {type(other).__name__}")
        src_bias = getattr(other, "bias", None)
        with GatheredParameters([p for p in (weight, src_bias) if isinstance(p, torch.Tensor)]):
            expected = (self.out_features, self.in_features)
            if tuple(weight.shape) != expected:
                raise ValueError(
                    f"copy_params_from: weight has shape {tuple(weight.shape)}, this TiledLinear "
                    f"needs {expected} (out_features, in_features)"
                )
            if self.use_bias != isinstance(src_bias, torch.Tensor):
                raise ValueError(
                    f"copy_params_from: this TiledLinear has bias={self.use_bias} but the source "
                    f"has {'a' if src_bias is not None else 'no'} bias"
                )
            if src_bias is not None and tuple(src_bias.shape) != (self.out_features,):
                raise ValueError(
                    f"copy_params_from: bias has shape {tuple(src_bias.shape)}, needs ({self.out_features},)"
                )
            for o, row in enumerate(cast(Sequence[nn.ModuleList], self.linears)):  # rows of tiles
                r0, r1 = self.out_parts[o], self.out_parts[o + 1]
                for i, tile in enumerate(cast(Sequence[nn.Linear], row)):  # Linear-like: weight, bias
                    c0, c1 = self.in_parts[i], self.in_parts[i + 1]
                    params = [tile.weight] + ([tile.bias] if tile.bias is not None else [])
                    with GatheredParameters(params, modifier_rank=0):
                        tile.weight.copy_(weight[r0:r1, c0:c1])
                        if tile.bias is not None:
                            assert src_bias is not None  # checked above: a bias on both sides or neither
                            tile.bias.copy_(src_bias[r0:r1])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
            f"in_splits={self.in_splits}, out_splits={self.out_splits}"
        )


def _cumsum(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for s in sizes:
        total += s
        out.append(total)
    return out
