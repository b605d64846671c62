""":class:`HfDeepSpeedConfig`: the config reader accelerate and transformers build around a DeepSpeed
config (``accelerate.utils.deepspeed.HfDeepSpeedConfig``, which transformers subclasses), with the
methods their integrations call: ``is_zero2()``, ``is_zero3()``, ``is_offload()``, ``get_value``,
``is_true``/``is_false``, ``find_config_node``, ``del_config_sub_tree`` and the ``config`` dict.

It only reads the config; it does not make transformers' ``from_pretrained`` build under
``zero.Init`` (transformers' own ``HfDeepSpeedConfig`` does that, and needs ``deepspeed`` importable:
see ``zerodp.deepspeed.register_as_deepspeed`` where available).
"""

from __future__ import annotations

import base64
import copy
import json
import os
from typing import Any


class HfDeepSpeedConfig:
    """A DeepSpeed config (dict, JSON file path, or base64-encoded JSON, as accelerate takes).

    Raises:
        ValueError: ``config_file_or_dict`` is none of those.
    """

    def __init__(self, config_file_or_dict: Any) -> None:
        if isinstance(config_file_or_dict, dict):
            config = copy.deepcopy(config_file_or_dict)
        elif isinstance(config_file_or_dict, (str, os.PathLike)) and os.path.exists(config_file_or_dict):
            with open(config_file_or_dict, encoding="utf-8") as f:
                config = json.load(f)
        else:
            try:
                config = json.loads(base64.urlsafe_b64decode(config_file_or_dict).decode("utf-8"))
            except (ValueError, TypeError, UnicodeDecodeError):
                raise ValueError(
                    "HfDeepSpeedConfig expects a dict, a path to a JSON file or base64-encoded "
                    f"JSON, got {config_file_or_dict!r}"
                ) from None
        self.config: dict[str, Any] = config
        self.set_stage_and_offload()

    def set_stage_and_offload(self) -> None:
        self._stage = self.get_value("zero_optimization.stage", -1)
        self._offload = False
        if self.is_zero2() or self.is_zero3():
            devices = {
                self.get_value("zero_optimization.offload_optimizer.device"),
                self.get_value("zero_optimization.offload_param.device"),
            }
            self._offload = bool(devices & {"cpu", "nvme"})

    def find_config_node(self, ds_key_long: str) -> tuple[dict | None, str]:
        """``(the dict holding the last key of the dotted path, that key)``; ``(None, key)`` if a parent
        is missing."""
        config: Any = self.config
        *parents, ds_key = ds_key_long.split(".")
        for node in parents:
            config = config.get(node) if isinstance(config, dict) else None
            if config is None:
                return None, ds_key
        return config, ds_key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        config, ds_key = self.find_config_node(ds_key_long)
        if config is None:
            return default
        return config.get(ds_key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        """Delete the dotted key's sub-tree; ``must_exist``: a missing key raises ``ValueError``."""
        config: Any = self.config
        *parents, last = ds_key_long.split(".")
        for node in parents:
            config = config.get(node) if isinstance(config, dict) else None
            if config is None:
                if must_exist:
                    raise ValueError(f"Can't find {ds_key_long} entry in the config: {self.config}")
                return
        if isinstance(config, dict):
            config.pop(last, None)

    def is_true(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else not bool(value)

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        return self._offload


__all__ = ["HfDeepSpeedConfig"]
