"""Process groups for data parallelism: gloo on CPU, nccl on CUDA; rank helpers; teardown that never hangs."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

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


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def world_from_env() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


@contextlib.contextmanager
def process_group(timeout_s: int = DEFAULT_TIMEOUT_S) -> Iterator[Context]:
    """One process group for the duration of the block; `destroy_process_group` always runs."""
    rank, world_size, local_rank = world_from_env()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
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
