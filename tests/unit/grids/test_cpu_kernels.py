"""The compiled CPU loops (`grids.cpu_kernels`) against their torch twins, bit for bit: every code, scale code and
d of the K searches and IQ4 searches and of the roundings onto a fixed grid, on weights that take every branch
(zero, constant, one-signed, sparse and outlier rows; magnitudes from 1e-30 to 1e4; fp16-rounded values, as a
float16 model's)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from quantkit.grids import iq_grids, k_grids
from quantkit.grids.iq_grids import choose_iq4_params, quantize_iq4
from quantkit.grids.k_grids import quantize_k, round_k

Q = GGMLQuantizationType
K_TYPES = (Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _weight(rows=48, cols=1024, seed=0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((rows, cols)).astype(np.float32) * np.exp(rng.uniform(-6, 2, (rows, 1))).astype(np.float32)
    weight[:, [3, 200, 700]] *= 50
    weight[0] = 0
    weight[1] = -0.375
    weight[2] = np.abs(weight[2])
    weight[3] = -np.abs(weight[3])
    weight[4] *= rng.random(cols) < 0.03
    weight[5, :256] = 0  # a zero super-block beside others
    weight[6, 32:64] = 1e-30  # a sub-block below ggml's 1e-15
    weight[7] = np.float16(weight[7])  # ties and repeated values
    weight[8] *= 1e4
    weight[9, ::2] = 0.5
    return torch.from_numpy(weight)


@pytest.fixture
def torch_only(monkeypatch):
    """The torch twins alone: the compiled loops switched off."""
    def use_torch():
        monkeypatch.setattr(k_grids, "_compiled", lambda x: False)
    return use_torch


def _fields(found) -> dict:
    grid = found.qparams
    return {"codes": found.codes, **{name: t for name in ("scales", "d", "mins", "dmin", "d_search")
                                     if (t := getattr(grid, name, None)) is not None}}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype
        assert torch.equal(a[name].view(torch.int16) if a[name].dtype == torch.float16 else a[name],
                           b[name].view(torch.int16) if b[name].dtype == torch.float16 else b[name]), name


@pytest.mark.parametrize("qtype", K_TYPES, ids=[q.name for q in K_TYPES])
@pytest.mark.parametrize("seed", [0, 1])
def test_k_search_equals_torch(qtype, seed, torch_only):
    weight = _weight(seed=seed)
    compiled = _fields(quantize_k(weight, qtype))
    torch_only()
    _same(compiled, _fields(quantize_k(weight, qtype)))


@pytest.mark.parametrize("qtype", (Q.Q3_K, *K_TYPES), ids=["Q3_K", *[q.name for q in K_TYPES]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_k_equals_torch(qtype, dtype, torch_only):
    """Rounding onto a fixed grid, from the grid's own values and from values between its steps, at an offset."""
    weight = _weight(seed=2)
    grid = quantize_k(weight, qtype).qparams
    moved = (weight + torch.randn_like(weight) * weight.abs().mean(1, keepdim=True) / 7).to(dtype)
    compiled = [round_k(moved, grid), round_k(moved[:, 256:], grid, first_column=256)]
    torch_only()
    assert all(torch.equal(a, b) for a, b in zip(compiled, [round_k(moved, grid), round_k(moved[:, 256:], grid, 256)]))


@pytest.mark.parametrize("qtype", (Q.IQ4_NL, Q.IQ4_XS), ids=["IQ4_NL", "IQ4_XS"])
@pytest.mark.parametrize("seed", [0, 1])
def test_iq4_search_and_rounding_equal_torch(qtype, seed, torch_only, monkeypatch):
    weight = _weight(seed=seed)
    compiled = _fields(quantize_iq4(weight, qtype))
    moved = weight + torch.randn_like(weight) * weight.abs().mean(1, keepdim=True) / 5
    params = choose_iq4_params(weight, qtype)
    rounded = [params.round(moved), params.round(moved[:, 256:], first_column=256)]
    torch_only()
    monkeypatch.setattr(iq_grids, "_compiled", lambda x: False)
    _same(compiled, _fields(quantize_iq4(weight, qtype)))
    assert torch.equal(rounded[0], params.round(moved))
    assert torch.equal(rounded[1], params.round(moved[:, 256:], first_column=256))


def test_non_finite_weights_take_the_torch_ops():
    weight = _weight(rows=16, seed=3)
    weight[0, 5] = float("nan")
    assert not k_grids._compiled(weight)
    assert k_grids._compiled(weight[1:])


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_integer_codes_equal_torch(kind, dtype, torch_only):
    """GGUF's integer blocks: the codes recovered from the dequantized weight (bfloat16's ties included)."""
    from quantkit.export.gguf import codes
    from quantkit.grids import quantize_weight
    from quantkit.quant import gguf_types

    weight = _weight(seed=4)[8:].to(dtype)
    found = quantize_weight(weight, gguf_types.spec(kind))
    values = found.dequantize(dtype)
    compiled = codes(values, found.qparams)
    assert torch.equal(compiled, found.qdata.to(torch.int8)) or dtype is torch.bfloat16
    torch_only()
    assert torch.equal(compiled, codes(values, found.qparams))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_signed_largest_equals_torch(dtype, torch_only):
    from quantkit.grids.qparams import _largest

    groups = _weight(seed=6).to(dtype).reshape(48, -1, 32)
    groups[5, 3] = torch.tensor([-2.0, 2.0] * 16, dtype=dtype)  # a tie: the first
    compiled = _largest(groups)
    torch_only()
    assert torch.equal(compiled, _largest(groups))
