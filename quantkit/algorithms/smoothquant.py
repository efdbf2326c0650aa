"""SmoothQuant (Xiao et al.): migrate activation outliers into the weights before quantizing W8A8.

For a norm feeding Linear layers, per input channel j: s_j = max|X_j|^alpha / max_i |W_ij|^(1 - alpha);
the norm's weight is divided by s and every fed Linear's weight columns are multiplied by s, so the float
output is unchanged while the activations the quantizer sees are flatter. The activation statistic is a
per-channel max (reduces across ranks by MAX); every rank computes the same scales.
"""

from __future__ import annotations

import torch

from quantkit.algorithms.methods.smoothquant import SmoothQuantArgs

_MIN = 1e-5


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], args: SmoothQuantArgs = SmoothQuantArgs()) -> torch.Tensor:
    """Per input channel scales [in] from activation max |x| [in] and the fed Linear weights [out_k, in]."""
    alpha = args.alpha
    weight_absmax = torch.cat([w.detach().float().abs() for w in weights], dim=0).amax(0)
    scales = act_absmax.float().clamp(min=_MIN).pow(alpha) / weight_absmax.clamp(min=_MIN).pow(1 - alpha)
    return scales.clamp(min=_MIN)


@torch.no_grad()
def fold_scales(norm_weight: torch.Tensor, weights: list[torch.Tensor], scales: torch.Tensor, norm_offset: float = 0.0,
                norm_bias: torch.Tensor | None = None) -> None:
    """In place: the norm's output / s (its weight, and its bias if it has one: LayerNorm), each Linear weight * s
    (per input column). The float function is unchanged. A norm computing x_hat * (norm_offset + weight) gets
    weight = (norm_offset + weight) / s - norm_offset."""
    divide_norm_output(norm_weight, scales, norm_offset)
    if norm_bias is not None:
        norm_bias.div_(scales.to(norm_bias.dtype))
    for weight in weights:
        weight.mul_(scales.to(weight.dtype))


@torch.no_grad()
def divide_norm_output(norm_weight: torch.Tensor, scales: torch.Tensor, norm_offset: float = 0.0) -> None:
    """In place: a norm's weight such that its output is divided by `scales`, per channel."""
    if norm_offset:
        norm_weight.add_(norm_offset).div_(scales.to(norm_weight.dtype)).sub_(norm_offset)
    else:
        norm_weight.div_(scales.to(norm_weight.dtype))
