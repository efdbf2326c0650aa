"""GPTQ (Frantar et al., 2022): round a Linear's weight column by column, pushing each column's rounding
error onto the columns not yet rounded, weighted by the inverse Hessian of the layer's inputs.

Calibration gives H = 2/n * sum_x x x^T over the n token rows x the Linear saw (`observers.HessianObserver`
accumulates it, reduces across ranks by SUM and normalises). Then:

1. `gptq_quantize(weight, hessian, spec, args)`: dead inputs (H_ii == 0) get H_ii = 1 and a zero weight column;
   H += dampening_frac * mean(diag H) * I (retried with x10 damping if Cholesky fails, then
   `GPTQDampingError`); U = upper Cholesky factor of H^-1. For each column i, left to right:
   q_i = round(w_i), err = (w_i - q_i) / U_ii, w_j -= err * U_ij for j > i. Blocks of `block_size`
   columns apply the update lazily to the columns right of the block (one matmul per block).
2. The result is a `QuantizedWeight` on exactly the grid `qparams` defines (torchao's primitives): qparams come
   from `qparams.choose_qparams` and every column is rounded with `qparams.quantize_with`, both in the weight's
   own dtype, as RTN does. With H = I nothing propagates and GPTQ equals RTN bit for bit.

Where the qparams come from:
- channel: chosen once, up front, from the whole weight (as llm-compressor does): a row's columns keep changing
  until the last one is rounded, so "the updated row" does not exist before the end. Up-front qparams are
  always taken from the weight with its dead columns zeroed (those inputs never reach the output).
- group, actorder=False: chosen for each group when its first column is reached, from the group's columns as
  updated so far (the block size is rounded up to a multiple of the group size so a group never straddles a
  block and sees every update).
- group, actorder=True ("static groups"): columns are rounded in order of decreasing H_ii, but the groups stay the
  original contiguous column ranges and their qparams are chosen up front from the weight. The output is a plain
  group-quantized weight (no g_idx), so every exporter writes it unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from quantkit.algorithms.gptq_args import ROW_BLOCK, GPTQArgs, row_share  # noqa: F401  (row_share: the ranks' shares)
from quantkit.algorithms.factor import ALONE, Sharing, factor_, reverse_
from quantkit.errors import QuantkitError
from quantkit.grids import float_grids
from quantkit.grids import family_of
from quantkit.grids.qparams import QuantizedWeight, weight_global_scale
from quantkit.grids.schemes import Granularity, WeightSpec


class GPTQDampingError(QuantkitError, ValueError):
    """The Hessian stayed non-positive-definite however much it was damped."""




@dataclass
class InverseHessian:
    """What GPTQ needs from a Hessian, computed once for every weight (and every rank's rows) that shares it."""

    upper: torch.Tensor  # upper Cholesky factor of the damped inverse [in, in], in the solve's column order
    perm: torch.Tensor | None  # actorder's column order (None: left to right)
    dead: torch.Tensor  # inputs with H_ii == 0 [in]: their weight columns are zeroed
    importance: torch.Tensor | None = None  # H's diagonal [in], in the weight's column order: a K grid's search weights

    @property
    def order(self) -> list[int]:
        return self.perm.tolist() if self.perm is not None else list(range(self.upper.shape[0]))


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, spec: WeightSpec, args: GPTQArgs = GPTQArgs(), *, damping_retries: int = 3,
    global_scale: torch.Tensor | None = None,
) -> QuantizedWeight:
    """GPTQ-round `weight` [out, in] given the normalised input Hessian [in, in]; see the module docstring.

    Computes in float32 on the weight's device; the scales' dtype follows `spec.scale_dtype` relative to
    `weight.dtype`, as `qparams.choose_qparams(weight, spec)` gives. NVFP4: the group scales lie under
    `global_scale` (the weight's own when None), chosen before any column moves.
    """
    _check_inputs(weight, hessian, spec)
    return gptq_quantize_rows(weight, inverse_hessian(hessian.to(weight.device), args, damping_retries), spec, args, global_scale)


def inverse_hessian(hessian: torch.Tensor, args: GPTQArgs = GPTQArgs(), damping_retries: int = 3,
                    sharing: Sharing = ALONE, *, reuse: bool = False) -> InverseHessian:
    """Dead inputs get H_ii = 1, actorder's permutation, then the damped inverse's upper Cholesky factor
    (`algorithms.factor`: with a `sharing` of several ranks, each computes its blocks and they are exchanged;
    the same values as one process's, bit for bit).

    `reuse`: the caller gives `hessian` up (pass it as a temporary, `inverse_hessian(observer.pop_hessian(), ...,
    reuse=True)`, holding no other reference to it). On a CUDA device the factor is then computed in its memory
    rather than in a copy: two [in, in] float32 matrices at the solve's peak, not three (784 MiB less for an 8B
    model's down projection, 3 GiB for a 70B's), the same values bit for bit. Elsewhere it changes nothing."""
    if not all(torch.isfinite(rows).all() for rows in hessian.split(_CHECK_ROWS)):
        raise ValueError("the Hessian has NaN or inf entries; check the calibration activations")
    reuse = reuse and hessian.is_cuda
    h = hessian.to(torch.float32)  # the caller's, unless it needs a change (or is given up): read only
    del hessian  # given up: freed once `h` is a copy of it (permuted)
    dead = h.diagonal() == 0
    if dead.any():
        h = h if reuse else h.clone()
        h[dead, dead] = 1.0
    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if args.actorder else None
    importance = h.diagonal().clone()  # before the permutation: each input's mean squared activation (an imatrix)
    if perm is not None:
        h = _permuted(h, perm, in_place=reuse)
    return InverseHessian(_inverse_hessian_cholesky(h, args.dampening_frac, damping_retries, sharing, reuse), perm,
                          dead, importance)


@torch.no_grad()
def gptq_quantize_rows(weight: torch.Tensor, factor: InverseHessian, spec: WeightSpec, args: GPTQArgs = GPTQArgs(),
                       global_scale: torch.Tensor | None = None, row_errors: torch.Tensor | None = None) -> QuantizedWeight:
    """GPTQ on some rows of a weight (rows are independent given the inverse-Hessian factor): the rows of
    `gptq_quantize(whole, ...)` bit for bit, when `weight` starts on a multiple of ROW_BLOCK rows of the whole
    and, for NVFP4, `global_scale` is the whole weight's. This is how ranks share one weight's work (`row_share`).

    `row_errors` (float32 [rows], zeros) receives each row's sum of squared scaled rounding errors, sum_i err_i^2:
    GPTQ's own loss, which is the row's squared output error through the damped Hessian, ||(w - q) U^-1||^2
    (w - q = err U, U the factor), for free (an elementwise accumulation per column, the same on any rank)."""
    _check_inputs(weight, None, spec)
    if spec.global_scale and global_scale is None:
        global_scale = weight_global_scale([weight])
    wt = torch.empty(weight.shape[::-1], dtype=torch.float32, device=weight.device)
    wt.copy_(weight.T)  # the float32 work copy, transposed: a column of the weight is a contiguous row
    wt[factor.dead.to(wt.device)] = 0.0
    # the grid's family says how a column rounds onto it (`grids.family.ColumnGrid`), and when its parameters are
    # chosen: up front, or as the loop reaches each group or block (not with actorder, whose columns come out of order)
    grid = family_of(spec).columns(wt.T, weight.dtype, spec, actorder=args.actorder, static_groups=args.static_groups,
                                   global_scale=global_scale if spec.global_scale else None, importance=factor.importance)
    if factor.perm is not None:
        wt = wt[factor.perm]
    qdata = _quantize_columns(wt, factor.upper, grid, factor.order, _aligned_block_size(args.block_size, spec), row_errors)
    if factor.perm is not None:
        qdata = qdata[:, torch.argsort(factor.perm)]
    return grid.result(qdata)


def _check_inputs(weight: torch.Tensor, hessian: torch.Tensor | None, spec: WeightSpec) -> None:
    if hessian is None:
        return
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"GPTQ needs a 2-D weight [out, in] and a Hessian [in, in]; got {tuple(weight.shape)} "
                         f"and {tuple(hessian.shape)}")


def _aligned_block_size(block_size: int, spec: WeightSpec) -> int:
    """Round up to a multiple of the group size, so each group's columns are all inside one block."""
    if spec.granularity is not Granularity.GROUP:
        return block_size
    return -(-block_size // spec.group_size) * spec.group_size


def _inverse_hessian_cholesky(hessian: torch.Tensor, dampening_frac: float, retries: int,
                              sharing: Sharing = ALONE, in_place: bool = False) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * I)^-1, damp = frac * mean(diag H), frac x10 on each failed try.

    With J the reversal permutation and J H J = R^T R (upper Cholesky factor R), H^-1 = U^T U for the upper
    triangular U = J R^-T J: one Cholesky and one triangular inverse, instead of a Cholesky, an inverse from it
    and a second Cholesky. Everything after the one copy of H happens in that copy's memory
    (`algorithms.factor.factor_`; for the 5632-column down_proj of a 1B model, 127 MB at the peak).

    `in_place` (a CUDA H the caller gave up): J H J is made in H's own memory instead of a copy. The device's
    factor leaves its input as it was when the Cholesky fails, so a retry only rewrites the damped diagonal; a
    factor that overflows after a Cholesky that did not fail leaves nothing to retry from, and is refused."""
    mean_diag = hessian.diagonal().mean()
    frac = dampening_frac
    if in_place:
        reverse_(hessian, REVERSE_CHUNK_ON_DEVICE)  # J H J, in place
        undamped = hessian.diagonal().clone()
    for _ in range(retries + 1):
        if in_place:
            work = hessian
            work.diagonal().copy_(undamped + frac * mean_diag)  # the values a fresh copy's add_ gives
        else:
            work = hessian.flip(0, 1)  # J H J, a copy: H stays as it is for a retry, and for the caller
            work.diagonal().add_(frac * mean_diag)
        if factor_(work, sharing):
            if all(torch.isfinite(rows).all() for rows in work.split(_CHECK_ROWS)):  # no [in, in] mask
                return work
            if in_place:
                raise GPTQDampingError(f"GPTQ's inverse Hessian factor overflowed with dampening_frac {frac:g}; "
                                       "raise dampening_frac")
        del work
        frac *= 10
    raise GPTQDampingError(
        f"GPTQ damping failed: the Hessian is not positive definite even with dampening_frac up to {frac / 10:g} "
        f"({retries + 1} tries from {dampening_frac:g}); calibrate with more tokens or raise dampening_frac"
    )


def _permuted(h: torch.Tensor, perm: torch.Tensor, in_place: bool) -> torch.Tensor:
    """h[perm][:, perm], the same values bit for bit, gathered one dimension at a time: `h[perm[:, None], perm]`
    on a GPU makes both broadcast index tensors contiguous, two [in, in] int64 matrices (four float32 ones: 3 GiB
    for an 8B model's down projection). `in_place` (h given up): the result is made in h's own memory, the columns
    permuted a chunk of rows at a time, so the peak is h and one permuted copy of it."""
    rows = h.index_select(0, perm)
    if not in_place:
        return rows.index_select(1, perm)
    h.copy_(rows)
    del rows
    step = max(1, REVERSE_CHUNK_ON_DEVICE // max(1, h.shape[1]))
    for start in range(0, h.shape[0], step):
        h[start : start + step] = h[start : start + step].index_select(1, perm)
    return h


REVERSE_CHUNK_ON_DEVICE = 1 << 24  # elements swapped at once reversing a GPU's H in place: 64 MiB, a few kernels


_CHECK_ROWS = 256


SUB_BLOCK = 16  # columns whose updates are applied one by one; the rest of a block gets them as one matmul


def _quantize_columns(
    wt: torch.Tensor, hinv: torch.Tensor, grid: _Grid, order: list[int], block_size: int,
    row_errors: torch.Tensor | None = None, graphs: bool | None = None,
) -> torch.Tensor:
    """The GPTQ loop over (permuted) columns of w, given as the contiguous w^T (updated in place; a column is a
    row); `order[j]` is the original index of column j. Returns qdata.

    Updates lazily on two levels: a column's error goes at
    once only to the rest of its sub-block of SUB_BLOCK columns; each finished sub-block updates the rest of
    its block with one matmul, each finished block the remaining columns. The same arithmetic as column-by-
    column GPTQ up to float summation order. A dynamic group starts on a sub-block boundary, so its qparams
    see every earlier update.

    Every weight row's arithmetic is the same whatever other rows are solved beside it: the per-column steps
    are elementwise (no fused multiply-add whose use could depend on a row's place in a vector), and the
    matmuls run on blocks of ROW_BLOCK rows. On CUDA the matmuls take all rows at once (cuBLAS may pick other
    kernels for other row counts anyway: ranks agree up to float summation order there) and whole sub-blocks run
    as one CUDA graph each (`gptq_graphs`: the same kernels, bit for bit); `graphs` False runs that path eagerly
    (tests), None picks it on CUDA."""
    qt = torch.empty(wt.shape, dtype=grid.code_dtype, device=wt.device)  # the grid values
    dynamic_size = grid.choose_every
    sub = math.gcd(SUB_BLOCK, dynamic_size) if dynamic_size else SUB_BLOCK
    cuda = wt.device.type == "cuda"
    row_blocks = [slice(None)] if cuda else [slice(r, r + ROW_BLOCK) for r in range(0, wt.shape[1], ROW_BLOCK)]
    per_column = _per_column(grid, order)  # actorder's static groups: a sub-block's columns from several groups
    runner = _sub_block_runner(wt, grid, order, sub, row_errors, graphs, per_column)
    in_order = grid.columns_in_order(order) if runner is not None and per_column else None

    def push(columns: slice, factors: torch.Tensor, err: torch.Tensor) -> None:  # wt[columns] -= factors @ err
        for rows in row_blocks:
            wt[columns, rows].addmm_(factors, err[:, rows], alpha=-1)

    for i1 in range(0, wt.shape[0], block_size):
        i2 = min(i1 + block_size, wt.shape[0])
        err = torch.empty_like(wt[i1:i2])
        for j1 in range(i1, i2, sub):
            j2 = min(j1 + sub, i2)
            if runner is not None and j2 - j1 == sub:
                if in_order is not None:
                    qparams = in_order(j1, j2)
                else:
                    group = grid.group_of(order[j1])
                    if dynamic_size and j1 % dynamic_size == 0:
                        grid.choose(group, wt[j1 : j1 + dynamic_size].T)
                    qparams = grid.columns(group)
                qt[j1:j2], err[j1 - i1 : j2 - i1] = runner(wt[j1:j2], hinv[j1:j2, j1:j2], *qparams)
                if j2 < i2:
                    push(slice(j2, i2), hinv[j1:j2, j2:i2].T, err[j1 - i1 : j2 - i1])
                continue
            for i in range(j1, j2):
                group = grid.group_of(order[i])
                if dynamic_size and i % dynamic_size == 0:
                    grid.choose(group, wt[i : i + dynamic_size].T)
                qt[i], value = grid.round(wt[i], group)
                e = torch.sub(wt[i], value, out=err[i - i1]).div_(hinv[i, i])
                if row_errors is not None:
                    row_errors.addcmul_(e, e)
                if i + 1 < j2:
                    wt[i + 1 : j2].sub_(hinv[i, i + 1 : j2, None] * e)
            if j2 < i2:
                push(slice(j2, i2), hinv[j1:j2, j2:i2].T, err[j1 - i1 : j2 - i1])
        if i2 < wt.shape[0]:
            push(slice(i2, None), hinv[i1:i2, i2:].T, err)
    return qt.T.contiguous()


def _per_column(grid: _Grid, order: list[int]) -> bool:
    """Whether the columns of a sub-block can belong to different groups: groups, in actorder's order."""
    return grid.spec.granularity is Granularity.GROUP and order != list(range(len(order)))


def _sub_block_runner(wt: torch.Tensor, grid: _Grid, order: list[int], sub: int, row_errors: torch.Tensor | None,
                      graphs: bool | None, per_column: bool = False):
    """`gptq_graphs.sub_block_runner` where it applies: integer grids, on CUDA or when asked (`graphs` False); left to
    right, a sub-block's columns in one group; in actorder's order (`per_column`), on qparams fixed up front, each
    column's qparams beside it."""
    if not grid.graphs or (graphs is None and wt.device.type != "cuda"):
        return None
    if per_column and grid.choose_every:
        return None  # dynamic groups are chosen as the loop reaches them, left to right only
    if not per_column and grid.spec.granularity is Granularity.GROUP and grid.spec.group_size % sub:
        return None  # a sub-block would straddle two groups
    from quantkit.algorithms.gptq_graphs import sub_block_runner

    zero_dtype = grid.zero.dtype if grid.zero is not None else None
    return sub_block_runner(sub, wt.shape[1], grid.dtype, grid.scale.dtype, zero_dtype, grid.spec.dtype.qrange, wt.device,
                            row_errors, graphs, per_column)
