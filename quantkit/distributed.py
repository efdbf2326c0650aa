"""Process groups for data parallelism: gloo on CPU, nccl on CUDA; rank helpers; teardown that never hangs."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from quantkit.observers import ReduceOp

DEFAULT_TIMEOUT_S = 600  # a rank that fails makes the others fail within this bound, not hang forever


@dataclass(frozen=True)
class Context:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def world_from_env() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


@contextlib.contextmanager
def process_group(timeout: int | None = None) -> Iterator[Context]:
    """One process group for the duration of the block; `destroy_process_group` always runs. Collectives time
    out after `timeout` seconds (default QUANTKIT_DIST_TIMEOUT or 600): a failed rank never hangs the others."""
    rank, world_size, local_rank = world_from_env()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout or timeout_s()))
    try:
        yield Context(rank=rank, world_size=world_size, local_rank=local_rank, device=device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def all_reduce_mean(value: float, ctx: Context) -> float:
    if not ctx.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor)
    return tensor.item() / ctx.world_size


def barrier(ctx: Context) -> None:
    if ctx.distributed:
        dist.barrier()


# ---------------------------------------------------------------- calibration collectives

# AVG is summed, then divided by the world size (gloo has no AVG)
_TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX,
              ReduceOp.AVG: dist.ReduceOp.SUM}


def timeout_s() -> int:
    return int(os.environ.get("QUANTKIT_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))


def all_reduce_observer(observer, ctx: Context | None) -> None:
    """Every rank ends with the statistics over all ranks' data, each reduced with its declared op."""
    if ctx is None or not ctx.distributed:
        return
    for key, op in observer.REDUCE.items():
        for tensor in _tensors(observer.state[key]):
            dist.all_reduce(tensor, _TORCH_OPS[op])
            if op is ReduceOp.AVG:
                tensor /= ctx.world_size


def _tensors(statistic) -> list[torch.Tensor]:
    """A statistic's tensors (observers keep a large one as a list of blocks)."""
    return statistic if isinstance(statistic, list) else [statistic]


def all_reduce_sum(value: float, ctx: Context | None) -> float:
    if ctx is None or not ctx.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor)
    return tensor.item()


def all_gather_int(value: int, ctx: Context | None) -> list[int]:
    """Every rank's `value`, in rank order, on every rank."""
    if ctx is None or not ctx.distributed:
        return [value]
    tensor = torch.zeros(ctx.world_size, dtype=torch.int64, device=ctx.device)
    tensor[ctx.rank] = value
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_(tensor: torch.Tensor, ctx: Context | None) -> None:
    """`tensor` summed over all ranks, in place, on every rank."""
    if ctx is not None and ctx.distributed:
        dist.all_reduce(tensor)


def all_gather_rows(tensors: list[torch.Tensor], shares: list[slice], ctx: Context | None) -> None:
    """Each rank has filled its rows (`shares[rank]`, along dim 0) of every tensor; every rank ends with all the
    rows. One broadcast per rank and tensor (gloo's all_gather needs equal sizes; shares may differ by a block)."""
    if ctx is None or not ctx.distributed:
        return
    for rank, rows in enumerate(shares):
        if rows.stop > rows.start:
            for tensor in tensors:
                part = tensor[rows]
                dist.broadcast(part.view(torch.uint8) if part.dtype == torch.float8_e4m3fn else part, src=rank)  # gloo has no float8
