import pytest
import torch

from quantkit import algorithms
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.quant.registry import resolve


@pytest.mark.parametrize("recipe", ["int4-weight-only", "int8-weight-only", "float8-dynamic-act-float8-weight"])
def test_rtn_rounds_every_weight_to_its_nearest_grid_point(recipe):
    spec = resolve(recipe).scheme.weights
    weight = torch.randn(32, 256, generator=torch.Generator().manual_seed(0))
    qweight = rtn_quantize(weight, spec)
    assert algorithms.get("rtn").quantize_weight(weight, spec, None).qdata.equal(qweight.qdata)
    if spec.dtype.is_float:
        assert qweight.qdata.dtype == torch.float8_e4m3fn
        return
    group = qweight.group_size
    step = qweight.scale.repeat_interleave(group, dim=1).float()
    error = (weight - qweight.dequantize(torch.float32)).abs()
    assert (error <= step / 2 + 1e-6).all()  # no grid point is nearer than the one chosen
    qmin, qmax = spec.dtype.qrange
    assert qweight.qdata.min() >= qmin and qweight.qdata.max() <= qmax
