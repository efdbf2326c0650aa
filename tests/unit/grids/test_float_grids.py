"""The float grids' qparams and grid values against compressed-tensors' own functions (what LLM Compressor calls to
write NVFP4, MXFP4, MXFP8 and FP8-block artifacts), atol 0; MLX's nvfp4 grid against a numpy port of mx.quantize's
(tests/engines/test_mlx_lm.py holds it to mlx itself)."""

import numpy as np
import pytest
import torch
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam, maybe_pad_tensor_for_block_quant
from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA  # its cast_to_fp4: in every release since 0.17

from quantkit.grids import float_grids
from quantkit.grids import quantize_weight
from quantkit.grids.qparams import weight_global_scale
from quantkit.grids.schemes import Granularity, QDtype, ScaleDtype, WeightSpec

SPECS = {
    "NVFP4A16": WeightSpec(QDtype.FLOAT4, Granularity.GROUP, 16, scale_dtype=ScaleDtype.FLOAT8, global_scale=True),
    "MXFP4A16": WeightSpec(QDtype.FLOAT4, Granularity.GROUP, 32, scale_dtype=ScaleDtype.E8M0),
    "MXFP8A16": WeightSpec(QDtype.FLOAT8, Granularity.GROUP, 32, scale_dtype=ScaleDtype.E8M0),
    "FP8_BLOCK": WeightSpec(QDtype.FLOAT8, Granularity.BLOCK, block_shape=(128, 128)),
}


def _weight(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(200, 256) * torch.rand(200, 1) * 0.05  # 200 rows: the last row of 128x128 tiles is short
    w[3, 5], w[7, 16:48] = 0.9, 0.0  # an outlier, and all-zero groups
    return w.to(dtype)


def _reference(w: torch.Tensor, preset: str, spec: WeightSpec):
    """compressed-tensors' memoryless min/max qparams (as LLM Compressor's observer computes them), the grid values
    its compressor writes, and the weights its decompressor gives back."""
    args = preset_name_to_scheme(preset, ["Linear"]).weights
    if spec.granularity is Granularity.BLOCK:
        padded = maybe_pad_tensor_for_block_quant(w, spec.block_shape)
        tiles = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128).transpose(1, 2)
        low, high = tiles.amin(dim=(-1, -2)), tiles.amax(dim=(-1, -2))
    else:
        groups = w.reshape(w.shape[0], -1, spec.group_size)
        low, high = groups.amin(-1), groups.amax(-1)
    gs = None
    if spec.global_scale:
        absmax = torch.max(high.max(), -low.min())
        gs = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    scale, _ = calculate_qparams(low, high, args, global_scale=gs)
    scale = scale.to(w.dtype)  # the module's weight_scale parameter is in the weight's dtype
    q = quantize(w, scale, None, args, global_scale=gs)
    return scale, gs, q, dequantize(q, scale, None, args, global_scale=gs, dtype=w.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("preset", list(SPECS))
def test_qparams_grid_values_and_dequantized_weights_equal_compressed_tensors(preset, dtype):
    w, spec = _weight(dtype), SPECS[preset]
    scale, gs, q, dq = _reference(w, preset, spec)
    ours = quantize_weight(w, spec)
    assert torch.equal(ours.scale, scale)
    assert (ours.global_scale is None) == (gs is None) and (gs is None or torch.equal(ours.global_scale, gs))
    assert ours.qdata.dtype == torch.float8_e4m3fn and torch.equal(ours.qdata.float(), q.float())
    if spec.granularity is not Granularity.BLOCK:  # compressed-tensors' dequantize has no block path
        assert torch.equal(ours.dequantize(dtype), dq)
    assert ours.dequantize(dtype).shape == w.shape


def test_fp4_rounding_is_compressed_tensors_ties_included():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    ties = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, ties, ties + 1e-3, ties - 1e-3, torch.linspace(-7, 7, 1001)])
    x = torch.cat([x, -x])
    assert torch.equal(float_grids.round_to_fp4(x), FP4_E2M1_DATA.cast_to_fp4(x.clone()))


def test_a_fused_global_scale_is_the_largest_weights():
    w = _weight(torch.bfloat16)
    small = w * 0.5
    fused = weight_global_scale([small, w])
    assert torch.equal(fused, weight_global_scale([w])) and fused.dtype == torch.float32
    assert torch.equal(quantize_weight(small, SPECS["NVFP4A16"], fused).global_scale, fused)
    assert not torch.equal(quantize_weight(small, SPECS["NVFP4A16"]).global_scale, fused)


def test_mx_exponents_are_the_stored_uint8():
    scale = float_grids.mx_group_scales(torch.tensor([1e-30, 0.01, 1.0, 6.0, 1e30]), 4)
    exponents = float_grids.mx_exponents(scale)
    assert exponents.dtype == torch.uint8 and torch.equal(torch.exp2(exponents.float() - 127), scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_activations_equal_compressed_tensors_runtime(dtype):
    """NVFP4 activations (what QAT for `nvfp4` computes) as compressed-tensors' forward quantizes an input under a
    global scale: per group of 16, dynamic FP8 scales, atol 0; the global scale is generate_gparam's."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = preset_name_to_scheme("NVFP4", ["Linear"]).input_activations
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 7, 64, generator=generator) * torch.logspace(-2, 1, 64)).to(dtype)
    x[0, 0, :16] = 0  # an all-zero group
    gs = generate_gparam(x.min().reshape(1), x.max().reshape(1))
    assert torch.equal(float_grids.global_scale(x.abs().amax()), gs)
    scale, zero = compute_dynamic_scales_and_zp(x, args, module=None, global_scale=gs)
    theirs = fake_quantize(x, scale, zero, args, global_scale=gs)
    torch.testing.assert_close(float_grids.fake_quantize_nvfp4(x, gs), theirs, atol=0, rtol=0)


# ---------------------------------------------------------------- MLX's nvfp4 (FP8 group scales, no global scale)

MLX_NVFP4 = WeightSpec(QDtype.FLOAT4, Granularity.GROUP, 16, scale_dtype=ScaleDtype.FLOAT8)
MLX_FP4_TABLE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def mlx_to_fp8(x: np.ndarray) -> np.ndarray:
    """mlx's float32 -> FP8 e4m3 bytes (mlx/backend/cpu/unary_ops.h, `ToFP8`): round half to even, saturating at 448."""
    bits = x.astype(np.float32).view(np.uint32)
    sign = bits & np.uint32(0x80000000)
    bits = bits ^ sign
    low = ((bits.view(np.float32) + np.float32(2.0 ** 14)).view(np.uint32) - np.uint32(141 << 23)).astype(np.uint8)
    high = ((bits + np.uint32((1 << 32) + ((7 - 127) << 23) + 0x7FFFF) + ((bits >> 20) & 1)) >> 20).astype(np.uint8)
    result = np.where(bits < (121 << 23), low, high)
    return np.where(bits >= (543 << 21), np.uint8(0x7E), result) | (sign >> 24).astype(np.uint8)


def mx_nvfp4_reference(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """mx.quantize(w, mode="nvfp4") on mlx's CPU (mlx/ops.cpp, `fp_quantize` without a global scale): per group of 16
    the scale max|w| / 6 in w's dtype, to FP8; w / scale in w's dtype; the first table entry nearest to it (numpy's
    argmin, as mlx's). (FP8 scale bytes, codes)."""
    groups = w.reshape(-1, 16)
    scale = mlx_to_fp8((groups.abs().amax(-1, keepdim=True) / torch.tensor(6.0, dtype=w.dtype)).float().numpy())
    decoded = torch.from_numpy(scale).view(torch.float8_e4m3fn).to(w.dtype)
    with np.errstate(invalid="ignore"):
        q = (groups / decoded).float().numpy()[..., None]
        codes = np.argmin(np.abs(q - MLX_FP4_TABLE), axis=-1)
    return scale.reshape(w.shape[0], -1), codes.reshape(w.shape).astype(np.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mlx_nvfp4_is_mx_quantize(dtype):
    """Scales and grid values of MLX's nvfp4 grid are mx.quantize's: an all-zero group (scale 0, every code 0), a group
    whose scale underflows FP8 (the same), one that saturates it at 448, and every FP4 tie (to the smaller magnitude)."""
    w = _weight(torch.float32)[:64]
    w[0, :16], w[1, :16], w[2, :16] = 1e-6, 3e3, torch.tensor(
        [0.25, -0.25, 0.75, -0.75, 1.25, -1.25, 1.75, 2.5, -2.5, 3.5, -3.5, 5.0, -5.0, -0.0, 6.0, -6.0])
    w = w.to(dtype)
    scales, codes = mx_nvfp4_reference(w)
    ours = quantize_weight(w, MLX_NVFP4)
    assert ours.global_scale is None and ours.scale.dtype == dtype
    assert np.array_equal(ours.scale.float().to(torch.float8_e4m3fn).view(torch.uint8).numpy(), scales)
    assert torch.equal(ours.qdata.float(), torch.from_numpy(MLX_FP4_TABLE[codes]))
    assert torch.equal(float_grids.mlx_fp4_codes(ours.qdata.float()), torch.from_numpy(codes))  # zeros as +0
    assert (scales == 0).any() and (scales == 0x7E).any() and (codes[2, :16] != float_grids.fp4_codes(w[2, :16].float()).numpy()).any()
    expected = torch.from_numpy(MLX_FP4_TABLE[codes]) * ours.scale.float().repeat_interleave(16, 1)
    assert torch.equal(ours.dequantize(dtype), expected.to(dtype))


def test_mlx_fp4_codes_break_ties_to_the_smaller_magnitude():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    ties = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, ties, ties + 1e-3, ties - 1e-3, torch.linspace(-7, 7, 1001), torch.tensor([100.0])])
    x = torch.cat([x, -x, torch.tensor([float("nan"), float("inf"), -float("inf")])])
    with np.errstate(invalid="ignore"):
        expected = np.argmin(np.abs(x.numpy()[:, None] - MLX_FP4_TABLE), axis=-1)
    assert torch.equal(float_grids.mlx_fp4_codes(x), torch.from_numpy(expected).to(torch.uint8))


def test_mlx_to_fp8_is_torchs_rounding_where_clamped():
    """The reference's FP8 rounding (mlx's ToFP8) is torch's float8_e4m3fn cast of the value clamped to 448, over every
    bfloat16 from 2^-12 to 2^10 (the scales' range, subnormals included)."""
    x = torch.arange(0x3980, 0x4480, dtype=torch.int16).view(torch.bfloat16).float()
    ours = float_grids.round_to_fp8(x).view(torch.uint8).numpy()
    assert np.array_equal(ours, mlx_to_fp8(x.numpy()))


def test_gptq_on_mlx_nvfp4_with_an_identity_hessian_is_rtn():
    from quantkit.algorithms.gptq import gptq_quantize
    from quantkit.algorithms.methods.gptq import GPTQArgs

    w = _weight(torch.bfloat16)[:, :128]
    ours, rtn = gptq_quantize(w, torch.eye(128), MLX_NVFP4, GPTQArgs()), quantize_weight(w, MLX_NVFP4)
    assert torch.equal(ours.qdata.float(), rtn.qdata.float()) and torch.equal(ours.scale, rtn.scale)
    assert ours.global_scale is None
