"""``deepspeed.comm``: DeepSpeed's communication functions over ``torch.distributed`` (``from
zerodp.deepspeed import comm as dist``).

Each function takes DeepSpeed's arguments and calls the ``torch.distributed`` function of the same
meaning on the same group. DeepSpeed's comms-logging keywords (``prof``, ``log_name``, ``debug``) are
accepted and do nothing (zerodp has no comms logger; ``log_summary`` prints that). This is not
zerodp's internal :mod:`zerodp.runtime.comm`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as _dist
from torch.distributed import ProcessGroup, ReduceOp

from zerodp.runtime import comm as _runtime_comm

Group = ProcessGroup | None


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: Any = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """``deepspeed.comm.init_distributed``: the same as :func:`zerodp.deepspeed.init_distributed`."""
    from zerodp.deepspeed import init_distributed as _init

    _init(
        dist_backend=dist_backend,
        auto_mpi_discovery=auto_mpi_discovery,
        distributed_port=distributed_port,
        verbose=verbose,
        timeout=timeout,
        init_method=init_method,
        dist_init_required=dist_init_required,
        config=config,
        rank=rank,
        world_size=world_size,
    )


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def is_available() -> bool:
    return _dist.is_available()


def get_rank(group: Group = None) -> int:
    return _dist.get_rank(group)


def get_world_size(group: Group = None) -> int:
    return _dist.get_world_size(group)


def get_local_rank() -> int:
    """``LOCAL_RANK`` from the launcher's environment (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_world_group() -> ProcessGroup | None:
    return _dist.group.WORLD


def get_global_rank(group: Group = None, group_rank: int = 0) -> int:
    return _dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_backend(group: Group = None) -> str:
    return _dist.get_backend(group)


def new_group(ranks: Any) -> ProcessGroup:
    return _dist.new_group(ranks)


def destroy_process_group(group: Group = None) -> None:
    if group is None:
        _runtime_comm.shutdown_distributed()
    else:
        _dist.destroy_process_group(group)


def barrier(
    group: Group = None,
    async_op: bool = False,
    device_ids: Any = None,
    prof: bool = False,
    log_name: str = "barrier",
    debug: Any = None,
) -> Any:
    return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Group = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
    return _dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: Any = None,
) -> Any:
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


#: DeepSpeed's inference variant takes all_reduce's arguments; over torch.distributed it is the same call
inference_all_reduce = all_reduce


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce",
    debug: Any = None,
) -> Any:
    return _dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "broadcast",
    debug: Any = None,
) -> Any:
    return _dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather",
    debug: Any = None,
) -> Any:
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, tensor: torch.Tensor, group: Group = None, async_op: bool = False, debug: Any = None
) -> Any:
    return _runtime_comm.all_gather_single(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
    debug: Any = None,
) -> Any:
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Group = None) -> None:
    _dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list[Any], src: int, group: Group = None, device: Any = None) -> None:
    _dist.broadcast_object_list(object_list, src, group=group, device=device)


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter_tensor",
    debug: Any = None,
) -> Any:
    return _runtime_comm.reduce_scatter_single(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    debug: Any = None,
) -> Any:
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter",
    debug: Any = None,
) -> Any:
    return _dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: Any = None,
    input_split_sizes: Any = None,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_to_all_single",
    debug: Any = None,
) -> Any:
    return _dist.all_to_all_single(
        output,
        tensor,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=group,
        async_op=async_op,
    )


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Group = None,
    async_op: bool = False,
) -> Any:
    return _dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: Any = None,
    dst: int = 0,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "gather",
    debug: Any = None,
) -> Any:
    return _dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: Any = None,
    src: int = 0,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "scatter",
    debug: Any = None,
) -> Any:
    return _dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def send(
    tensor: torch.Tensor,
    dst: int,
    group: Group = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "send",
    debug: Any = None,
) -> None:
    _dist.send(tensor, dst, group=group, tag=tag)


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Group = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "recv",
    debug: Any = None,
) -> int:
    return _dist.recv(tensor, src=src, group=group, tag=tag)


def isend(
    tensor: torch.Tensor,
    dst: int,
    group: Group = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "isend",
    debug: Any = None,
) -> Any:
    return _dist.isend(tensor, dst, group=group, tag=tag)


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Group = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "irecv",
    debug: Any = None,
) -> Any:
    return _dist.irecv(tensor, src=src, group=group, tag=tag)


def configure(
    deepspeed_config: Any = None,
    enabled: Any = None,
    prof_all: Any = None,
    prof_ops: Any = None,
    verbose: Any = None,
    debug: Any = None,
) -> None:
    """DeepSpeed's comms-logger configuration: zerodp has no comms logger (nothing to configure)."""


def log_summary(show_straggler: bool = False) -> None:
    """DeepSpeed prints its comms log here; zerodp has none (``engine.comm_report()`` gives the
    engine's own traffic)."""
    if is_initialized() and get_rank() == 0:
        print("[zerodp] deepspeed.comm.log_summary: no comms logger in zerodp; see engine.comm_report()")


__all__ = [
    "ReduceOp",
    "init_distributed",
    "is_initialized",
    "is_available",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_world_group",
    "get_global_rank",
    "get_backend",
    "new_group",
    "destroy_process_group",
    "barrier",
    "monitored_barrier",
    "all_reduce",
    "inference_all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "allgather_fn",
    "all_gather_object",
    "broadcast_object_list",
    "reduce_scatter_tensor",
    "reduce_scatter_fn",
    "reduce_scatter",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "configure",
    "log_summary",
]
