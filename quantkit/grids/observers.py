"""Observers: statistics gathered on calibration data, each declaring how it reduces across ranks.

An observer keeps named statistic tensors; `REDUCE` says, per statistic, how partial statistics from
several ranks (or several shards of the data) combine into the statistic over all of them: SUM, MIN, MAX,
or AVG. Reducing the partial states with the declared ops equals observing everything in one place
(tests check it), which is what makes calibration data-parallel.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from quantkit.runtime.distributed import ReduceOp
from quantkit.runtime.precision import tf32_products


def reduce_parts(parts: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Combine partial statistics locally (the same op `distributed.all_reduce` applies across ranks)."""
    stacked = torch.stack(parts)
    if op is ReduceOp.SUM:
        return stacked.sum(0)
    if op is ReduceOp.MIN:
        return stacked.amin(0)
    if op is ReduceOp.MAX:
        return stacked.amax(0)
    return stacked.mean(0)


class Observer(ABC):
    """Base: `update(x)` with a batch of inputs [..., features]; `state` holds the statistics."""

    REDUCE: ClassVar[dict[str, ReduceOp]] = {}

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    @abstractmethod
    def update(self, x: torch.Tensor) -> None:
        """Fold one batch into the statistics."""

    def merge(self, others: list["Observer"]) -> None:
        """Fold other observers' states into this one with the declared reduce ops (a statistic kept as a list of
        tensors reduces element by element)."""
        for key, op in self.REDUCE.items():
            if isinstance(self.state[key], list):
                self.state[key] = [reduce_parts(list(parts), op) for parts in zip(self.state[key], *(o.state[key] for o in others))]
            else:
                self.state[key] = reduce_parts([self.state[key], *(o.state[key] for o in others)], op)


def activation_observer(name: str) -> type[Observer]:
    return {"static_minmax": StaticMinMax, "minmax": MeanMinMax}[name]


class StaticMinMax(Observer):
    """Min and max over every value seen (static per-tensor activation ranges)."""

    REDUCE = {"min": ReduceOp.MIN, "max": ReduceOp.MAX}

    def update(self, x: torch.Tensor) -> None:
        low, high = x.detach().float().amin(), x.detach().float().amax()
        self.state["min"] = torch.minimum(self.state["min"], low) if "min" in self.state else low
        self.state["max"] = torch.maximum(self.state["max"], high) if "max" in self.state else high

    def absmax(self) -> torch.Tensor:
        return torch.maximum(self.state["min"].abs(), self.state["max"].abs())


class MeanMinMax(Observer):
    """The mean over batches of each batch's min and max: a range less driven by one outlier batch than
    StaticMinMax's. Kept as sums and a batch count, all reduced by SUM (exact across ranks)."""

    REDUCE = {"min_sum": ReduceOp.SUM, "max_sum": ReduceOp.SUM, "batches": ReduceOp.SUM}

    def update(self, x: torch.Tensor) -> None:
        low, high = x.detach().float().amin(), x.detach().float().amax()
        one = torch.ones((), device=x.device)
        for key, value in (("min_sum", low), ("max_sum", high), ("batches", one)):
            self.state[key] = self.state[key] + value if key in self.state else value

    def absmax(self) -> torch.Tensor:
        batches = self.state["batches"]
        return torch.maximum((self.state["min_sum"] / batches).abs(), (self.state["max_sum"] / batches).abs())


class ChannelAbsMax(Observer):
    """Per input channel max |x| (SmoothQuant's activation statistic)."""

    REDUCE = {"absmax": ReduceOp.MAX}

    def update(self, x: torch.Tensor) -> None:
        value = x.detach().float().reshape(-1, x.shape[-1]).abs().amax(0)
        self.state["absmax"] = torch.maximum(self.state["absmax"], value) if "absmax" in self.state else value


class ChannelAbsMean(Observer):
    """Per input channel mean |x| (AWQ's activation statistic), kept as a float64 sum and a token count (SUM):
    the float32 mean comes out the same whatever the order of summation (whatever the number of ranks)."""

    REDUCE = {"abs_sum": ReduceOp.SUM, "count": ReduceOp.SUM}

    def update(self, x: torch.Tensor) -> None:
        rows = x.detach().double().reshape(-1, x.shape[-1])
        value = rows.abs().sum(0)
        count = torch.tensor(float(rows.shape[0]), dtype=torch.float64, device=rows.device)
        self.state["abs_sum"] = self.state["abs_sum"] + value if "abs_sum" in self.state else value
        self.state["count"] = self.state["count"] + count if "count" in self.state else count

    def mean(self) -> torch.Tensor:
        return (self.state["abs_sum"] / self.state["count"].clamp(min=1.0)).float()


class HessianObserver(Observer):
    """GPTQ's Hessian, kept as an un-normalized sum of x x^T and a token count: both reduce by SUM.

    The sum is symmetric, so only its upper triangle is kept, in row blocks of HESSIAN_ROWS: `xtx` is a list
    whose block b holds rows [b*R, (b+1)*R) from column b*R on, float64 (half the memory of the whole matrix;
    for the 5632 inputs of a 1B model's down_proj, 127 MB instead of 254). Each batch adds one float32 product
    per block (`gram_blocks`: together the work of one symmetric product, never a whole float32 copy).
    Calibration shares whole batches out to ranks (`data.rank_batches`), so a batch's products do not depend
    on the number of ranks, and float64 sums of float32 terms barely depend on their order: the float32
    Hessian GPTQ uses comes out the same for 1 or N ranks."""

    REDUCE = {"xtx": ReduceOp.SUM, "count": ReduceOp.SUM}

    @staticmethod
    def accumulator_bytes(width: int) -> int:
        """Bytes of the float64 upper-triangle blocks of a `width`-input Hessian (`update`'s accumulator)."""
        return 8 * sum(min(HESSIAN_ROWS, width - start) * (width - start) for start in range(0, width, HESSIAN_ROWS))

    def update(self, x: torch.Tensor) -> None:
        """Add a batch's tokens, HESSIAN_CHUNK_TOKENS at a time: a float32 copy of a chunk, not of the batch (the
        down projection's inputs for 8 x 2048 tokens of a 5632-wide MLP would be a 352 MiB copy)."""
        tokens = x.detach().reshape(-1, x.shape[-1])
        exact_tf32 = tokens.dtype in (torch.bfloat16, torch.float16)
        for start in range(0, tokens.shape[0], HESSIAN_CHUNK_TOKENS):
            self._add(tokens[start:start + HESSIAN_CHUNK_TOKENS].float(), exact_tf32)

    def _add(self, rows: torch.Tensor, exact_tf32: bool = False) -> None:
        if "xtx" not in self.state:
            self.state["xtx"] = [part.double() for part in gram_blocks(rows, exact_tf32)]
            self.state["count"] = torch.tensor(float(rows.shape[0]), dtype=torch.float64, device=rows.device)
            return
        for total, part in zip(self.state["xtx"], gram_blocks(rows, exact_tf32)):
            add_into(total, part)  # float32 into the float64 sum, in place
        self.state["count"] += rows.shape[0]

    def xtx(self) -> torch.Tensor:
        """The whole sum of x x^T, float32 (symmetric)."""
        return self._symmetric(lambda count: 1.0, release=False)

    def hessian(self) -> torch.Tensor:
        """H = 2/n sum x x^T, the GPTQ normalisation."""
        return self._symmetric(_gptq_scale, release=False)

    def pop_hessian(self) -> torch.Tensor:
        """`hessian()`, freeing each float64 block as soon as it is copied out (the observer is done)."""
        return self._symmetric(_gptq_scale, release=True)

    def _symmetric(self, scale, release: bool) -> torch.Tensor:
        if "xtx" not in self.state:
            raise ValueError("no calibration tokens reached this module; its Hessian is empty")
        blocks, factor = self.state["xtx"], scale(self.state["count"])
        size = blocks[0].shape[1]
        out = torch.empty((size, size), dtype=torch.float32, device=blocks[0].device)
        for b in range(len(blocks)):
            start = b * HESSIAN_ROWS
            part = (blocks[b] * factor).float()
            if release:
                blocks[b] = None
            stop = start + part.shape[0]
            out[start:, start:stop] = part.T  # the lower triangle, mirrored
            out[start:stop, start:] = part
            square = part[:, : stop - start]  # its own diagonal block: made exactly symmetric from its upper triangle
            out[start:stop, start:stop] = square.triu() + square.triu(1).T
        if release:
            self.state.clear()
        return out


HESSIAN_ROWS = 256
HESSIAN_CHUNK_TOKENS = 4096  # a CPU calibration batch (8 x 512 tokens) is one chunk, as before


def _gptq_scale(count: torch.Tensor) -> torch.Tensor:
    return 2.0 / count.clamp(min=1.0)


def gram_blocks(rows: torch.Tensor, exact_tf32: bool = False) -> list[torch.Tensor]:
    """The upper triangle of rows^T rows (float32 rows [n, d]) in row blocks of HESSIAN_ROWS: block b is
    rows[:, bR:(b+1)R]^T rows[:, bR:]. On CPU through numpy's BLAS (whose products here ran ~2.5x faster than
    torch.mm's); elsewhere torch. `exact_tf32`: the rows are 16-bit values (a bf16 or fp16 model's activations),
    which TF32 holds exactly, so a CUDA GPU multiplies them on its tensor cores in TF32, products summed in float32:
    the same terms as float32's, at ~8x its rate (an 8B model's down projection Hessian for 512 x 2048 tokens is
    0.4 PFLOP a layer)."""
    size = rows.shape[1]
    if rows.device.type != "cpu":
        with tf32_products(rows.device) if exact_tf32 else contextlib.nullcontext():
            return [rows[:, s : s + HESSIAN_ROWS].T @ rows[:, s:] for s in range(0, size, HESSIAN_ROWS)]
    array = rows.contiguous().numpy()
    return [torch.from_numpy(array[:, s : s + HESSIAN_ROWS].T @ array[:, s:]) for s in range(0, size, HESSIAN_ROWS)]


def add_into(total: torch.Tensor, part: torch.Tensor) -> None:
    """total += part, in place, for a float64 total and a float32 part (numpy's mixed-type add on CPU is ~5x
    faster than torch's; the result is the same: each float32 value converts exactly, then one float64 add)."""
    if total.device.type != "cpu":
        total.add_(part)
        return
    import numpy

    array = total.numpy()
    numpy.add(array, part.contiguous().numpy(), out=array)
