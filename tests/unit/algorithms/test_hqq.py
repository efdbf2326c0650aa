"""HQQ against references: the grid round-to-nearest uses (the same integers for the same qparams), no group's
squared error above round-to-nearest's and less in total at low bits, GGUF's fp16 minimums kept exact, the l_p
shrink as torchao writes it, and the refusals and argument checks a recipe relies on."""

import pytest
import torch

from quantkit.algorithms import hqq
from quantkit import algorithms
from quantkit.algorithms.hqq import hqq_quantize
from quantkit.algorithms.methods.hqq import HQQArgs
from quantkit.grids.qparams import choose_qparams_minmax, quantize_with
from quantkit.grids.schemes import Granularity, QDtype, QuantScheme, ScaleDtype, SchemeError, WeightObserver, WeightSpec

INT4_G64 = WeightSpec(QDtype.INT4, Granularity.GROUP, group_size=64, symmetric=False)
INT3_G64 = WeightSpec(QDtype.INT3, Granularity.GROUP, group_size=64, symmetric=False)
INT2_G64 = WeightSpec(QDtype.INT2, Granularity.GROUP, group_size=64, symmetric=False)
INT4_CHANNEL = WeightSpec(QDtype.INT4, Granularity.CHANNEL)
INT8_CHANNEL_ASYM = WeightSpec(QDtype.INT8, Granularity.CHANNEL, symmetric=False)
INT4_G32_F32 = WeightSpec(QDtype.INT4, Granularity.GROUP, group_size=32, scale_dtype=ScaleDtype.FLOAT32)
Q4_1 = WeightSpec(QDtype.INT4, Granularity.GROUP, group_size=32, symmetric=False, scale_dtype=ScaleDtype.FLOAT16)
Q5_1 = WeightSpec(QDtype.INT5, Granularity.GROUP, group_size=32, symmetric=False, scale_dtype=ScaleDtype.FLOAT16)
Q4_0 = WeightSpec(QDtype.INT4, Granularity.GROUP, group_size=32, scale_dtype=ScaleDtype.FLOAT16)
SPECS = {"int4-g64-asym": INT4_G64, "int3-g64-asym": INT3_G64, "int2-g64-asym": INT2_G64, "int4-channel": INT4_CHANNEL,
         "int8-channel-asym": INT8_CHANNEL_ASYM, "int4-g32-f32-scales": INT4_G32_F32, "q4_1": Q4_1, "q5_1": Q5_1,
         "q4_0": Q4_0}


def _weight(dtype=torch.float32, out=64, inp=256, seed=0):
    """A trained-like weight: Student-t (4 degrees of freedom) rows at LLM scale, three outlier input columns."""
    generator = torch.Generator().manual_seed(seed)
    chi2 = torch.randn(out, inp, 4, generator=generator).square().mean(-1)
    weight = torch.randn(out, inp, generator=generator) / chi2.sqrt() * 0.02
    weight[:, [5, 100, 201]] *= 8
    return weight.to(dtype)


def _rtn(weight, spec):
    """Round-to-nearest on a min/max integer grid: what `quantize_weight` does for these specs."""
    return quantize_with(weight, spec, *choose_qparams_minmax(weight, spec))


def _group_error(weight, q):
    delta = weight.float() - q.dequantize(torch.float32)
    return delta.square().reshape(*q.scale.shape, -1).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", SPECS)
def test_the_result_lies_on_round_to_nearests_grid(name, dtype):
    spec = SPECS[name]
    weight = _weight(dtype)
    ours, rtn = hqq_quantize(weight, spec, HQQArgs()), _rtn(weight, spec)
    qmin, qmax = spec.dtype.qrange
    assert ours.qdata.dtype is torch.int8 and ours.qdata.min() >= qmin and ours.qdata.max() <= qmax
    assert ours.scale.dtype is rtn.scale.dtype and ours.scale.shape == rtn.scale.shape
    if spec.symmetric:
        assert ours.zero_point is None
    else:
        assert ours.zero_point.dtype is torch.int8 and ours.zero_point.shape == rtn.zero_point.shape
        assert ours.zero_point.min() >= qmin and ours.zero_point.max() <= qmax
    again = quantize_with(weight, spec, ours.scale, ours.zero_point)
    assert torch.equal(again.qdata, ours.qdata)  # exporters re-deriving the integers get these
    assert not torch.equal(ours.scale, rtn.scale)  # the solve moved something


# Total squared error, HQQ / RTN, on _weight(seed=1) (float32; bf16 within 0.02): int4 g64 0.96, int3 g64 0.88,
#   int2 g64 0.75, int4 channel 0.82, int8 channel asym 0.99, int4 g32 f32 scales 0.88, q4_1 0.96, q5_1 0.98, q4_0 0.95
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", SPECS)
def test_no_group_is_worse_than_round_to_nearest(name, dtype):
    spec = SPECS[name]
    weight = _weight(dtype, seed=1)
    ours, rtn = _group_error(weight, hqq_quantize(weight, spec, HQQArgs())), _group_error(weight, _rtn(weight, spec))
    assert (ours <= rtn).all()
    assert ours.sum() < rtn.sum()


@pytest.mark.parametrize("name, ratio", [("int3-g64-asym", 0.92), ("int2-g64-asym", 0.8)])
def test_low_bits_lose_much_less_than_round_to_nearest(name, ratio):
    spec = SPECS[name]
    weight = _weight(torch.bfloat16, out=96, seed=2)
    ours, rtn = _group_error(weight, hqq_quantize(weight, spec, HQQArgs())), _group_error(weight, _rtn(weight, spec))
    assert ours.sum() < ratio * rtn.sum(), (ours.sum() / rtn.sum()).item()


@pytest.mark.parametrize("spec, significant", [(Q4_1, 7), (Q5_1, 6)], ids=["q4_1", "q5_1"])
def test_an_fp16_minimum_stays_exact(spec, significant):
    """Q4_1 / Q5_1: each block's minimum -(z - qmin) s is an fp16 value, and s has at most 7 / 6 significant bits,
    as `qparams.fp16_minimum_grid` guarantees round-to-nearest's."""
    weight = _weight(torch.bfloat16) + 0.004
    weight[3, :32] = 0.0  # a block of zeros keeps the smallest normal step
    q = hqq_quantize(weight, spec, HQQArgs())
    assert q.scale.dtype is torch.float16
    qmin, _ = spec.dtype.qrange
    minimum = -(q.zero_point.float() - qmin) * q.scale.float()
    assert torch.equal(minimum.half().float(), minimum)
    mantissa, _ = torch.frexp(q.scale.float())
    assert torch.equal(torch.round(mantissa * 2**significant), mantissa * 2**significant)
    code = (q.qdata.float() - qmin).reshape(64, -1, 32)
    values = q.scale.float()[..., None] * code + minimum[..., None]  # llama.cpp's d * c + m
    assert torch.equal(values.reshape(64, -1), q.dequantize(torch.float32))


def test_a_signed_step_keeps_its_sign_and_fp16():
    weight = _weight(torch.bfloat16)
    ours, rtn = hqq_quantize(weight, Q4_0, HQQArgs()), _rtn(weight, Q4_0)
    assert ours.scale.dtype is torch.float16 and (ours.scale < 0).any() and (ours.scale > 0).any()
    assert torch.equal(ours.scale.sign(), rtn.scale.sign())


def test_degenerate_groups_stay_round_to_nearests():
    weight = _weight(torch.bfloat16)
    weight[0, :64] = 0.0
    weight[1, 64:128] = 0.01
    weight[2, :64] = torch.tensor([0.0, 0.02]).repeat(32)  # two values: exact already
    ours, rtn = hqq_quantize(weight, INT4_G64, HQQArgs()), _rtn(weight, INT4_G64)
    for row, group in ((0, 0), (1, 1), (2, 0)):
        assert ours.scale[row, group] == rtn.scale[row, group] and ours.zero_point[row, group] == rtn.zero_point[row, group]
    assert torch.isfinite(ours.scale.float()).all()


@pytest.mark.parametrize("spec", [INT4_CHANNEL, INT8_CHANNEL_ASYM], ids=["int4-channel", "int8-channel-asym"])
def test_long_rows(spec):
    # rows of 2048: the row sums take the other dot product (the one CUDA takes)
    weight = _weight(torch.bfloat16, out=8, inp=2048, seed=5)
    ours = hqq_quantize(weight, spec, HQQArgs())
    assert torch.equal(quantize_with(weight, spec, ours.scale, ours.zero_point).qdata, ours.qdata)
    assert (_group_error(weight, ours) <= _group_error(weight, _rtn(weight, spec))).all()


def test_deterministic_and_independent_of_the_chunking(monkeypatch):
    weight = _weight(torch.bfloat16, out=48)
    whole = hqq_quantize(weight, INT3_G64, HQQArgs())
    assert torch.equal(hqq_quantize(weight, INT3_G64, HQQArgs()).qdata, whole.qdata)
    monkeypatch.setitem(hqq._CHUNK_ELEMENTS, "cpu", 5 * 256)  # chunks of 5 rows, the last of 3
    chunked = hqq_quantize(weight, INT3_G64, HQQArgs())
    assert torch.equal(chunked.scale, whole.scale) and torch.equal(chunked.zero_point, whole.zero_point)
    assert torch.equal(chunked.qdata, whole.qdata)


def test_more_rounds_are_no_worse_in_total():
    weight = _weight(seed=3)
    error = lambda args: _group_error(weight, hqq_quantize(weight, INT2_G64, args)).sum()  # noqa: E731
    rtn = _group_error(weight, _rtn(weight, INT2_G64)).sum()
    assert error(HQQArgs(iters=50)) <= error(HQQArgs()) <= error(HQQArgs(iters=1)) < rtn


def _torchao_shrink(x, beta, p):
    """torchao's `_shrink_lp_op` (quant_primitives.py), the l_p proximal operator."""
    if p == 1:
        return torch.sign(x) * torch.nn.functional.relu(torch.abs(x) - 1.0 / beta)
    return torch.sign(x) * torch.nn.functional.relu(torch.abs(x) - (1.0 / beta) * torch.pow(torch.abs(x), p - 1))


@pytest.mark.parametrize("beta, p", [(10.0, 0.7), (10.0, 1.0), (3.0, 0.5)])
def test_the_shrunk_target_is_hqqs(beta, p):
    generator = torch.Generator().manual_seed(4)
    groups, residual = torch.randn(32, 64, generator=generator), torch.randn(32, 64, generator=generator) * 0.3
    residual[0, :3] = 0.0
    expected = groups - _torchao_shrink(residual, beta, p)
    torch.testing.assert_close(hqq._shrunk_target(groups, residual, beta, p), expected, rtol=1e-6, atol=1e-7)


def test_weights_at_unit_scale_use_the_lp_shrink():
    """At unit scale, errors pass HQQ's threshold (0.17 at the defaults): the l_p solve differs from least squares
    (a tiny beta: nothing shrunk), and still beats round-to-nearest per group."""
    weight = _weight() * 50
    rtn = _group_error(weight, _rtn(weight, INT2_G64))
    lp = hqq_quantize(weight, INT2_G64, HQQArgs())
    squares = hqq_quantize(weight, INT2_G64, HQQArgs(beta=1e-9))
    assert not torch.equal(lp.scale, squares.scale)
    assert (_group_error(weight, lp) <= rtn).all() and (_group_error(weight, squares) <= rtn).all()


@pytest.mark.parametrize("spec, says", [
    (WeightSpec(QDtype.FLOAT8, Granularity.CHANNEL), "fp8 channel weights use algorithm rtn"),
    (WeightSpec(QDtype.FLOAT4, Granularity.GROUP, 16, scale_dtype=ScaleDtype.FLOAT8, global_scale=True), "algorithm rtn"),
    (WeightSpec(QDtype.FLOAT8, Granularity.BLOCK, block_shape=(128, 128)), "algorithm rtn"),
    (WeightSpec(QDtype.IQ4_NL, Granularity.GROUP, 32, scale_dtype=ScaleDtype.FLOAT16), "IQ4_NL grid"),
    (WeightSpec(QDtype.INT4, Granularity.GROUP, 32, symmetric=False, scale_dtype=ScaleDtype.K_QUANT), "Q4_K"),
    (WeightSpec(QDtype.INT6, Granularity.GROUP, 16, scale_dtype=ScaleDtype.K_QUANT), "Q6_K"),
    (WeightSpec(QDtype.INT4, Granularity.GROUP, 64, symmetric=False, observer=WeightObserver.MSE), "observer minmax"),
], ids=["fp8", "nvfp4", "fp8-block", "iq4_nl", "q4_k", "q6_k", "mse"])
def test_grids_hqq_does_not_solve_are_refused(spec, says):
    """The HQQ object refuses the recipe (one line saying what to use); the pure function refuses the grid too."""
    why = algorithms.get("hqq").refusal(QuantScheme(spec))
    assert says in why and "\n" not in why
    with pytest.raises(SchemeError, match="hqq solves integer grids") as raised:
        hqq_quantize(_weight(), spec, HQQArgs())
    assert raised.value.field == "algorithm"


@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_integer_grids_are_not_refused(spec):
    assert algorithms.get("hqq").refusal(QuantScheme(spec)) is None


@pytest.mark.parametrize("field, value", [("iters", 0), ("lp_norm", 0.0), ("lp_norm", 1.5), ("beta", 0.0),
                                          ("beta", float("nan")), ("kappa", 0.99)])
def test_arguments_out_of_range_are_refused(field, value):
    with pytest.raises(SchemeError) as raised:
        HQQArgs(**{field: value})
    assert raised.value.field == field and "allowed" in raised.value.message


def test_a_group_that_does_not_divide_the_columns_is_refused():
    with pytest.raises(ValueError, match="group size 64 does not divide"):
        hqq_quantize(torch.randn(4, 96), INT4_G64, HQQArgs())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gives_a_grid_result_no_worse_than_round_to_nearest():
    weight = _weight(torch.bfloat16).cuda()
    ours = hqq_quantize(weight, INT3_G64, HQQArgs())
    assert ours.qdata.is_cuda and torch.equal(quantize_with(weight, INT3_G64, ours.scale, ours.zero_point).qdata, ours.qdata)
    rtn = _group_error(weight, _rtn(weight, INT3_G64))
    assert (_group_error(weight, ours) <= rtn).all()
    cpu = _group_error(weight.cpu(), hqq_quantize(weight.cpu(), INT3_G64, HQQArgs())).sum()
    torch.testing.assert_close(_group_error(weight, ours).sum().cpu(), cpu, rtol=0.01, atol=0)


def test_the_recipes_stream_hqq_like_round_to_nearest_onto_its_grid(tiny_model_dir, tmp_path):
    """hqq-w4a16 is a data-free recipe: finalize streams it, with no calibration data, writing int4-asym's grid; each
    Linear's weight is `hqq_quantize`'s."""
    from quantkit.finalization.finalize import finalize, prepare, quantize_model
    from quantkit.quant import registry

    recipe = registry.resolve("hqq-w4a16")
    assert not recipe.needs_calibration and recipe.quantizer.algorithm.quantize_weight
    result = finalize(tiny_model_dir, tmp_path / "out", recipe)
    assert (tmp_path / "out" / "config.json").is_file() and result.calibration is None
    from safetensors.torch import load_file

    prepared = prepare(tiny_model_dir, recipe)
    model = quantize_model(prepared, recipe)
    source = load_file(str(tiny_model_dir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    spec = next(e for e in prepared.plan if e.name == name).scheme.weights  # the plan's group for its inputs
    expected = hqq_quantize(source[f"{name}.weight"], spec, HQQArgs()).dequantize(torch.float32)
    torch.testing.assert_close(model.get_submodule(name).weight.float(), expected.to(model.dtype).float(), atol=0, rtol=0)
