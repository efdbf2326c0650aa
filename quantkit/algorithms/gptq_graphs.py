"""GPTQ's per-column loop on CUDA as one captured graph per sub-block.

GPTQ rounds a weight one column at a time; each column is a dozen small elementwise kernels (round onto the grid,
the scaled error, its update of the sub-block's later columns), and on a GPU their launches, not their arithmetic,
take the time: a 0.84B Llama's GPTQ spent 44 s of launches (H200, 16 layers x 11776 columns). `SubBlockGraph`
records those kernels for one sub-block of SUB_BLOCK columns once (a CUDA graph) and replays them for every
sub-block of the same shape: the sub-block's columns, its block of the inverse-Hessian factor and its group's
qparams are copied into the graph's own input tensors, the graph replays, and the grid integers and scaled errors
are copied out. The kernels are the ones the eager loop runs, on the same values, so the result is the eager
loop's bit for bit (checked on the first sub-block of every new shape; a mismatch turns graphs off for the run).

Used for integer grids. Rounded left to right, every column of a sub-block shares one group's qparams; in actorder's
order (static groups) the columns of a sub-block come from several groups, and each column's qparams are copied in
beside it (`per_column`). `QUANTKIT_CUDA_GRAPHS=0` turns it off.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable

import torch

_GRAPHS: dict[tuple, "SubBlockGraph"] = {}  # one per shape, for the process's life (a few KB of inputs each)
_STATE = {"enabled": os.environ.get("QUANTKIT_CUDA_GRAPHS", "1") != "0", "checked": set()}


class SubBlock:
    """One sub-block's column loop over input tensors of its own: `run` copies a sub-block in, runs the loop
    (`body`), and copies the grid integers and scaled errors out. Eager here; `SubBlockGraph` replays it."""

    def __init__(self, size: int, rows: int, dtype: torch.dtype, scale_dtype: torch.dtype, zero_dtype: torch.dtype | None,
                 qrange: tuple[int, int], device: torch.device, per_column: bool = False):
        self.size, self.dtype, self.qrange = size, dtype, qrange  # dtype: the weight's, in which columns are rounded
        self.per_column = per_column  # qparams [size, rows], a column's own, instead of one group's [rows]
        self.w = torch.zeros(size, rows, dtype=torch.float32, device=device)  # the sub-block's columns (as rows)
        self.h = torch.ones(size, size, dtype=torch.float32, device=device)  # its diagonal block of the factor
        shape = (size, rows) if per_column else (rows,)
        self.scale = torch.ones(shape, dtype=scale_dtype, device=device)
        self.inverse = torch.ones(shape, dtype=scale_dtype, device=device)
        self.zero = torch.zeros(shape, dtype=zero_dtype, device=device) if zero_dtype is not None else None
        self.zero_float = torch.zeros(shape, dtype=torch.float32, device=device) if zero_dtype is not None else None
        self.q = torch.zeros(size, rows, dtype=torch.int8, device=device)
        self.err = torch.zeros(size, rows, dtype=torch.float32, device=device)
        self.row_errors = torch.zeros(rows, dtype=torch.float32, device=device)

    def body(self) -> None:
        """The eager loop's kernels for `size` columns (`gptq._quantize_columns` and `_Grid.round`)."""
        low, high = self.qrange
        for i in range(self.size):
            scale, inverse, zero, zero_float = self._qparams(i)
            q = torch.round(self.w[i].to(self.dtype) * inverse)
            if zero is None:
                q = q.clamp_(low, high).float()
                value = (q * scale).float()
            else:
                q = (q + zero).clamp_(low, high).float()
                value = ((q - zero_float) * scale).float()
            self.q[i] = q
            e = torch.sub(self.w[i], value, out=self.err[i]).div_(self.h[i, i])
            self.row_errors.addcmul_(e, e)
            if i + 1 < self.size:
                self.w[i + 1 :].sub_(self.h[i, i + 1 :, None] * e)

    def _qparams(self, i: int) -> tuple:
        """Column i's (scale, 1 / scale, zero point, zero point as float32): views, no kernels of their own."""
        found = (self.scale, self.inverse, self.zero, self.zero_float)
        return tuple(t[i] if t is not None else None for t in found) if self.per_column else found

    def load(self, w: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, inverse: torch.Tensor,
             zero: torch.Tensor | None, zero_float: torch.Tensor | None) -> None:
        self.w.copy_(w)
        self.h.copy_(h)
        self.scale.copy_(scale)
        self.inverse.copy_(inverse)
        if self.zero is not None:
            self.zero.copy_(zero)
            self.zero_float.copy_(zero_float)

    def run(self, *inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(grid integers, scaled errors) of the sub-block given as `load`'s inputs; the squared errors are added
        to `row_errors`."""
        self.load(*inputs)
        self.body()
        return self.q, self.err


class SubBlockGraph(SubBlock):
    """`SubBlock` whose `body` is recorded once as a CUDA graph and replayed."""

    def __init__(self, *args):
        super().__init__(*args)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as graph capture requires (its values are
            self.body()                  # junk: every run loads its inputs and the running squared errors first)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.body()

    def run(self, *inputs) -> tuple[torch.Tensor, torch.Tensor]:
        self.load(*inputs)
        self.graph.replay()
        return self.q, self.err


def sub_block_runner(size: int, rows: int, dtype: torch.dtype, scale_dtype: torch.dtype, zero_dtype: torch.dtype | None,
                     qrange: tuple[int, int], device: torch.device, row_errors: torch.Tensor | None,
                     graphs: bool | None = None, per_column: bool = False) -> Callable | None:
    """A function running one sub-block of `size` columns (`SubBlock.run`'s inputs), through a CUDA graph on CUDA
    (`graphs` None), eagerly with `graphs` False; None where it does not apply (not CUDA, or turned off). It adds
    the rows' squared errors to `row_errors`, if given. `per_column`: each column's qparams are given ([size, rows])."""
    shape = (size, rows, dtype, scale_dtype, zero_dtype, qrange, device, per_column)
    if graphs is False:
        return _accumulating(SubBlock(*shape), row_errors)
    if device.type != "cuda" or not _STATE["enabled"]:
        return None
    key = shape
    graph = _GRAPHS.get(key)
    if graph is None:
        try:
            graph = _GRAPHS[key] = SubBlockGraph(*shape)
        except RuntimeError as exc:  # a capture this torch or driver refuses: the eager loop, same results
            _STATE["enabled"] = False
            warnings.warn(f"GPTQ runs its columns eagerly: capturing a CUDA graph failed ({str(exc).splitlines()[0]})")
            return None
    run = _accumulating(graph, row_errors)
    if key in _STATE["checked"]:
        return run
    return _checked(run, key, shape)


def _accumulating(block: SubBlock, row_errors: torch.Tensor | None) -> Callable:
    """`block.run`, continuing the caller's running sum of squared errors column by column (copied in and out
    around each sub-block: the same additions in the same order as the column loop's)."""

    def run(*inputs) -> tuple[torch.Tensor, torch.Tensor]:
        if row_errors is not None:
            block.row_errors.copy_(row_errors)
        q, err = block.run(*inputs)
        if row_errors is not None:
            row_errors.copy_(block.row_errors)
        return q, err

    return run


def _checked(run: Callable, key: tuple, shape: tuple) -> Callable:
    """`run`, compared with the eager loop bit for bit until a sub-block of this shape has matched; a mismatch turns
    graphs off for the run and the eager loop's values are used."""

    def checked(*inputs):
        if key in _STATE["checked"]:
            return run(*inputs)
        q_ref, err_ref = (t.clone() for t in SubBlock(*shape).run(*inputs))
        q, err = run(*inputs)  # (the squared errors follow from err)
        if torch.equal(q, q_ref) and torch.equal(err, err_ref):
            _STATE["checked"].add(key)
            return q, err
        if _STATE["enabled"]:
            _STATE["enabled"] = False
            warnings.warn("GPTQ's CUDA graph differed from the eager loop; running eagerly from here on")
        return q_ref, err_ref

    return checked
