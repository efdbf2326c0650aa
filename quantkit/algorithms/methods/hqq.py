"""HQQ: half-quadratic quantization. No calibration data: each group's scale and zero point are refined by a few
rounds of a closed-form solve that fits the grid to the weight under an l_p (p < 1) error, so that a few large
weights do not set the whole group's step (mobiusml/hqq; torchao's `Int4WeightOnlyConfig(use_hqq=True)`,
transformers' `HqqConfig`). Streams like round-to-nearest; the math is `algorithms.hqq`."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.algorithms.base import Algorithm, register
from quantkit.grids.schemes import QuantScheme, SchemeError, WeightObserver


@dataclass(frozen=True)
class HQQArgs:
    """mobiusml/hqq's defaults (`optimize_weights_proximal_legacy`)."""

    iters: int = 20  # solve rounds per group at most (each: round, shrink, fit)
    lp_norm: float = 0.7  # p of the l_p norm minimised; 1 is l_1, below 1 favours a few large errors over many
    beta: float = 10.0  # the half-quadratic penalty's weight: errors above beta^(-1 / (2 - p)) are shrunk
    kappa: float = 1.01  # beta's growth per round

    def __post_init__(self) -> None:
        if self.iters < 1:
            raise SchemeError("iters", f"{self.iters} is not allowed; use at least 1 (e.g. 20), or algorithm rtn for none")
        if not 0 < self.lp_norm <= 1:
            raise SchemeError("lp_norm", f"{self.lp_norm} is not allowed; use a value in (0, 1] (e.g. 0.7)")
        if not self.beta > 0:
            raise SchemeError("beta", f"{self.beta} is not allowed; use a positive weight (e.g. 10)")
        if not self.kappa >= 1:
            raise SchemeError("kappa", f"{self.kappa} is not allowed; use a growth factor of at least 1 (e.g. 1.01)")


@register
class HQQ(Algorithm):
    name = "hqq"
    Arguments = HQQArgs
    needs_data = False

    def refusal(self, scheme: QuantScheme) -> str | None:
        weights = scheme.weights
        if weights.block_type:
            return f"hqq does not solve llama.cpp's {weights.block_type} grid (llama.cpp's own search); use algorithm rtn"
        if not weights.affine:
            return ("hqq solves integer grids (int2 .. int8) with one float32, model-dtype or fp16 scale per group or "
                    f"channel; {weights.describe()} weights use algorithm rtn (or gptq)")
        if weights.observer is WeightObserver.MSE:
            return "hqq searches its own qparams from min/max ones; use observer minmax with hqq, or algorithm rtn for mse"
        return None

    def quantize_weight(self, weight, spec, args: HQQArgs, global_scale=None):
        from quantkit.algorithms.hqq import hqq_quantize

        return hqq_quantize(weight, spec, args)
