"""Round to nearest: no data, no arguments; the scheme's observer chooses the qparams."""

from __future__ import annotations

from quantkit.algorithms.base import Algorithm, NoArguments, register

RTNArgs = NoArguments


@register
class RTN(Algorithm):
    name = "rtn"
    needs_data = False
    qat_ready = True  # QAT's fake quantizer rounds to nearest on the same grid
    rounds_to_nearest = True

    def quantize_weight(self, weight, spec, args, global_scale=None):
        from quantkit.algorithms.rtn import rtn_quantize

        return rtn_quantize(weight, spec, global_scale)
