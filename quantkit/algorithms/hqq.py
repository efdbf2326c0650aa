"""HQQ (Badri & Shaji, 2023, half-quadratic quantization): each group's scale and zero point from a few rounds
of a closed-form solve, with no calibration data, on the integer grid round-to-nearest uses.

HQQ minimises sum |w - dequant(quant(w))|^p (p < 1: a few large errors cost less than many small ones) by
splitting the error off as a variable e and alternating two closed-form steps (mobiusml/hqq's and torchao's
`optimize_weights_proximal_legacy`, whose defaults `HQQArgs` keeps):

1. e = shrink_p(w - dequant(codes)): the proximal step of the l_p norm, sign(x) relu(|x| - |x|^(p-1) / beta),
   which keeps only errors above beta^(-1 / (2 - p)) (0.17 at the defaults, in the weight's own units: most
   errors of a trained weight are far smaller, so e is then 0 and the target below is w itself);
2. the qparams that fit the target w - e best in squared error, given the codes; beta grows by kappa each round.

HQQ's own zero point is a float and its scale stays at the min/max one. quantkit's grids want an integer zero
point in the dtype's range (int8), so step 2 here fits the scale and the zero point jointly and rounds the zero:
a least-squares line through (code, target) over each group gives a slope and an intercept; the zero point is the
intercept in steps, rounded to an integer and clamped into [qmin, qmax]; the scale is then refit by least squares
with that integer zero fixed (the one optimum left). Every iterate therefore lies on the grid, which is what lets
each one be scored exactly as it would be stored: the scale is rounded to the grid's scale dtype after every
fit (`qparams.as_stored`: GGUF's Q4_1 / Q5_1 grids put (scale, zero) through `fp16_minimum_grid` as the
range they span, so step * code + minimum stays exact in fp16). Symmetric
grids fit the scale alone (zero 0); GGUF's signed-step grids (Q4_0 / Q5_0 / Q8_0) keep the step's sign.

Which iterate is kept: the solve starts from round-to-nearest's min/max qparams; each group keeps its iterate
of least squared error, and a group stops at its first iterate no better than its best so far (HQQ's own early
stop, its tensor-wide mean |error| made per group and squared). Finally each group keeps whichever of that
iterate and round-to-nearest's qparams has the lower sum of squared error, measured on the weight exactly as
stored (`quantize_with`, dequantized in float32 as `QuantizedWeight.dequantize` does), round-to-nearest's unless
the solved one is lower by more than float32 sums can blur (a relative 1e-6): no group is ever worse than
round-to-nearest. The integers are `quantize_with`'s for the kept qparams, so every exporter writes the result
as it writes round-to-nearest's.

The math is float32 whatever the weight's dtype, on the weight's device, a chunk of rows at a time (about a
million elements on the CPU, to stay in cache; 16 M on CUDA), so a weight needs a few float32 copies of a chunk
beside its int8 codes. Groups are independent, so the result does not depend on the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from quantkit.grids import qparams
from quantkit.grids.qparams import QuantizedWeight, quantize_with
from quantkit.grids.schemes import SchemeError, WeightObserver, WeightSpec

_Pair = tuple[torch.Tensor, torch.Tensor]  # (scale, zero) per group
_EPS = torch.finfo(torch.float32).eps  # the smallest scale, as round-to-nearest's (torchao's eps)
_COMPACT = 0.75  # the groups still improving are gathered together once this fraction or fewer of them is left
_MARGIN = 1e-6  # relative: more than a float32 sum of squares' rounding, far less than any real improvement
_CHUNK_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 24}  # float32 elements solved together (see the docstring)


@torch.no_grad()
def hqq_quantize(weight: torch.Tensor, spec: WeightSpec, args) -> QuantizedWeight:
    """HQQ-quantize a 2-D weight [out, in] on `spec`'s integer grid (see the module docstring): round-to-nearest's
    dtypes and ranges, the integers `quantize_with` gives for the qparams, each group's qparams solved for and
    never with a larger squared error than round-to-nearest's. `args`: `algorithms.methods.hqq.HQQArgs`. Another
    grid (`WeightSpec.affine`: one scale, and integer zero, per group or channel) is refused with SchemeError; a
    recipe is refused sooner, by the HQQ object's `refusal`."""
    if not spec.affine or spec.observer is WeightObserver.MSE:
        raise SchemeError("algorithm", f"hqq solves integer grids with min/max qparams; {spec.describe()} is not one")
    qparams.block_size(weight, spec)  # the group must divide the columns
    rows = max(1, _CHUNK_ELEMENTS.get(weight.device.type, _CHUNK_ELEMENTS["cuda"]) // weight.shape[1])
    parts = [_quantize_rows(chunk, spec, args) for chunk in weight.split(rows)]
    zero = None if spec.symmetric else torch.cat([part.zero_point for part in parts])
    return QuantizedWeight(torch.cat([part.qdata for part in parts]), torch.cat([part.scale for part in parts]), zero, spec)


def _quantize_rows(weight: torch.Tensor, spec: WeightSpec, args) -> QuantizedWeight:
    """A chunk of rows on the grid: per group, `quantize_with`'s result for the solved qparams or for RTN's."""
    rtn_scale, rtn_zero = qparams.choose_qparams_minmax(weight, spec)
    groups = weight.float().reshape(rtn_scale.numel(), -1)
    zero = rtn_zero.float().flatten() if rtn_zero is not None else torch.zeros_like(groups[:, 0])
    scale, zero = _solve(groups, rtn_scale.float().flatten(), zero, _Grid(spec, rtn_scale.dtype, groups.shape[1]), args)
    zero = None if spec.symmetric else zero.to(torch.int8).view_as(rtn_scale)
    solved = quantize_with(weight, spec, scale.to(rtn_scale.dtype).view_as(rtn_scale), zero)
    return _better(groups, solved, quantize_with(weight, spec, rtn_scale, rtn_zero))


def _better(groups: torch.Tensor, solved: QuantizedWeight, rtn: QuantizedWeight) -> QuantizedWeight:
    """Per group, `solved` where its squared error is below `rtn`'s by more than float32 sums can blur, else `rtn`."""
    better = _group_error(groups, solved) < _group_error(groups, rtn) * (1 - _MARGIN)  # [groups of the chunk]
    qdata = torch.where(better[:, None], solved.qdata.view(groups.shape), rtn.qdata.view(groups.shape))
    better = better.view_as(rtn.scale)
    zero = None if rtn.zero_point is None else torch.where(better, solved.zero_point, rtn.zero_point)
    return QuantizedWeight(qdata.view_as(rtn.qdata), torch.where(better, solved.scale, rtn.scale), zero, rtn.spec)


def _group_error(groups: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """Each group's sum of squared error [n] of `q` as stored: w - (q - z) s in float32, as `q.dequantize` gives."""
    values = q.qdata.view(groups.shape).float()
    if q.zero_point is not None:
        values.sub_(q.zero_point.float().view(-1, 1))
    residual = torch.sub(groups, values.mul_(q.scale.float().view(-1, 1)))
    return _dot(residual, residual)


def _solve(groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, grid: _Grid, args) -> _Pair:
    """HQQ's rounds on `groups` [n, group] (float32) from grid qparams [n] (float32, the zero an integer): each
    group's iterate of least squared error. A round: codes, shrink, least-squares fit, onto the grid. The groups
    still improving are gathered together once a quarter of them have stopped."""
    best_scale, best_zero = scale.clone(), zero.clone()
    live = _Live.of(groups, scale, zero)
    beta = args.beta
    for step in range(args.iters + 1):
        codes = grid.codes(live.groups, live.scale, live.zero)
        sums = _CodeSums.of(codes, live.groups)
        active = live.keep_if_better(sums.error(live))  # HQQ's early stop, per group
        if step == args.iters or not active.any():
            break
        fit_scale, fit_zero = grid.fit(sums, *_target_sums(live, codes, sums, grid, beta, args.lp_norm), live.scale, live.zero)
        live.scale, live.zero = torch.where(active, fit_scale, live.scale), torch.where(active, fit_zero, live.zero)
        if active.sum() <= _COMPACT * active.numel():
            live.store(best_scale, best_zero, ~active)
            live = live.select(active)
        beta *= args.kappa
    live.store(best_scale, best_zero)
    return best_scale, best_zero


@dataclass
class _Live:
    """The groups still solving: weights [m, group] (float32), their rows among all groups, sum w (float64), their
    least and largest w, their current qparams (float32), and their best iterate so far."""

    groups: torch.Tensor
    index: torch.Tensor
    sum_w: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    best_error: torch.Tensor
    best_scale: torch.Tensor
    best_zero: torch.Tensor

    @classmethod
    def of(cls, groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> _Live:
        index = torch.arange(groups.shape[0], device=groups.device)
        best_error = torch.full_like(scale, torch.inf, dtype=torch.float64)
        return cls(groups, index, groups.sum(-1).double(), groups.amin(-1), groups.amax(-1), scale, zero, best_error, scale, zero)

    def keep_if_better(self, error: torch.Tensor) -> torch.Tensor:
        """Take the current qparams as the best where `error` is below the best's; where they are (a mask)."""
        better = error < self.best_error
        self.best_error = torch.where(better, error, self.best_error)
        self.best_scale = torch.where(better, self.scale, self.best_scale)
        self.best_zero = torch.where(better, self.zero, self.best_zero)
        return better

    def store(self, scale: torch.Tensor, zero: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Write the best qparams (of the groups in `mask`, else all) into the whole chunk's `scale`, `zero`."""
        index, best_scale, best_zero = (self.index, self.best_scale, self.best_zero) if mask is None else \
            (self.index[mask], self.best_scale[mask], self.best_zero[mask])
        scale[index], zero[index] = best_scale, best_zero

    def select(self, mask: torch.Tensor) -> _Live:
        return _Live(*(getattr(self, f.name)[mask] for f in fields(self)))


@dataclass
class _CodeSums:
    """Per group sums of the codes q (not less the zero point): sum q, sum q^2, sum q w (float64)."""

    q: torch.Tensor
    qq: torch.Tensor
    qw: torch.Tensor

    @classmethod
    def of(cls, codes: torch.Tensor, groups: torch.Tensor) -> _CodeSums:
        return cls(codes.sum(-1).double(), _dot(codes, codes).double(), _dot(codes, groups).double())

    def error(self, live: _Live) -> torch.Tensor:
        """sum (w - (q - z) s)^2 less sum w^2 (the same for every iterate of a group), from the sums."""
        n, s, z = self.q.new_tensor(live.groups.shape[-1]), live.scale.double(), live.zero.double()
        square = self.qq - 2 * z * self.q + n * z * z
        return s * s * square - 2 * s * (self.qw - z * live.sum_w)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row by row dot products [m] of a, b [m, k], in float32: bmm on the CPU for short rows (one pass, where it is
    fastest), never on CUDA, where float32 matmuls may run in TF32."""
    if a.device.type == "cpu" and a.shape[-1] <= 1024:
        return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).flatten()
    return (a * b).sum(-1)


def _target_sums(live: _Live, codes: torch.Tensor, sums: _CodeSums, grid: _Grid, beta: float, p: float) -> _Pair:
    """sum t and sum q t (float64) of the target t = w - shrink_p(w - (q - z) s). The shrink is zero wherever the
    error is at most beta^(-1 / (2 - p)), so t is w in every group whose error cannot exceed it (half a step inside
    the grid's range, the distance from its ends to the group's least and largest w outside); only the others are
    computed."""
    threshold = beta ** (-1 / (2 - p))
    low, high = grid.ends(live.scale, live.zero)
    bound = torch.maximum(live.scale.abs() / 2, torch.maximum(low - live.low, live.high - high))
    rows = (bound > threshold).nonzero().squeeze(1)
    if rows.numel() == 0:
        return live.sum_w, sums.qw
    groups, codes = live.groups[rows], codes[rows]
    residual = torch.addcmul(groups, codes - live.zero[rows, None], live.scale[rows, None], value=-1)
    target = _shrunk_target(groups, residual, beta, p)
    return live.sum_w.index_put((rows,), target.sum(-1).double()), sums.qw.index_put((rows,), _dot(codes, target).double())


def _shrunk_target(groups: torch.Tensor, residual: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """w - shrink_p(residual), the l_p norm's proximal operator sign(x) relu(|x| - |x|^(p-1) / beta) (torchao's
    `_shrink_lp_op`), here with |x| floored at the threshold beta^(-1 / (2 - p)) below which it is 0 anyway (no
    0^(p-1))."""
    size = residual.abs()
    threshold = beta ** (-1 / (2 - p))
    kept = (size - size.clamp(min=threshold).pow(p - 1) / beta).clamp_(min=0)
    return groups - residual.sign() * kept


class _Grid:
    """A spec's integer grid as the solve sees it: the code range, the least-squares fit, and the projection of a
    fitted (scale, zero) onto what can be stored (the scale's dtype, an integer zero, fp16 minimums)."""

    def __init__(self, spec: WeightSpec, scale_dtype: torch.dtype, group: int):
        self.spec, self.scale_dtype, self.group = spec, scale_dtype, group
        self.qmin, self.qmax = spec.dtype.qrange
        self.signed_step = qparams.steps_may_be_negative(spec)

    def ends(self, scale: torch.Tensor, zero: torch.Tensor) -> _Pair:
        """The lowest and highest values of each group's grid (a signed step may turn it round)."""
        first, last = (self.qmin - zero) * scale, (self.qmax - zero) * scale
        return torch.minimum(first, last), torch.maximum(first, last)

    def codes(self, groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """q = clamp(round(w / s) + z) as torchao rounds (float32 [m, group])."""
        return (groups * (1 / scale)[:, None]).round_().add_(zero[:, None]).clamp_(self.qmin, self.qmax)

    def fit(self, sums: _CodeSums, sum_t: torch.Tensor, sum_qt: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> _Pair:
        """The least-squares (scale, integer zero) of target t ~ (q - zero) scale given the codes q (float64
        sums), on the grid; (scale, zero) kept where the fit is degenerate."""
        if self.spec.symmetric:
            return self._onto_grid(sum_qt / sums.qq, zero, scale, zero)
        n = sums.q.new_tensor(self.group)
        slope = (n * sum_qt - sums.q * sum_t) / (n * sums.qq - sums.q * sums.q)
        intercept = (sum_t - slope * sums.q) / n  # t ~ slope (q - z') with z' = -intercept / slope
        fit_zero = (-intercept / slope).round_().clamp_(self.qmin, self.qmax)
        fit_zero = torch.where(slope > 0, fit_zero, torch.nan)  # a flat or falling line: no fit (NaN is dropped)
        fit_scale = (sum_qt - fit_zero * sum_t) / (sums.qq - 2 * fit_zero * sums.q + n * fit_zero * fit_zero)
        return self._onto_grid(fit_scale, fit_zero, scale, zero)

    def _onto_grid(self, fitted: torch.Tensor, new_zero: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> _Pair:
        fitted, new_zero = fitted.float(), new_zero.float()
        valid = torch.isfinite(fitted) & torch.isfinite(new_zero) & ((fitted != 0) if self.signed_step else (fitted > 0))
        fitted, new_zero = torch.where(valid, fitted, scale), torch.where(valid, new_zero, zero)
        stored, new_zero = qparams.as_stored(fitted, new_zero, self.spec, self.scale_dtype)
        valid &= stored.abs() >= _EPS  # only a signed step may turn the grid round (its sign is the fit's)
        return torch.where(valid, stored, scale), torch.where(valid, new_zero, zero)
