"""AWQ: a transform before the quantizer, activation-aware weight scales searched per block on calibration data."""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantkit.algorithms.base import Algorithm, register
from quantkit.grids.schemes import SchemeError


@dataclass(frozen=True)
class AWQArgs:
    grid: int = 20  # ratios k / grid, k = 0 .. grid - 1, tried for each block
    # calibration tokens (all ranks) each candidate is scored on, taken as the first rows of every batch; the
    # statistics use every token. None: every token. 128 x 2048: llm-compressor's AWQ at its usual size, and a
    # quarter of the grid's work at 512 x 2048, where it is most of AWQ's time (an 8B layer: 23 s of 25 on an H200)
    grid_tokens: int | None = 128 * 2048

    def __post_init__(self) -> None:
        if self.grid < 1:
            raise SchemeError("grid", f"{self.grid} is not allowed; use at least 1 (1 is plain RTN)")
        if self.grid_tokens is not None and self.grid_tokens < 1:
            raise SchemeError("grid_tokens", f"{self.grid_tokens} is not allowed; use a positive count, or null for every token")


@register
class AWQ(Algorithm):
    name = "awq"
    Arguments = AWQArgs
    quantizer = False
    step = "awq"
    searches_blocks = True

    def grid_share(self, args: AWQArgs, batches: list[range], num_samples: int, seq_len: int) -> float:
        """The share of a rank's rows (`batches`) the grid scores, and so keeps of its blocks' inputs
        (`calibration.steps.awq.scored_rows` over all ranks' `num_samples` x `seq_len` tokens): 1 without a limit."""
        total = num_samples * seq_len
        rows = sum(map(len, batches))
        if args.grid_tokens is None or total <= args.grid_tokens or not rows:
            return 1.0
        return sum(max(1, math.ceil(len(b) * args.grid_tokens / total)) for b in batches) / rows
