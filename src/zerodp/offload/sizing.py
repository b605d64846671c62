"""How large the NVMe optimizer swapper's host buffers are: ``sub_group_size`` chosen from a host
budget when the user did not set it, and the bytes the buffers take as configured.

The swapper (:mod:`zerodp.offload.nvme`) holds ``buffer_count`` buffers of the largest sub-group's
region (``segments`` x 4 bytes per element: fp32 masters, ``exp_avg``, ``exp_avg_sq``; the masters
segment is left out when the module's own fp32 tensors on the CPU serve as masters) and, when the
gradients are in host memory in a low-precision dtype, an fp32 scratch of the largest sub-group.
DeepSpeed's default ``sub_group_size`` (1e9 elements) makes one sub-group of a whole partition, so
those buffers are several times the states they were meant to move off. zerodp therefore chooses
``sub_group_size`` itself unless the user set the key: the largest multiple of :data:`SPLIT_ALIGN`
elements whose buffers fit in ``offload_optimizer.host_buffer_bytes`` (zerodp's own key, default
256 MiB) and in :data:`AUTO_SHARE` of the bytes moved off, but at least :data:`MIN_AUTO_NUMEL`.
A ``sub_group_size`` the user set is honoured; when its buffers are larger than the bytes moved off,
:func:`oversize_warning` says so with the numbers.

Sources: DeepSpeed ``zero_optimization.sub_group_size``, ``offload_optimizer.buffer_count``;
ZeRO-Infinity (Rajbhandari et al., SC21) section 5.2 (the pipelined optimizer swap).
"""

from __future__ import annotations

from dataclasses import dataclass

#: a piece cut between two sub-groups is cut at a multiple of this many elements from its start
#: (the elementwise optimizer kernels then process each element as in one call over the whole piece)
SPLIT_ALIGN = 1 << 16
#: the chosen sub-group's buffers take at most this share of the bytes moved off the host
AUTO_SHARE = 0.08
#: ... but a chosen sub-group has at least this many elements (one direct-I/O read of >= 512 KiB)
MIN_AUTO_NUMEL = SPLIT_ALIGN


@dataclass(frozen=True)
class BufferLayout:
    """Host bytes per element of a sub-group: ``segments`` fp32 segments per buffer (3, or 2 when the
    module's tensors are the masters), ``count`` buffers, ``scratch`` fp32 gradient scratch (0 or 1)."""

    segments: int
    count: int
    scratch: int

    @property
    def bytes_per_element(self) -> int:
        return 4 * (self.segments * self.count + self.scratch)

    def host_bytes(self, subgroup_numel: int) -> int:
        """Host bytes of the buffers and scratch for sub-groups of ``subgroup_numel`` elements."""
        return self.bytes_per_element * subgroup_numel


def moved_off_bytes(owned_numel: int, masters_moved: bool) -> int:
    """Bytes of optimizer partition the NVMe offload takes out of host memory: Adam moments (8 per
    element) and the fp32 masters (4) when they are a copy of their own (bf16/fp16, or a device other
    than the CPU)."""
    return (12 if masters_moved else 8) * owned_numel


def auto_sub_group_size(owned_numel: int, layout: BufferLayout, budget_bytes: int, masters_moved: bool) -> int:
    """The ``sub_group_size`` zerodp uses when the user did not set it (module docstring).

    Args:
        owned_numel: elements of this rank's optimizer partition.
        layout: the swapper's buffers.
        budget_bytes: ``offload_optimizer.host_buffer_bytes``.
        masters_moved: whether the masters move off too (:func:`moved_off_bytes`).

    Returns:
        a multiple of :data:`SPLIT_ALIGN` elements, >= :data:`MIN_AUTO_NUMEL`.
    """
    cap = min(budget_bytes, AUTO_SHARE * moved_off_bytes(owned_numel, masters_moved))
    numel = int(cap // layout.bytes_per_element) // SPLIT_ALIGN * SPLIT_ALIGN
    return max(MIN_AUTO_NUMEL, numel)


def oversize_warning(
    sub_group_size: int, largest_numel: int, layout: BufferLayout, owned_numel: int, masters_moved: bool
) -> str | None:
    """The warning for a ``sub_group_size`` the user set whose buffers take more host memory than the
    offload moves off (None when they take less)."""
    buffers = layout.host_bytes(largest_numel)
    moved = moved_off_bytes(owned_numel, masters_moved)
    if buffers <= moved:
        return None
    return (
        f"zero_optimization.sub_group_size {sub_group_size:,} makes the NVMe offload's host buffers "
        f"{buffers:,} bytes ({layout.count} buffer(s) x {4 * layout.segments} bytes + "
        f"{4 * layout.scratch} bytes of scratch per element of the largest sub-group, "
        f"{largest_numel:,} elements) while it moves {moved:,} bytes of optimizer state off host "
        f"memory: offloading costs this rank {buffers - moved:,} bytes more than it saves. Leave "
        f"sub_group_size unset (zerodp then chooses it from offload_optimizer.host_buffer_bytes) or "
        f"set it below {max(1, moved // layout.bytes_per_element):,}"
    )


def configured_buffers(
    owned_numel: int,
    user_sub_group_size: int | None,
    buffer_count: int,
    budget_bytes: int,
    in_place: bool,
    deferred: bool,
) -> tuple[int, BufferLayout]:
    """(``sub_group_size``, buffer layout) the NVMe swapper uses for ``owned_numel`` elements: the
    user's size or :func:`auto_sub_group_size`; ``in_place``: the module's fp32 CPU tensors are the
    masters (2 segments, no scratch); ``deferred``: gradients in host memory (a low-precision scratch).
    The buffer count is ``buffer_count`` but at most the number of sub-groups."""
    plan = BufferLayout(2 if in_place else 3, buffer_count, 0 if in_place else 1)
    size = user_sub_group_size or auto_sub_group_size(owned_numel, plan, budget_bytes, not in_place)
    subgroups = max(1, -(-owned_numel // max(1, size)))
    return size, BufferLayout(plan.segments, max(1, min(buffer_count, subgroups)), 0 if in_place or not deferred else 1)


def estimate_offload_bytes(
    owned_numel: int,
    user_sub_group_size: int | None,
    buffer_count: int,
    budget_bytes: int,
    in_place: bool,
    grad_itemsize: int,
    spill: bool,
) -> dict[str, int]:
    """Host and NVMe bytes of one rank's NVMe optimizer offload as configured (CPU training), before
    padding to 4096 bytes per segment: ``host_buffers`` (the sub-group pool and gradient scratch, as
    :meth:`zerodp.offload.nvme.NvmeOptimizerOffload.attach` sizes them), ``host_gradient_reads`` (with
    ``spill``: the gradient swap file's read buffers, a sub-group's per sub-group buffer),
    ``nvme_states`` (masters, unless ``in_place``, and Adam moments) and ``nvme_gradients`` (with
    ``spill``)."""
    size, layout = configured_buffers(owned_numel, user_sub_group_size, buffer_count, budget_bytes, in_place, True)
    largest = min(size, owned_numel)
    return {
        "sub_group_size": size,
        "buffer_count": layout.count,
        "host_buffers": layout.host_bytes(largest),
        "host_gradient_reads": layout.count * grad_itemsize * largest if spill else 0,
        "nvme_states": 4 * layout.segments * owned_numel,
        "nvme_gradients": grad_itemsize * owned_numel if spill else 0,
    }


__all__ = [
    "AUTO_SHARE",
    "BufferLayout",
    "MIN_AUTO_NUMEL",
    "SPLIT_ALIGN",
    "auto_sub_group_size",
    "configured_buffers",
    "estimate_offload_bytes",
    "moved_off_bytes",
    "oversize_warning",
]
