"""Grid families (`quantkit.grids`): every spec has one, and what each hands to the algorithms, the resume files and QAT
is its own round to nearest, exactly."""

import pytest
import torch

from quantkit.algorithms.gptq import gptq_quantize
from quantkit.algorithms.methods.gptq import GPTQArgs
from quantkit import grids
from quantkit.quant import fake_quant, registry
from quantkit.grids.qparams import QuantizedWeight

BLOCK_RECIPES = ["gguf-iq4-nl", "gguf-iq4-xs", "gguf-q4-k-m", "gguf-q2-k"]


def _weight(rows=16, cols=512, seed=0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", registry.recipe_names())
def test_every_shipped_grid_has_one_family_that_rounds_it(name):
    spec = registry.resolve(name).scheme.weights
    owners = [family.name for family in grids.families() if family.owns(spec)]
    assert owners[:1] == [grids.family_of(spec).name]
    if spec.group_size_adjustable or spec.block_type or spec.global_scale or spec.scale_dtype.value == "float8_e8m0fnu":
        weight = _weight(cols=512)
        qweight = grids.quantize_weight(weight, spec)
        empty = grids.empty_quantized(weight, spec)
        assert (qweight.qdata.shape, qweight.qdata.dtype, qweight.scale.shape) == (empty.qdata.shape, empty.qdata.dtype, empty.scale.shape)


@pytest.mark.parametrize("name", BLOCK_RECIPES)
@pytest.mark.parametrize("actorder", [False, True])
def test_gptq_with_an_identity_hessian_is_the_familys_search_with_a_unit_imatrix(name, actorder):
    """GPTQ rounds onto the grid the family's search chooses as the loop reaches each block (weighted by H's
    diagonal): with H = I nothing moves, so it is the search with a unit importance, bit for bit."""
    spec = registry.resolve(name).scheme.weights
    weight = _weight()
    ours = gptq_quantize(weight, torch.eye(weight.shape[1]), spec, GPTQArgs(actorder=actorder))
    nearest = grids.quantize_weight(weight, spec, importance=torch.ones(weight.shape[1]))
    assert torch.equal(ours.qdata, nearest.qdata)
    assert torch.equal(ours.dequantize(torch.float32), nearest.dequantize(torch.float32))


@pytest.mark.parametrize("name", BLOCK_RECIPES)
def test_gptq_on_a_block_grid_lowers_the_output_error(name):
    spec = registry.resolve(name).scheme.weights
    weight, inputs = _weight(), torch.randn(1024, 512, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 3, 512)
    error = lambda q: ((q.dequantize(torch.float32) - weight) @ inputs.T).pow(2).sum()  # noqa: E731
    ours = gptq_quantize(weight, inputs.T @ inputs, spec, GPTQArgs())
    assert error(ours) < 0.95 * error(grids.quantize_weight(weight, spec))


@pytest.mark.parametrize("name", BLOCK_RECIPES)
def test_a_block_grids_parts_rebuild_it(name):
    """What a resume file holds of a block grid (`parts`) rebuilds a grid that decodes the codes the same."""
    spec = registry.resolve(name).scheme.weights
    qweight = grids.quantize_weight(_weight(), spec)
    family = grids.family_of(spec)
    again = QuantizedWeight(qweight.qdata, qweight.scale, None, spec, k=family.block_params(spec, qweight.k.parts()))
    assert torch.equal(again.dequantize(torch.float32), qweight.dequantize(torch.float32))


@pytest.mark.parametrize("name", ["gguf-iq4-nl", "gguf-iq4-xs"])
def test_qat_sees_the_i_quant_grid_finalize_writes(name):
    spec = registry.resolve(name).scheme.weights
    quantizer = fake_quant.fake_quantizer(fake_quant.weight_fake_quantize_config(spec)).eval()
    weight = _weight()
    torch.testing.assert_close(quantizer(weight), grids.fake_quantize_weight(weight, spec), atol=0, rtol=0)


def test_float8_grids_are_not_rounded_column_by_column():
    spec = registry.resolve("float8-dynamic-act-float8-weight").scheme.weights
    with pytest.raises(ValueError, match="use rtn for float8 weights"):
        grids.family_of(spec).columns(_weight(), torch.float32, spec)
