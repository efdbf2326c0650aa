"""The scheme's grid equals torchao's, exactly (atol=0), for every shipped recipe and both float dtypes."""

import pytest
import torch

from quantkit import registry
from quantkit.export import torchao as torchao_exporter
from quantkit.export.torchao import torchao_config
from quantkit.qparams import QuantizedWeight, fake_quantize_weight, quantize_weight, quantize_with
from quantkit.schemes import Granularity, QDtype, QuantScheme, WeightSpec

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

    from quantkit.qparams import choose_qparams_minmax, choose_qparams_mse
    from quantkit.schemes import WeightObserver

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
