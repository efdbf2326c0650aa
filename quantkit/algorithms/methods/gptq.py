"""GPTQ: Hessian-aware rounding, column by column, on calibration data."""

from __future__ import annotations

from typing import Any

from quantkit.algorithms.base import Algorithm, register
from quantkit.algorithms.gptq_args import ROW_BLOCK, GPTQArgs, row_share  # noqa: F401  (where callers find them)
from quantkit.grids.schemes import QDtype, QuantScheme


@register
class GPTQ(Algorithm):
    name = "gptq"
    Arguments = GPTQArgs
    step = "gptq"
    calibrates_head = True  # lm_head's Hessian is its inputs' alone: the layer-wise path takes it as it is
    staged = True  # one staged ("true sequential") pass per layer where the layer's wiring allows
    qat_substitute = "rtn"  # on a K grid, QAT trains on llama.cpp's own rounding and converts with it

    def quantize_with_hessian(self, weight, hessian, spec, args):
        from quantkit.algorithms.gptq import gptq_quantize

        return gptq_quantize(weight, hessian, spec, args)

    def refusal(self, scheme: QuantScheme) -> str | None:
        if scheme.weights.dtype is QDtype.FLOAT8:
            return "GPTQ supports integer and FP4 weights; use rtn for float8 weights"
        if scheme.activations is not None and scheme.activations.calibrated:
            return ("GPTQ with calibrated activation scales (static, or NVFP4's global scale) is not supported yet; "
                    "use rtn for these recipes, or a weight-only GPTQ recipe")
        return None

    def rows_per_rank(self, stacked_rows: list[int], world_size: int) -> list[int]:
        """Each rank's share of the rows of every stack of weights sharing a Hessian (`row_share`)."""
        shares = [[row_share(total, world_size, rank) for total in stacked_rows] for rank in range(world_size)]
        return [sum(share.stop - share.start for share in mine) for mine in shares]

    def summary(self, result) -> dict[str, Any]:
        if not result.true_sequential:
            order = "layer-wise"
        else:
            order = ("true-sequential (one staged pass per layer, stage inputs " +
                     ("held)" if result.stage_inputs_held else "recomputed batch by batch to save memory)"))
        return {"gptq_order": order}

    def plan_lines(self, plan: dict[str, Any]) -> list[tuple[str, str]]:
        rows = plan.get("gptq_rows_per_rank")
        return [("GPTQ rows per rank", " / ".join(map(str, rows)))] if rows and plan["ranks"] > 1 else []

    def summary_lines(self, calibration: dict[str, Any]) -> list[tuple[str, str]]:
        rows = calibration.get("gptq_rows_per_rank")
        return [("  GPTQ rows per rank", " / ".join(map(str, rows)))] if rows else []
