"""What :class:`zerodp.deepspeed.engine.DeepSpeedEngine` saves and loads, with DeepSpeed's names and
signatures: full state dicts (``state_dict``, ``load_state_dict``), 16-bit weights
(``save_16bit_model``, ``_zero3_consolidated_16bit_state_dict`` for accelerate and the HF Trainer), and
checkpoints (``save_checkpoint`` / ``load_checkpoint`` over :mod:`zerodp.checkpoint`, ``client_state``
kept with torch.save). Every method but ``zero_gather_16bit_weights_on_model_save`` is collective.

What differs from DeepSpeed is refused, never ignored: ``load_checkpoint(load_module_strict=False)``
and ``load_checkpoint(custom_load_fn=...)`` raise ``NotImplementedError`` naming the argument.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zerodp.checkpoint.weights16 import module_dtype_state_dict
from zerodp.engine import Engine
from zerodp.zero import GatheredParameters

#: client_state is stored with torch.save in the checkpoint directory under this name (DeepSpeed users
#: keep tensors and RNG states there); zerodp's JSON client_state then holds only this marker.
CLIENT_STATE_FILE = "client_state.pt"
CLIENT_STATE_MARKER = "__zerodp_deepspeed_client_state__"


class DeepSpeedCheckpointMethods:
    """Mixed into :class:`~zerodp.deepspeed.engine.DeepSpeedEngine`; uses its zerodp ``engine``."""

    engine: Engine

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (accelerate asks before saving)."""
        return bool(self.engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """Collective: the full module state dict in the module's dtype on rank 0 (None on the other
        ranks), as DeepSpeed's (accelerate's ``get_state_dict`` calls it at stage 3; the HF Trainer
        with ``exclude_frozen_parameters=True`` for a PEFT model: without the parameters whose
        ``requires_grad`` is False, buffers kept)."""
        sd = self.engine.module_state_dict()
        if self.engine.rank != 0:
            return None
        return module_dtype_state_dict(self.engine, sd, exclude_frozen_parameters)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the full module state dict on every rank (:meth:`zerodp.Engine.module_state_dict`)."""
        return self.engine.module_state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Collective: copy full tensors (keyed like ``module.state_dict()``) into the partitioned model,
        its fp32 masters included.

        Raises:
            KeyError: ``strict`` and a key is missing or unexpected (names them).
            ValueError: a shape differs.
        """
        targets = dict(self.engine.module.named_parameters(remove_duplicate=False))
        buffers = dict(self.engine.module.named_buffers())
        if strict:
            missing = sorted((set(targets) | set(buffers)) - set(state_dict))
            extra = sorted(set(state_dict) - set(targets) - set(buffers))
            if missing or extra:
                raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {extra}")
        params = list({id(p): p for p in targets.values()}.values())
        with GatheredParameters(params, modifier_rank=0):
            with torch.no_grad():
                for name, p in targets.items():
                    if name in state_dict:
                        src = state_dict[name]
                        if tuple(src.shape) != tuple(p.shape):
                            raise ValueError(
                                f"load_state_dict: {name} has shape {tuple(src.shape)}, the model {tuple(p.shape)}"
                            )
                        p.copy_(src)
        for name, b in buffers.items():
            if name in state_dict:
                b.copy_(state_dict[name])

    def save_16bit_model(
        self, save_dir: Any, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Collective: :meth:`zerodp.Engine.save_16bit_model` (the full weights in the module's dtype
        to ``save_dir/save_filename``, rank 0; True).

        Raises:
            ValueError: stage 3 without ``zero_optimization.stage3_gather_16bit_weights_on_model_save``
                (DeepSpeed then writes nothing and returns False).
        """
        return self.engine.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    def save_checkpoint(
        self,
        save_dir: Any,
        tag: Any = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Collective: DeepSpeed's signature over :meth:`zerodp.Engine.save_checkpoint`. ``tag`` may be
        an int; ``client_state`` may hold tensors and any picklable object (stored with torch.save in the
        checkpoint directory, and returned as saved); ``save_latest=False`` leaves ``latest`` as it was.

        ``exclude_frozen_parameters=True`` writes only the trained parameters and their optimizer states
        (see :func:`zerodp.checkpoint.save_checkpoint`).
        """
        tag = None if tag is None else str(tag)
        latest = Path(save_dir) / "latest"
        before = latest.read_text(encoding="utf-8") if latest.is_file() else None
        path = self.engine.save_checkpoint(
            save_dir, tag, {CLIENT_STATE_MARKER: CLIENT_STATE_FILE}, exclude_frozen_parameters=exclude_frozen_parameters
        )
        if self.engine.rank == 0:
            torch.save(dict(client_state or {}), Path(path) / CLIENT_STATE_FILE)
            if not save_latest:
                if before is None:
                    latest.unlink()
                else:
                    latest.write_text(before, encoding="utf-8")
        if dist.get_world_size(self.engine.process_group) > 1:
            dist.barrier(self.engine.process_group)
        return True

    def load_checkpoint(
        self,
        load_dir: Any,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[Any, Any]:
        """Collective: DeepSpeed's signature over :meth:`zerodp.Engine.load_checkpoint`.

        Returns ``(checkpoint path, client_state)``, or ``(None, None)`` with a warning when ``tag`` is
        None and ``load_dir`` holds no ``latest`` file (as DeepSpeed). ``load_optimizer_states=False``
        keeps the current optimizer state; ``load_lr_scheduler_states=False`` the current scheduler
        state; ``load_module_only=True`` loads only the module (optimizer, scheduler, loss scaler,
        step counters and RNG states are kept).

        Raises:
            NotImplementedError: ``load_module_strict=False`` or ``custom_load_fn``.
            zerodp.checkpoint.CheckpointError: as :meth:`zerodp.Engine.load_checkpoint`.
        """
        if not load_module_strict:
            raise NotImplementedError("load_checkpoint(load_module_strict=False) is not implemented")
        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not implemented")
        d = Path(load_dir)
        if tag is None and not (d / "latest").is_file() and not (d / "meta.json").is_file():
            warnings.warn(f"load_checkpoint: no 'latest' file in {d}; nothing loaded", stacklevel=2)
            return None, None
        e = self.engine
        keep_opt = load_module_only or not load_optimizer_states
        keep_sched = load_module_only or not load_lr_scheduler_states
        opt_state = copy.deepcopy(e.optimizer.state_dict()) if keep_opt else None
        sched_state = copy.deepcopy(e.lr_scheduler.state_dict()) if keep_sched and e.lr_scheduler else None
        counters = (e.global_steps, e.micro_steps, e.skipped_steps, e.ledger.steps)
        scaler = copy.deepcopy(e.loss_scaler.__dict__) if e.loss_scaler is not None else None
        rng = torch.get_rng_state()
        path, state = e.load_checkpoint(load_dir, None if tag is None else str(tag), load_optimizer_states=not keep_opt)
        if opt_state is not None:
            e.optimizer.load_state_dict(opt_state)
        if sched_state is not None:
            assert e.lr_scheduler is not None  # kept only from the engine's scheduler
            e.lr_scheduler.load_state_dict(sched_state)
        if load_module_only:
            e.global_steps, e.micro_steps, e.skipped_steps, e.ledger.steps = counters
            if scaler is not None:
                e.loss_scaler.__dict__.update(scaler)
            torch.set_rng_state(rng)
        if isinstance(state, dict) and state.get(CLIENT_STATE_MARKER) == CLIENT_STATE_FILE:
            state = torch.load(Path(path) / CLIENT_STATE_FILE, weights_only=False)
        return path, state


__all__ = ["CLIENT_STATE_FILE", "CLIENT_STATE_MARKER", "DeepSpeedCheckpointMethods"]
