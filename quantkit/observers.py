"""Observers: statistics gathered on calibration data, each declaring how it reduces across ranks.

An observer keeps named statistic tensors; `REDUCE` says, per statistic, how partial statistics from
several ranks (or several shards of the data) combine into the statistic over all of them: SUM, MIN, MAX,
or AVG. Reducing the partial states with the declared ops equals observing everything in one place
(tests check it), which is what makes calibration data-parallel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import ClassVar

import torch


class ReduceOp(str, Enum):
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


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
        """Fold other observers' states into this one with the declared reduce ops."""
        for key, op in self.REDUCE.items():
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

    Each batch's x^T x is one float32 product (`gram`); the sum over batches is float64. Calibration shares
    whole batches out to ranks (`data.rank_batches`), so a batch's product does not depend on the number of
    ranks, and float64 sums of float32 terms barely depend on their order: the float32 Hessian GPTQ uses
    comes out the same for 1 or N ranks."""

    REDUCE = {"xtx": ReduceOp.SUM, "count": ReduceOp.SUM}

    def update(self, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        xtx = gram(rows)
        if "xtx" in self.state:
            add_into(self.state["xtx"], xtx)  # float32 into the float64 sum, in place
            self.state["count"] += rows.shape[0]
        else:
            self.state["xtx"] = xtx.double()
            self.state["count"] = torch.tensor(float(rows.shape[0]), dtype=torch.float64, device=x.device)

    def hessian(self) -> torch.Tensor:
        """H = 2/n sum x x^T, the GPTQ normalisation."""
        if "xtx" not in self.state:
            raise ValueError("no calibration tokens reached this module; its Hessian is empty")
        xtx, factor = self.state["xtx"], 2.0 / self.state["count"].clamp(min=1.0)
        out = torch.empty(xtx.shape, dtype=torch.float32, device=xtx.device)
        for start in range(0, xtx.shape[0], _HESSIAN_ROWS):  # by row blocks: no float64 copy of the whole matrix
            out[start : start + _HESSIAN_ROWS] = xtx[start : start + _HESSIAN_ROWS] * factor
        return out

    def pop_hessian(self) -> torch.Tensor:
        """`hessian()`, freeing the float64 sums (the observer is done)."""
        hessian = self.hessian()
        self.state.clear()
        return hessian


_HESSIAN_ROWS = 256


def gram(rows: torch.Tensor) -> torch.Tensor:
    """rows^T rows for float32 rows [n, d]. On CPU through numpy, whose BLAS computes the symmetric product
    with syrk (half the work of a general matrix product; ~2.5x faster than torch.mm here); elsewhere torch."""
    if rows.device.type != "cpu":
        return rows.T @ rows
    array = rows.contiguous().numpy()
    return torch.from_numpy(array.T @ array)


def add_into(total: torch.Tensor, part: torch.Tensor) -> None:
    """total += part, in place, for a float64 total and a float32 part (numpy's mixed-type add on CPU is ~5x
    faster than torch's; the result is the same: each float32 value converts exactly, then one float64 add)."""
    if total.device.type != "cpu":
        total.add_(part)
        return
    import numpy

    array = total.numpy()
    numpy.add(array, part.contiguous().numpy(), out=array)
