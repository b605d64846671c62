"""``zerodp.deepspeed.runtime.zero``: DeepSpeed's ``deepspeed.runtime.zero`` import paths."""

from zerodp.deepspeed.zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]
