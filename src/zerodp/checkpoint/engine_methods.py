"""The engine's checkpoint methods (``save_checkpoint``, ``load_checkpoint``, ``module_state_dict``,
``load_module_state_dict``, ``save_16bit_model``) as a mixin the engine inherits: each agrees on the call with the other
ranks, makes offloaded states resident and hands over to :mod:`zerodp.checkpoint.save`,
:mod:`~zerodp.checkpoint.load`, :mod:`~zerodp.checkpoint.layout` or
:mod:`zerodp.runtime.module_state`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch

from zerodp.checkpoint import layout, load, save, weights16
from zerodp.checkpoint.protocol import CheckpointableEngine
from zerodp.runtime.module_state import GatheredCopy, LoadResult, load_module_state


class CheckpointMethods:
    """Mixed into :class:`zerodp.engine.Engine`; uses its ``collective_call``, ``shards_resident``,
    ``optimizer_offload``, ``optimizer``, ``topology``, ``sharding``, ``module``, ``groups``, ``frozen``,
    ``process_group``, ``ledger``, ``config``, ``stage`` and ``rank``."""

    # attributes and methods the engine provides
    collective_call: Any
    shards_resident: Any
    optimizer_offload: Any
    optimizer: torch.optim.Optimizer
    topology: Any
    sharding: Any
    module: torch.nn.Module
    groups: list
    frozen: list
    process_group: Any
    ledger: Any
    config: Any
    stage: int
    rank: int

    def save_checkpoint(
        self,
        save_dir: Any,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        exclude_frozen_parameters: bool = False,
    ) -> Any:
        """Collective: write a sharded checkpoint to ``save_dir/<tag>`` (default ``global_step{N}``) and
        point ``save_dir/latest`` at it; returns that directory. ``exclude_frozen_parameters``: only trained
        parameters and their optimizer states. See :func:`zerodp.checkpoint.save_checkpoint`."""
        with self.collective_call("save_checkpoint"), self._states_resident():
            return save.save_checkpoint(
                cast(CheckpointableEngine, self),
                self._checkpoint_dir(save_dir),
                tag,
                client_state,
                exclude_frozen_parameters,
            )

    def load_checkpoint(
        self, load_dir: Any, tag: str | None = None, load_optimizer_states: bool = True
    ) -> tuple[Any, Any]:
        """Collective: load ``load_dir/<tag>`` (default: ``latest``), saved at any world size and stage;
        returns (checkpoint directory, client_state). ``load_optimizer_states=False``: the optimizer's
        state and hyperparameters stay (e.g. a checkpoint saved with another optimizer). See
        :func:`zerodp.checkpoint.load_checkpoint`."""
        with self.collective_call("load_checkpoint"), self._states_resident(write=True):
            return load.load_checkpoint(
                cast(CheckpointableEngine, self), self._checkpoint_dir(load_dir), tag, load_optimizer_states
            )

    def save_16bit_model(
        self, save_dir: Any, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Collective: write the full weights in the module's dtype (bf16/fp16 under mixed precision) to
        ``save_dir/save_filename`` with ``torch.save`` on rank 0; returns True on every rank once the file
        exists (DeepSpeed's method). ``exclude_frozen_parameters``: without parameters whose
        ``requires_grad`` is False. See :func:`zerodp.checkpoint.weights16.save_16bit_model`.

        Raises:
            ValueError: stage 3 without ``zero_optimization.stage3_gather_16bit_weights_on_model_save``.
        """
        return weights16.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def _checkpoint_dir(self, d: Any) -> Any:
        """``d``, or with model parallelism ``d/mp_rank_XX``: each model-parallel rank's DP group
        saves and loads its own parameter shards (the same names hold different slices)."""
        return os.path.join(d, f"mp_rank_{self.topology.mp_rank:02d}") if self.topology.model_parallel else d

    def load_module_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> LoadResult:
        """Collective: load a full state dict (keys and shapes of ``module.state_dict()``, e.g. from
        :meth:`module_state_dict` or a plain PyTorch model) into this rank's parameters or shards and
        fp32 master weights, at any stage and precision; optimizer states are kept. Every rank must pass
        the same values. See :func:`zerodp.runtime.module_state.load_module_state`.

        Raises:
            RuntimeError: missing/unexpected keys with ``strict``, a shape mismatch, or ranks passing
                different values.
        """
        gathered = []
        if self.sharding is not None:
            gathered = [
                GatheredCopy(u.group, u.full)
                for u in self.sharding.units
                if u.full is not None and u.full.untyped_storage().nbytes() > 0
            ]
        with self._states_resident(write=True):  # NVMe offload: masters are placeholders between steps
            return load_module_state(
                self.module, self.groups, self.frozen, gathered, state_dict, strict, self.process_group, self.ledger
            )

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """Full state dict keyed like ``module.state_dict()``, fresh copies, on every rank (a
        collective): trained parameters in fp32 (the fp32 masters under bf16/fp16), frozen parameters
        and buffers in the module's dtype."""
        with self.collective_call("module_state_dict"), self._states_resident():
            return layout.module_state_dict(cast(CheckpointableEngine, self))  # the Engine this is mixed into

    @contextlib.contextmanager
    def _states_resident(self, write: bool = False) -> Iterator[None]:
        """Offloaded masters, optimizer states and parameter shards as ordinary tensors for the duration
        of a block (``write``: the block may change the shards)."""
        with self.optimizer_offload.resident(self.optimizer), self.shards_resident(write=write):
            yield


__all__ = ["CheckpointMethods"]
