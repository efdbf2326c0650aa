"""GPTQ's recipe arguments and how ranks share a weight's rows: torch-free, read by the algorithm's object
(`methods.gptq`) and its math (`algorithms.gptq`) alike."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.grids.schemes import SchemeError

ROW_BLOCK = 128  # weight rows solved as one unit: every GEMM's shape is fixed, however the rows are shared out


@dataclass(frozen=True)
class GPTQArgs:
    block_size: int = 128  # columns updated lazily together (rounded up to a multiple of the group size)
    dampening_frac: float = 0.01  # H += dampening_frac * mean(diag H) * I
    actorder: bool = False  # round columns in order of decreasing H_ii (static groups)
    static_groups: bool = False  # group qparams chosen up front from the weight, not as GPTQ reaches each group

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise SchemeError("block_size", f"{self.block_size} is not allowed; use a positive number of columns")
        if self.dampening_frac <= 0:
            raise SchemeError("dampening_frac", f"{self.dampening_frac} is not allowed; use a positive fraction such as 0.01")


def row_share(rows: int, world_size: int, rank: int) -> slice:
    """The rows of a weight this rank solves: a contiguous run of whole ROW_BLOCKs, shared out as evenly as the
    blocks allow (the last block may be short). Over all ranks the shares cover every row once, in order."""
    blocks = -(-rows // ROW_BLOCK)
    first, last = blocks * rank // world_size, blocks * (rank + 1) // world_size
    return slice(min(rows, first * ROW_BLOCK), min(rows, last * ROW_BLOCK))
