"""MLX's affine grid's compiled CPU loops (`cpu_kernels.mlx_*`) against their torch twins, bit for bit: round to
nearest (`quantize_mlx`), dequantization, the writer's rounding back, check and packing (`export.mlx`), the token
embedding's fused pass, and the float32 -> bfloat16 / float16 roundings, on float32, bfloat16 and float16 weights
that take every branch: zero and constant groups, groups below mx.quantize's smallest step (the edge rounds to code
0), one-signed groups (negative and positive steps), exact ties between two codes, magnitudes from 1e-30 to 1e4,
float16 subnormals."""

import numpy as np
import pytest
import torch

from quantkit.errors import ExportError
from quantkit.export import mlx
from quantkit.grids import cpu_kernels, mlx_grids, quantize_weight
from quantkit.grids.mlx_grids import quantize_mlx
from quantkit.grids.schemes import Granularity, QDtype, ScaleDtype, WeightSpec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def affine(bits: int, group: int = 64) -> WeightSpec:
    return WeightSpec(QDtype(f"int{bits}"), Granularity.GROUP, group, symmetric=False, scale_dtype=ScaleDtype.MLX_AFFINE)


def _weight(dtype: torch.dtype, rows=40, cols=512, seed=0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    low, high = (-7, 3) if dtype is torch.float16 else (-30, 4)  # float16: down to its subnormals, finite
    magnitude = np.float32(10.0) ** rng.uniform(low, high, (rows, 1)).astype(np.float32)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * magnitude
    w[0] = 0  # zero groups
    w[1, :64], w[1, 64:128] = 0.375, -0.375  # constant groups
    w[2], w[3] = np.abs(w[2]), -np.abs(w[3])  # one-signed groups
    w[4, :128] = 3e-8  # below half of mx.quantize's smallest step: the edge rounds to code 0
    w[4, 128:192:2] = -2e-8
    w[5, :64] = np.concatenate([[-8.0, 7.0], np.resize(np.arange(-7.5, 7.0, 1.0), 62)])  # ties (4 bits: step 1, bias -8)
    w[6, :64] = np.linspace(1.0, 1.01, 64)  # a narrow range far from zero: many codes per dtype step
    w[7] *= rng.random(cols) < 0.05  # sparse
    w[8, ::7] *= 10  # outliers
    return torch.from_numpy(w).to(dtype)


@pytest.fixture
def torch_only(monkeypatch):
    """The torch twins alone: the compiled loops switched off."""
    def use_torch():
        monkeypatch.setattr(mlx_grids, "compiled_kind", lambda device, dtype: None)
    return use_torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _fields(found) -> list[torch.Tensor]:
    return [found.qdata, found.scale, found.k.scales, found.k.biases]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits,group", [(2, 64), (3, 64), (4, 32), (4, 64), (5, 128), (6, 64), (8, 128)])
def test_quantize_and_dequantize_equal_torch(dtype, bits, group, torch_only):
    weight = _weight(dtype, seed=bits)
    found = quantize_mlx(weight, affine(bits, group))
    values = [found.dequantize(dtype), found.dequantize()]
    torch_only()
    reference = quantize_mlx(weight, affine(bits, group))
    assert all(_same(a, b) for a, b in zip(_fields(found), _fields(reference)))
    assert all(_same(a, b) for a, b in zip(values, [reference.dequantize(dtype), reference.dequantize()]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_the_writers_pass_equals_torch(dtype, bits, torch_only):
    """The writer on weights that hold their grid's values: MLX's own grid (after round to nearest) and a symmetric
    integer grid (float32: torchao's one rounding against mlx's two, `_within_rounding`), and the token embedding's
    fused pass (quantize, decode, write) against the quantized weight written."""
    weight = _weight(dtype, seed=10 + bits)
    own = quantize_weight(weight, affine(bits))
    symmetric = quantize_weight(weight, WeightSpec(QDtype(f"int{bits}"), Granularity.GROUP, 64, symmetric=True,
                                                   scale_dtype=ScaleDtype.MODEL))
    held = [(q.dequantize(dtype), q.qparams) for q in (own, symmetric)]
    found = [mlx.packed_tensors(w, qparams) for w, qparams in held]
    fused = mlx.quantized_packed(weight, affine(bits))
    torch_only()
    for (w, qparams), packed in zip(held, found):
        codes, scales, biases = mlx.grid_tensors(w, qparams)
        assert all(_same(a, b) for a, b in zip(packed, (mlx.pack(codes, bits), scales, biases)))
    assert mlx.quantized_packed(weight, affine(bits)) is None
    codes, scales, biases = mlx.grid_tensors(held[0][0], own.qparams)
    assert all(_same(a, b) for a, b in zip(fused, (mlx.pack(codes, bits), scales, biases)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weights_off_the_grid_are_refused_as_before(dtype):
    weight = _weight(dtype, seed=3)
    qparams = quantize_weight(weight, affine(4)).qparams
    with pytest.raises(ExportError, match="not on its MLX grid"):
        mlx.packed_tensors(weight, qparams)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_weights_take_the_torch_ops(dtype, torch_only):
    weight = _weight(dtype, rows=10, seed=4)
    weight[3, 70], weight[5, 1] = float("nan"), float("inf")
    found = quantize_mlx(weight, affine(4))
    assert mlx.quantized_packed(weight, affine(4)) is None
    torch_only()
    assert all(_same(a, b) for a, b in zip(_fields(found), _fields(quantize_mlx(weight, affine(4)))))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_roundings_to_16_bits_are_torchs(dtype):
    """`cpu_kernels._dtype_bits` (through mlx_dequantize: 1 x value + 0) against torch's casts: random float32 bit
    patterns over float16's whole range and beyond, and every float16 midpoint and its neighbours."""
    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 1 << 32, 400_000, dtype=np.uint64).astype(np.uint32)
    exponents = (patterns >> 23) & 0xFF
    patterns = patterns[(exponents >= 90) & (exponents <= 150)]  # float16's range, its subnormals, past its top
    halves = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    midpoints = ((halves[:-1] + halves[1:]) / 2).view(torch.int32).numpy().view(np.uint32)
    near = np.concatenate([midpoints.astype(np.int64) + k for k in (-1, 0, 1)]).astype(np.uint32)
    values = torch.from_numpy(np.concatenate([patterns, near, near | np.uint32(1 << 31)]).view(np.float32).copy())
    out = torch.empty(values.shape[0], 1, dtype=dtype)
    kind = mlx_grids.compiled_kind(values.device, dtype)
    cpu_kernels.mlx_dequantize(np.ones((values.shape[0], 1), np.uint8), values[:, None].numpy(),
                               np.zeros((values.shape[0], 1), np.float32), 1, kind, mlx_grids.float16_bits(),
                               mlx_grids.bits_of(out))
    assert torch.equal(_bits(out[:, 0]), _bits(values.to(dtype)))
