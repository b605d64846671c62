"""The batch keys of the config and their arithmetic, as DeepSpeed resolves them.

``train_batch_size`` = ``train_micro_batch_size_per_gpu`` x ``gradient_accumulation_steps`` x world
size (DeepSpeed ``runtime/config.py``, ``_batch_assertion`` and ``_set_batch_related_parameters``):
:meth:`BatchConfig.for_world_size` derives the missing key or refuses three that disagree, and
:meth:`BatchConfig.require_batch_size` refuses a config that gives no batch size. Both raise
:class:`~zerodp.config_base.ConfigError` naming the keys and the numbers.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import Field

from zerodp.config_base import ConfigError, StrictModel

_Batch = TypeVar("_Batch", bound="BatchConfig")


class BatchConfig(StrictModel):
    """The three batch keys (samples); :class:`zerodp.config.ZeroDPConfig` extends this with the rest."""

    train_batch_size: int | None = Field(
        None, gt=0, description="global batch = micro batch x accumulation steps x world size"
    )
    train_micro_batch_size_per_gpu: int = Field(1, gt=0, description="samples per rank per micro-step")
    gradient_accumulation_steps: int = Field(1, gt=0, description="micro-steps per optimizer step")

    def for_world_size(self: _Batch, world_size: int) -> _Batch:
        """Resolve the batch keys as DeepSpeed does: train_batch_size = micro x accumulation x world.

        Given ``train_batch_size`` and one of the other two, the missing one is derived; given only
        ``train_batch_size``, accumulation is 1 and the micro batch is ``train_batch_size / world``.

        Raises:
            ConfigError: the three disagree, or the derived value is not a whole number.
        """
        tbs = self.train_batch_size
        if tbs is None:
            return self
        given = self.model_fields_set
        micro, gas = self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        update: dict[str, int] = {}
        if "train_micro_batch_size_per_gpu" not in given:
            if tbs % (gas * world_size):
                raise ConfigError(
                    f"train_batch_size={tbs} is not divisible by gradient_accumulation_steps "
                    f"({gas}) x world size ({world_size}); set train_micro_batch_size_per_gpu"
                )
            update["train_micro_batch_size_per_gpu"] = micro = tbs // (gas * world_size)
        elif "gradient_accumulation_steps" not in given:
            if tbs % (micro * world_size):
                raise ConfigError(
                    f"train_batch_size={tbs} is not divisible by train_micro_batch_size_per_gpu "
                    f"({micro}) x world size ({world_size})"
                )
            update["gradient_accumulation_steps"] = gas = tbs // (micro * world_size)
        implied = micro * gas * world_size
        if implied != tbs:
            raise ConfigError(
                f"train_batch_size={tbs} must equal train_micro_batch_size_per_gpu ({micro}) x "
                f"gradient_accumulation_steps ({gas}) x world size ({world_size}) = {implied}"
            )
        return self.model_copy(update=update) if update else self

    def require_batch_size(self: _Batch, source: str) -> _Batch:
        """Refuse a config that gives no batch size, as DeepSpeed does: it needs ``train_batch_size``
        or ``train_micro_batch_size_per_gpu`` (``gradient_accumulation_steps`` alone is not enough).

        Used where the config decides how many samples a rank trains on (``zerodp train --config``,
        ``zerodp.deepspeed.initialize``); plain :func:`zerodp.initialize` trains on what the script
        feeds it and does not call this.

        Args:
            source: what gave the config (a file path, ``"initialize()"``), named in the message.

        Returns:
            ``self``.

        Raises:
            ConfigError: neither key is set.
        """
        if {"train_batch_size", "train_micro_batch_size_per_gpu"} & self.model_fields_set:
            return self
        raise ConfigError(
            f"invalid zerodp config: {source} gives no batch size; set 'train_micro_batch_size_per_gpu' "
            "(samples per rank per micro-step) or 'train_batch_size' (micro batch x "
            "gradient_accumulation_steps x world size), as DeepSpeed requires"
        )
