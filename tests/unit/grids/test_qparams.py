"""The scheme's grid equals torchao's, exactly (atol=0), for every shipped recipe and both float dtypes."""

import pytest
import torch

from quantkit.export import torchao as torchao_exporter
from quantkit.export.torchao import torchao_config
from quantkit.quant import registry
from quantkit.grids import fake_quantize_weight, quantize_weight
from quantkit.grids.qparams import QuantizedWeight, quantize_with
from quantkit.grids.schemes import Granularity, QDtype, QuantScheme, WeightSpec

DTYPES = [torch.float32, torch.bfloat16]


def _weight(dtype, out=48, inp=256, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(out, inp, generator=generator) * 0.05).to(dtype)


TORCHAO_RTN = [n for n in registry.recipe_names() if torchao_exporter.unsupported(registry.resolve(n)) is None
               and not registry.resolve(n).scheme.weights.dtype.is_float]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", TORCHAO_RTN)
def test_integer_grids_equal_torchao_configs(name, dtype):
    from torchao.quantization import quantize_

    scheme = registry.resolve(name).scheme
    linear = torch.nn.Linear(256, 48, bias=False).to(dtype)
    linear.weight.data = _weight(dtype)
    ours = fake_quantize_weight(linear.weight.data, scheme.weights)
    quantize_(linear, torchao_config(scheme))
    torch.testing.assert_close(ours, linear.weight.dequantize(), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int3_grid_equals_torchao_config(dtype):  # no shipped recipe uses int3: checked here
    from torchao.quantization import quantize_

    scheme = QuantScheme(WeightSpec(QDtype.INT3, Granularity.GROUP, 32))
    linear = torch.nn.Linear(256, 48, bias=False).to(dtype)
    linear.weight.data = _weight(dtype)
    ours = fake_quantize_weight(linear.weight.data, scheme.weights)
    quantize_(linear, torchao_config(scheme))
    torch.testing.assert_close(ours, linear.weight.dequantize(), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_float8_grid_equals_torchao_float8_tensor(dtype):
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    spec = registry.resolve("float8-dynamic-act-float8-weight").scheme.weights
    weight = _weight(dtype)
    theirs = Float8Tensor.from_hp(weight, granularity=PerRow())
    ours = quantize_weight(weight, spec)
    assert torch.equal(ours.qdata.view(torch.uint8), theirs.qdata.view(torch.uint8))
    torch.testing.assert_close(ours.scale.flatten(), theirs.scale.flatten().to(ours.scale.dtype), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["mxfp4", "mxfp8"])
def test_mx_grids_equal_torchao_mx_config(name, dtype):
    """The torchao format's MX config (scaling mode EVEN for FP4 elements, RCEIL for FP8) rounds the scales as
    compressed-tensors does: the same dequantized weights, atol 0. (Its CUDA kernels convert on sm100; torchao's
    emulated path quantizes the same way on CPU.)"""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.quantization.quantize_.common import KernelPreference

    scheme = registry.resolve(name).scheme
    config = torchao_config(scheme)
    weight = _weight(dtype, out=64, inp=512) * torch.logspace(-3, 1, 64).unsqueeze(1).to(dtype)  # scales over 13 octaves
    theirs = MXTensor.to_mx(weight, config.weight_dtype, block_size=config.block_size, scaling_mode=config.scaling_mode,
                            kernel_preference=KernelPreference.EMULATED, is_swizzled_scales=False)
    torch.testing.assert_close(fake_quantize_weight(weight, scheme.weights), theirs.dequantize(dtype), atol=0, rtol=0)


def _nvfp4_torchao(weight):
    from torchao.quantization import quantize_

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data = weight.clone()
    quantize_(linear, torchao_config(registry.resolve("nvfp4-a16").scheme))
    return linear.weight


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_torchao_config_is_the_scheme_on_float32_arithmetic(dtype):
    """torchao's NVFP4WeightOnlyConfig: the scheme's FP4 values and FP8 group scales, bit for bit, on a float32 model;
    on a bfloat16 one compressed-tensors computes the global scale and the division in bfloat16, torchao in
    float32, so a few values (under 3%) sit one FP4 step apart."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.utils import from_blocked

    spec = registry.resolve("nvfp4-a16").scheme.weights
    weight = _weight(dtype, out=64, inp=512) * torch.rand(64, 1, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours, theirs = quantize_weight(weight, spec), _nvfp4_torchao(weight)
    values = f4_unpacked_to_f32(unpack_uint4(theirs.qdata.contiguous().view(torch.uint8))).reshape(weight.shape)
    scales = from_blocked(theirs.scale, *ours.scale.shape).reshape(ours.scale.shape).float()  # stored swizzled for the kernels
    differ = (values != ours.qdata.float()).float().mean().item()
    if dtype is torch.float32:
        assert differ == 0
        torch.testing.assert_close(scales, ours.scale.float(), atol=0, rtol=0)
        torch.testing.assert_close(theirs.per_tensor_scale.reshape(1), 1 / ours.global_scale, rtol=1e-7, atol=0)
    else:
        assert 0 < differ < 0.03
        step = (values - ours.qdata.float()).abs().max().item()
        assert step <= 2.0  # FP4's largest step (4 -> 6); never a different region of the grid


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_block_torchao_config_is_the_scheme_on_float32_arithmetic(dtype):
    """torchao's Float8DynamicActivationFloat8WeightConfig with 128x128 weight blocks: the scheme's block scales
    (torchao keeps them float32), and its FP8 values on a float32 model; on bfloat16 torchao divides in float32, so
    a few values round to the neighbouring FP8 value."""
    from torchao.quantization import PerBlock
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    spec = registry.resolve("fp8-block").scheme.weights
    config = torchao_config(registry.resolve("fp8-block").scheme)
    assert [tuple(g.block_size) for g in config.granularity] == [(1, 128), (128, 128)]
    weight = _weight(dtype, out=256, inp=384) * torch.rand(256, 1, generator=torch.Generator().manual_seed(2)).to(dtype)
    theirs, ours = Float8Tensor.from_hp(weight, granularity=PerBlock([128, 128])), quantize_weight(weight, spec)
    torch.testing.assert_close(theirs.scale.float(), ours.scale.float(), atol=0, rtol=0)
    differ = (theirs.qdata.float() != ours.qdata.float()).float().mean().item()
    assert differ == 0 if dtype is torch.float32 else differ < 0.05  # 3.1% here: bfloat16 vs float32 quotients


@pytest.mark.parametrize("bits, qmin, qmax", [(QDtype.INT2, -2, 1), (QDtype.INT3, -4, 3), (QDtype.INT4, -8, 7), (QDtype.INT8, -128, 127)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_integers_stay_in_range_and_round_trip(bits, qmin, qmax, symmetric):
    spec = WeightSpec(bits, Granularity.GROUP, group_size=32, symmetric=symmetric)
    qw = quantize_weight(_weight(torch.float32), spec)
    assert qw.qdata.dtype == torch.int8 and qmin <= qw.qdata.min() and qw.qdata.max() <= qmax
    assert qw.scale.shape == (48, 256 // 32)
    assert (qw.zero_point is None) == symmetric
    again = quantize_with(qw.dequantize(), spec, qw.scale, qw.zero_point)  # a grid point rounds to itself
    assert torch.equal(again.qdata, qw.qdata)


def test_rtn_error_is_at_most_half_a_step():
    spec = WeightSpec(QDtype.INT8, Granularity.CHANNEL)
    weight = _weight(torch.float32)
    qw = quantize_weight(weight, spec)
    assert ((qw.dequantize() - weight).abs() <= qw.scale / 2 + 1e-7).all()


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="does not divide"):
        quantize_weight(_weight(torch.float32, inp=96), WeightSpec(QDtype.INT4, Granularity.GROUP, group_size=64))


def test_quantized_weight_reports_its_group_size():
    qw = quantize_weight(_weight(torch.float32), WeightSpec(QDtype.INT4, Granularity.GROUP, group_size=64))
    assert isinstance(qw, QuantizedWeight) and qw.group_size == 64


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mse_observer_without_shrink_is_minmax_and_with_shrink_is_no_worse(symmetric, dtype):
    from dataclasses import replace

    from quantkit.grids.qparams import choose_qparams_minmax, choose_qparams_mse
    from quantkit.grids.schemes import WeightObserver

    spec = WeightSpec(QDtype.INT4, Granularity.GROUP, group_size=64, symmetric=symmetric)
    weight = _weight(dtype)
    minmax = choose_qparams_minmax(weight, spec)
    unshrunk = choose_qparams_mse(weight, spec, max_shrink=0.0)
    assert torch.equal(minmax[0], unshrunk[0]) and (symmetric or torch.equal(minmax[1], unshrunk[1]))
    mse_spec = replace(spec, observer=WeightObserver.MSE)
    error = lambda s: (quantize_weight(weight, s).dequantize(torch.float32) - weight.float()).abs().pow(2.4)  # noqa: E731
    per_group = lambda e: e.reshape(48, -1, 64).sum(-1)  # noqa: E731
    assert (per_group(error(mse_spec)) <= per_group(error(spec)) + 1e-6).all()
    assert error(mse_spec).sum() < error(spec).sum()


@pytest.mark.parametrize("dtype, significant", [(QDtype.INT4, 7), (QDtype.INT5, 6)])
@pytest.mark.parametrize("observer", ["minmax", "mse"])
def test_an_fp16_minimum_grid_holds_its_minimum_in_fp16(dtype, significant, observer):
    """Q4_1 / Q5_1: every block's minimum -(z - qmin) s is an fp16 value, the step has at most 7 (int4) or 6 (int5)
    significant bits, and the grid loses almost nothing against an unconstrained float32 scale."""
    from quantkit.grids.schemes import ScaleDtype, WeightObserver

    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.02 + 0.004
    weight[3, :32] = 0.0  # a block of zeros: the smallest normal step
    spec = WeightSpec(dtype, Granularity.GROUP, 32, symmetric=False, scale_dtype=ScaleDtype.FLOAT16,
                      observer=WeightObserver(observer))
    q = quantize_weight(weight, spec)
    assert q.scale.dtype is torch.float16 and q.zero_point.dtype is torch.int8
    qmin, qmax = dtype.qrange
    minimum = -(q.zero_point.float() - qmin) * q.scale.float()
    assert torch.equal(minimum.half().float(), minimum)
    mantissa, _ = torch.frexp(q.scale.float())
    assert torch.equal(torch.round(mantissa * 2 ** significant), mantissa * 2 ** significant)
    assert q.qdata.min() >= qmin and q.qdata.max() <= qmax
    free = quantize_weight(weight, WeightSpec(dtype, Granularity.GROUP, 32, symmetric=False, scale_dtype=ScaleDtype.FLOAT32,
                                              observer=WeightObserver(observer)))
    error = (q.dequantize(torch.float32) - weight).norm() / (free.dequantize(torch.float32) - weight).norm()
    assert error < 1.02, error


@pytest.mark.parametrize("dtype, qtype", [(QDtype.INT4, "Q4_0"), (QDtype.INT5, "Q5_0"), (QDtype.INT8, "Q8_0")])
def test_a_signed_step_grid_is_llama_cpps_rule_and_beats_the_symmetric_range(dtype, qtype):
    """GGUF's symmetric blocks (fp16 steps) take llama.cpp's rule: d = m / qmin, m the block's value of largest
    magnitude with its sign, stored in fp16 (Q4_0 and Q5_0: llama.cpp's steps exactly; its Q8_0 uses max|w| / 127,
    this one -m / 128). Against max|w| / ((qmax - qmin) / 2), which rounds both ends, the weight error falls, on
    heavy-tailed weights like a trained model's; the MSE observer, searching both ends of the grid, falls further."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from quantkit.grids.schemes import ScaleDtype, WeightObserver

    torch.manual_seed(0)
    weight = torch.distributions.StudentT(4.0).sample((64, 256)) * 0.02
    weight[5, :32] = 0.0  # an all-zero block: the smallest positive step, all codes 0
    spec = WeightSpec(dtype, Granularity.GROUP, 32, symmetric=True, scale_dtype=ScaleDtype.FLOAT16)
    q = quantize_weight(weight, spec)
    largest = weight.reshape(64, 8, 32).gather(-1, weight.reshape(64, 8, 32).abs().argmax(-1, keepdim=True)).squeeze(-1)
    assert torch.equal(q.scale, (largest / dtype.qrange[0]).half().where(largest != 0, q.scale)) and (q.scale < 0).any()
    assert torch.equal(q.qdata[5, :32], torch.zeros(32, dtype=torch.int8))
    if qtype != "Q8_0":  # llama.cpp's own steps, to the bit
        blocks = quants.quantize(weight.numpy(), GGMLQuantizationType[qtype]).reshape(64, 8, -1)
        theirs = torch.from_numpy(np.ascontiguousarray(blocks[..., :2]).view(np.float16).squeeze(-1).copy())
        assert torch.equal(q.scale.where(largest != 0, torch.zeros_like(q.scale)), theirs)

    def error(qweight):
        return (qweight.dequantize(torch.float32) - weight).pow(2).sum()

    old = quantize_weight(weight, WeightSpec(dtype, Granularity.GROUP, 32, symmetric=True, scale_dtype=ScaleDtype.FLOAT32))
    searched = quantize_weight(weight, WeightSpec(dtype, Granularity.GROUP, 32, symmetric=True, scale_dtype=ScaleDtype.FLOAT16,
                                                  observer=WeightObserver.MSE))
    assert error(q) < 0.95 * error(old)
    assert error(searched) < error(q)
