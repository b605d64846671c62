"""``deepspeed.runtime.zero.partition_parameters``: :class:`ZeroParamStatus` (what ``param.ds_status``
reads on a partitioned parameter), ``Init`` and ``GatheredParameters`` (those of
:mod:`zerodp.deepspeed.zero`)."""

from zerodp.deepspeed.zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]
