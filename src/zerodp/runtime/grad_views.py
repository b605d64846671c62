"""``param.grad`` as views of a stage-2 bucket's staging buffer while the bucket is being filled.

[Note: gradient views] DDP's ``gradient_as_bucket_view``, per bucket and only for the time a bucket's
staging buffer exists. When the first gradient of a bucket arrives in a micro-step, the stage-2 reducer
(:class:`zerodp.runtime.partitioned_reducer.PartitionedGradReducer`) makes the bucket's staging
buffer, zeroed, and points ``param.grad`` of every trainable parameter of the bucket that has no
``.grad`` at its range (a view in the parameter's shape and memory format). Autograd then adds each
later gradient into that view in place (``torch.autograd``'s AccumulateGrad, case "existing grad"),
so the reducer's hook has nothing to copy; a gradient that autograd made itself (the bucket's first,
or an out-of-place sum) is copied into the view once. When the bucket is reduce-scattered, every
``.grad`` that is still one of these views is set back to None, so between ``engine.backward`` and the
next backward the parameters hold no gradient, as before, and the staging buffer is dropped with the
collective's payload. Memory is the staging buffers of the buckets being filled or in flight, as with
a copy per gradient; the host work per gradient is an identity check instead of three tensor ops.

:class:`BucketViews` makes the views of one bucket's buffer in one call where the bucket's slots are
back to back, row-major and non-empty (``torch._utils._unflatten_dense_tensors``), else one view per
slot (:meth:`zerodp.runtime.partition.ParamSlot.view`).
"""

from __future__ import annotations

import torch
from torch._utils import _unflatten_dense_tensors

from zerodp.runtime.partition import Bucket, ParamSlot


class BucketViews:
    """The views of bucket ``bucket``'s staging buffer (1-D, ``bucket.numel`` elements) in the shapes of
    its trainable parameters (``slots``: a subset of ``bucket.slots``), in the order of ``slots``."""

    def __init__(self, bucket: Bucket, slots: list[ParamSlot]) -> None:
        self.bucket = bucket
        self.slots = slots
        ordered = sorted(bucket.slots, key=lambda s: s.offset)
        end = bucket.start
        one_call = True
        for s in ordered:
            one_call = one_call and s.offset == end and s.stride is None and s.numel > 0
            end = s.offset + s.numel
        #: shapes of every slot of the bucket back to back (meta tensors: only their sizes are read),
        #: or None where one view per slot is made
        self._templates = [torch.empty(s.shape, device="meta") for s in ordered] if one_call else None
        self._used = end - bucket.start
        position = {id(s): i for i, s in enumerate(ordered)}
        self._pick = [position[id(s)] for s in slots]

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """One view of ``buf`` per slot of ``slots``: its range, its parameter's shape and strides."""
        if self._templates is not None:
            made = _unflatten_dense_tensors(buf[: self._used], self._templates)
            return [made[i] for i in self._pick]
        start = self.bucket.start
        return [s.view(buf[s.offset - start : s.offset - start + s.numel]) for s in self.slots]


__all__ = ["BucketViews"]
