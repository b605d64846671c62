"""``deepspeed.ops``: DeepSpeed's optimizer classes as torch's kernels (:mod:`zerodp.deepspeed.ops.adam`)."""

from zerodp.deepspeed.ops import adam

__all__ = ["adam"]
