"""Process groups for data parallelism: gloo on CPU, nccl on CUDA; rank helpers; teardown that never hangs."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Callable, Iterator

import torch
import torch.distributed as dist

class ReduceOp(str, Enum):
    """How partial statistics of several ranks combine (each observer declares one per statistic)."""

    SUM = "sum"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


DEFAULT_TIMEOUT_S = 600  # a rank that fails makes the others fail within this bound, not hang forever


@dataclass(frozen=True)
class Context:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    grouped: bool = False  # a process group is initialised (every run under torchrun, one rank included)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Collectives run: several ranks, or one rank under torchrun (the same code path, e.g. nccl on one GPU)."""
        return self.world_size > 1 or self.grouped


def world_from_env() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def backend(device_type: str) -> str:
    """The process group backend for ranks computing on `device_type`: nccl for CUDA, gloo for the CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def rank_device(device: str | None, local_rank: int) -> torch.device:
    """This rank's device: its own GPU (`cuda:LOCAL_RANK`) when the command computes on CUDA (`device` None: when
    there is a GPU), else the CPU."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    return torch.device("cuda", local_rank) if cuda else torch.device("cpu")


@contextlib.contextmanager
def process_group(device: str | None = None, timeout: int | None = None) -> Iterator[Context]:
    """One process group for the duration of the block, when there are several ranks or this process runs under
    torchrun; `destroy_process_group` always runs at its end. Inside another such block, that block's group is used
    (one group a process: a second one, made after the first is destroyed, can meet the first's stale addresses in
    torchrun's store). `device`: the compute device the command was given (cpu, cuda, cuda:N; None: CUDA when there
    is a GPU), which picks the backend. Collectives time out after `timeout`
    seconds (default QUANTKIT_DIST_TIMEOUT or 600): a failed rank never hangs the others."""
    from quantkit.runtime.environment import under_torchrun

    rank, world_size, local_rank = world_from_env()
    here = rank_device(device, local_rank)
    grouped = world_size > 1 or under_torchrun()
    mine = grouped and not dist.is_initialized()  # inside another block's group: that one is used, and left to it
    if mine:
        if here.type == "cuda":
            torch.cuda.set_device(here)
        dist.init_process_group(backend(here.type), timeout=timedelta(seconds=timeout or timeout_s()))
    try:
        yield Context(rank=rank, world_size=world_size, local_rank=local_rank, device=here, grouped=grouped)
    finally:
        if mine and dist.is_initialized():
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


BUCKET_BYTES = 64 << 20  # statistics reduced in one collective up to this size (a larger one goes alone, in place)


def all_reduce_observer(observer, ctx: Context | None) -> None:
    """Every rank ends with the statistics over all ranks' data, each reduced with its declared op."""
    all_reduce_observers([observer], ctx)


def all_reduce_observers(observers: list, ctx: Context | None) -> None:
    """`all_reduce_observer` for several observers (a stage's, a layer's), bucketed: the statistics that reduce
    with one op and have one dtype go in one collective per BUCKET_BYTES (a GPTQ Hessian's row blocks and its
    token count: one all-reduce), not one per tensor. Elementwise the same reductions."""
    if ctx is None or not ctx.distributed:
        return
    by_op: dict[tuple, list[torch.Tensor]] = {}
    for observer in observers:
        for key, op in observer.REDUCE.items():
            for tensor in _tensors(observer.state[key]):
                by_op.setdefault((op, tensor.dtype, tensor.device), []).append(tensor)
    for (op, _, _), tensors in by_op.items():
        for bucket in _buckets(tensors):
            _all_reduce_bucket(bucket, _TORCH_OPS[op])
        if op is ReduceOp.AVG:
            for tensor in tensors:
                tensor /= ctx.world_size


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive tensors in groups of at most BUCKET_BYTES (one larger tensor alone)."""
    buckets, size = [[]], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return buckets


def _all_reduce_bucket(tensors: list[torch.Tensor], op) -> None:
    """One all-reduce for the bucket: in place for one contiguous tensor, else through one flat copy."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        dist.all_reduce(tensors[0], op)
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op)
    for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(part.view_as(tensor))


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


def computed_once(count: int, compute: Callable[[int], float], ctx: Context | None) -> list[float]:
    """`[compute(i) for i in range(count)]` on every rank, each `compute(i)` run on one rank only (rank i % world
    size) and shared in one all-reduce: float64 values that are zero on every other rank, so the sums are exact and
    every rank has the values a single process computes. For work every rank could do alike (same inputs on all)."""
    if ctx is None or not ctx.distributed:
        return [compute(i) for i in range(count)]
    values = torch.zeros(count, dtype=torch.float64, device=ctx.device)
    for i in range(ctx.rank, count, ctx.world_size):
        values[i] = compute(i)
    dist.all_reduce(values)
    return values.tolist()


def gathered_in_order(values: torch.Tensor, ctx: Context | None) -> torch.Tensor:
    """Every rank's `values` [k, n_rank] side by side in rank order [k, sum of n_rank], on every rank, exactly (one
    count exchange and one all-reduce of float64 columns that are zero outside their rank's). For per-batch
    statistics: ranks hold contiguous runs of the batches in rank order (`data.rank_batches`), so the columns
    come out in the batches' order, as one process holds them."""
    if ctx is None or not ctx.distributed:
        return values.to(torch.float64)
    counts = all_gather_int(values.shape[1], ctx)
    start = sum(counts[: ctx.rank])
    table = torch.zeros(values.shape[0], sum(counts), dtype=torch.float64, device=ctx.device)
    table[:, start : start + values.shape[1]] = values
    dist.all_reduce(table)
    return table


def all_gather_rows(tensors: list[torch.Tensor], shares: list[slice], ctx: Context | None) -> None:
    """Each rank has filled its rows (`shares[rank]`, along dim 0) of every tensor; every rank ends with all the
    rows. One broadcast per rank (gloo's all_gather needs equal sizes; shares may differ by a block), carrying that
    rank's rows of all the tensors packed as bytes when they come to at most BUCKET_BYTES (a GPTQ share's qdata,
    scales and zero points), else one per tensor, straight into place (no copy of large activations); the
    broadcasts are issued together and waited on once."""
    if ctx is None or not ctx.distributed:
        return
    pending = []
    for rank, rows in enumerate(shares):
        if rows.stop <= rows.start:
            continue
        parts = [tensor[rows] for tensor in tensors]  # contiguous: whole rows of contiguous tensors
        sizes = [part.numel() * part.element_size() for part in parts]
        if len(parts) == 1 or sum(sizes) > BUCKET_BYTES:
            pending += [(None, None, dist.broadcast(_bytes(part), src=rank, async_op=True)) for part in parts]
            continue
        if rank == ctx.rank:
            packed = torch.cat([_bytes(part).reshape(-1) for part in parts])
        else:
            packed = torch.empty(sum(sizes), dtype=torch.uint8, device=ctx.device)
        unpack = parts if rank != ctx.rank else None
        pending.append((unpack, packed.split(sizes), dist.broadcast(packed, src=rank, async_op=True)))
    for unpack, chunks, work in pending:
        work.wait()
        for part, chunk in zip(unpack or [], chunks or []):
            _bytes(part).copy_(chunk.view(_bytes(part).shape))


def broadcast_(tensor: torch.Tensor, src: int, ctx: Context | None, wait: bool = True):
    """Rank `src`'s values of `tensor` (contiguous: e.g. whole rows of a matrix) on every rank, in place; with
    `wait` False, the handle of the broadcast under way (its `wait()` returns once it is done here)."""
    if ctx is not None and ctx.distributed:
        return dist.broadcast(tensor, src=src, async_op=not wait)
    return None


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as bytes (gloo has no float8; a packed buffer has no dtype)."""
    return tensor.view(torch.uint8)
