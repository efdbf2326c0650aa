"""AWQ (Lin et al.): activation-aware weight scaling before round-to-nearest.

For Linear layers fed by one op (a norm, or a Linear whose output they consume), per input channel j the
weights are scaled by s_j = mean|x_j|^r (normalised) and the feeding op's output divided by s_j, which
leaves the float function unchanged but lets salient channels keep more precision after rounding. The
ratio r is chosen on a grid in [0, 1) by the error of the block output with the scaled, rounded weights;
r = 0 (s = 1) is plain RTN, so the chosen scales never do worse than RTN on the calibration data.
The activation statistic, sum |x| and a token count, reduces across ranks by SUM; candidate errors too
(`calibration.steps.awq`: the candidates shared out over the ranks where each is scored on all the tokens).
"""

from __future__ import annotations

from typing import Callable

import torch

from quantkit.algorithms.methods.awq import AWQArgs
from quantkit.algorithms.smoothquant import divide_norm_output
from quantkit.grids import fake_quantize_weight
from quantkit.grids.schemes import WeightSpec
from quantkit.runtime.precision import tf32_products


def awq_scales(act_mean: torch.Tensor, ratio: float) -> torch.Tensor:
    """s = mean|x|^ratio, normalised so that sqrt(max * min) = 1."""
    scales = act_mean.float().clamp(min=1e-4).pow(ratio)
    return scales / (scales.max() * scales.min()).sqrt()


def search_scales(act_mean: torch.Tensor, error_of: Callable[[torch.Tensor], float], args: AWQArgs = AWQArgs()) -> tuple[torch.Tensor, float]:
    """The scales whose block-output error (`error_of(scales)`) is least over ratios k/grid, k = 0..grid-1."""
    candidates = candidate_scales(act_mean, args)
    return least_error(candidates, [error_of(scales) for scales in candidates])


def candidate_scales(act_mean: torch.Tensor, args: AWQArgs = AWQArgs()) -> list[torch.Tensor]:
    """The scales searched, one per ratio k/grid, k = 0..grid-1 (the first is all ones: plain RTN)."""
    return [awq_scales(act_mean, k / args.grid) for k in range(args.grid)]


def least_error(candidates: list[torch.Tensor], errors: list[float]) -> tuple[torch.Tensor, float]:
    """The first candidate of least error, and that error (all ones and inf when no error is a number)."""
    best_scales, best_error = torch.ones_like(candidates[0], dtype=torch.float32), float("inf")
    for scales, error in zip(candidates, errors):
        if error < best_error:
            best_scales, best_error = scales, error
    return best_scales, best_error


@torch.no_grad()
def fold_scales(prev_weight: torch.Tensor, prev_bias: torch.Tensor | None, weights: list[torch.Tensor], scales: torch.Tensor,
                norm_offset: float = 0.0) -> None:
    """In place: the feeding op's output channels / s (a norm's weight and bias, or a Linear's rows and bias),
    each fed Linear's input columns * s. The float function is unchanged. A norm computing
    x_hat * (norm_offset + weight) gets weight = (norm_offset + weight) / s - norm_offset."""
    if prev_weight.dim() == 1:
        divide_norm_output(prev_weight, scales, norm_offset)
    else:
        prev_weight.div_(scales.to(prev_weight.dtype).reshape(-1, 1))
    if prev_bias is not None:
        prev_bias.div_(scales.to(prev_bias.dtype))
    for weight in weights:
        weight.mul_(scales.to(weight.dtype))


def scaled_candidate(weight: torch.Tensor, spec: WeightSpec, scales: torch.Tensor) -> torch.Tensor:
    """What the Linear computes with once the scales are folded and it is rounded: (W * s) rounded on the grid, / s."""
    scaled = weight * scales.to(weight.dtype)
    return fake_quantize_weight(scaled, spec) / scales.to(weight.dtype)


def hessian_error(weight: torch.Tensor, candidate: torch.Tensor, xtx: torch.Tensor) -> float:
    """Summed squared output error of a lone Linear over the tokens x, sum ||(W' - W) x||^2 = tr(dW (sum x x^T) dW^T).
    On a CUDA GPU the product dW (sum x x^T) runs in TF32: an 8B model's down projection makes it 1.7 TFLOP a
    candidate, 20 candidates a layer, about 0.6 s a layer in float32 on an H100. Rounding its inputs to TF32 moved
    the errors of a trained model's candidates by 4e-4 of their size at most, a third of the least gap between a
    best and a second candidate there, and chose the same candidates (docs/calibration.md)."""
    delta = candidate.float() - weight.float()
    with tf32_products(xtx.device):
        product = delta @ xtx
    return float((product * delta).sum(dtype=torch.float64))
