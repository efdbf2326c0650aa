"""llama.cpp's codebook i-quants as a grid family (`grids.iq_low`): every file bit for bit against the gguf package's
dequantization, the search no worse than the plain rule, GPTQ on the codebook below round to nearest, and the
family's parts (empty, resume, the GGUF type table)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from quantkit import grids
from quantkit.algorithms.gptq import gptq_quantize
from quantkit.algorithms.methods.gptq import GPTQArgs
from quantkit.grids import iq_low
from quantkit.grids.iq_codebooks import FORMATS, grid, levels
from quantkit.grids.iq_low import CODEBOOK_GRID, CodebookParams, decode_steps, quantize_codebook
from quantkit.grids.schemes import SchemeError
from quantkit.quant import gguf_types

TYPES = list(FORMATS)
NAMES = [q.name for q in TYPES]


def weights(kind: str, rows: int = 8, cols: int = 512, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    if kind == "zeros":
        w[:, :256] = 0.0
        w[2:] = 0.0
    elif kind == "outliers":
        w[0, 7], w[1, 300], w[3, :32] = 80.0, -500.0, 1e-6
    elif kind == "constant":
        w[:] = 0.75
        w[1] = -2.0
        w[2, :300] = 1e-30
    elif kind == "large":
        w *= 5e3
    return w


def gguf_values(params: CodebookParams, codes: torch.Tensor) -> torch.Tensor:
    data = params.pack(codes)
    return torch.from_numpy(dequantize(data, params.qtype).reshape(codes.shape).astype(np.float32))


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
@pytest.mark.parametrize("kind", ["gaussian", "zeros", "outliers", "constant", "large"])
@pytest.mark.parametrize("with_importance", [True, False])
def test_the_file_dequantizes_to_the_in_memory_weight_bit_for_bit(qtype, kind, with_importance):
    w = weights(kind)
    importance = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(1)) + 0.05 if with_importance else None
    codes, params = quantize_codebook(w, qtype, importance)
    mine = params.dequantize(codes)
    assert torch.equal(gguf_values(params, codes), mine)
    assert torch.isfinite(mine).all()
    if kind == "zeros":
        assert torch.equal(mine[2:], torch.zeros_like(mine[2:]))


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_rounding_the_values_back_gives_codes_that_decode_alike(qtype):
    """The GGUF writer takes a Linear that holds its grid's values (in the model's dtype) back to codes (`round`)."""
    w = weights("outliers")
    codes, params = quantize_codebook(w, qtype)
    values = params.dequantize(codes)
    for dtype in (torch.float32, torch.bfloat16):
        again = params.round(values.to(dtype))
        assert torch.equal(params.dequantize(again), values)
        assert torch.equal(gguf_values(params, again), values)


def plain_error(w: torch.Tensor, qtype, importance: torch.Tensor) -> float:
    """The straightforward rule, on the same weighting: each sub-block's scale its largest magnitude over the top
    level, d the largest of those over the top sub-scale, each sub-scale code the nearest, then each vector's nearest
    grid point (the whole grid, IQ1's shift the better of the two per shift block) at its exact step."""
    fmt = FORMATS[qtype]
    points = torch.from_numpy(grid(qtype))
    x = w.reshape(-1, 256)
    qw = importance.reshape(-1, 256).repeat(w.shape[0], 1)
    sigma2 = (x * x).mean(1, keepdim=True) * (1.0 if qtype in (Q.IQ2_XXS, Q.IQ2_XS) else 2.0)
    wt = qw * torch.sqrt(sigma2 + x * x)
    top = float(points.abs().max()) + (0.125 if not fmt.signed else 0)
    scale = x.abs().reshape(x.shape[0], -1, fmt.scale_block).amax(-1) / top
    offset, mult, post = fmt.step
    d = (scale.amax(1, keepdim=True) / float(decode_steps(torch.ones(1), torch.tensor([fmt.max_scale]), fmt))).half().float()
    ls = torch.round((scale / d.clamp(min=1e-30) / post - offset) / mult).clamp(0, fmt.max_scale)
    step = decode_steps(d, ls, fmt).repeat_interleave(fmt.scale_block, 1)
    total = 0.0
    for row, wrow, srow in zip(x, wt, step):
        for first in range(0, 256, 8):
            total += _best_unit(row[first:first + 8], wrow[first:first + 8], srow[first], points, fmt)
    if fmt.shift_block == 32:  # IQ1_S: recomputed with the shift shared per 32
        total = 0.0
        for row, wrow, srow in zip(x, wt, step):
            for first in range(0, 256, 32):
                total += min(sum(_unit_error(row[f:f + 8], wrow[f:f + 8], srow[f], points, shift)
                                 for f in range(first, first + 32, 8)) for shift in (0.125, -0.125))
    return total / float((wt * x * x).sum())


def _unit_error(x, w, step, points, shift) -> float:
    return float((w * (step * (points + shift) - x) ** 2).sum(1).min())


def _best_unit(x, w, step, points, fmt) -> float:
    if not fmt.signed:
        return min(_unit_error(x, w, step, points, shift) for shift in (0.125, -0.125))
    xval = x.abs()
    if fmt.signs == "parity" and int((x < 0).sum()) % 2:
        j = int((w * x * x).argmin())
        xval[j] = -xval[j]
    return sum(_unit_error(xval[i:i + fmt.width], w[i:i + fmt.width], step, points, 0.0) for i in range(0, 8, fmt.width))


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_the_search_has_no_more_weighted_error_than_the_plain_rule(qtype):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 512, generator=g) * (0.5 + torch.rand(512, generator=g))
    importance = torch.rand(512, generator=g) * 3 + 0.1
    codes, params = quantize_codebook(w, qtype, importance)
    x = w.reshape(-1, 256)
    sigma2 = (x * x).mean(1, keepdim=True) * (1.0 if qtype in (Q.IQ2_XXS, Q.IQ2_XS) else 2.0)
    wt = importance.reshape(-1, 256).repeat(w.shape[0], 1) * torch.sqrt(sigma2 + x * x)
    mine = float((wt * (params.dequantize(codes).reshape(-1, 256) - x) ** 2).sum() / (wt * x * x).sum())
    plain = plain_error(w, qtype, importance)
    print(f"{qtype.name}: weighted relative error {mine:.5f}, plain rule {plain:.5f}")
    assert mine <= plain


def correlated(cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 32, generator=g) @ torch.randn(32, cols, generator=g) * 0.3
    x += torch.randn(1024, cols, generator=g) * (0.2 + torch.rand(cols, generator=g))
    return 2 * x.T @ x / x.shape[0]


def h_error(q: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> float:
    d = q - w
    return float(torch.einsum("ri,ij,rj->", d, h, d) / torch.einsum("ri,ij,rj->", w, h, w))


@pytest.mark.parametrize("name", NAMES)
def test_gptq_on_the_codebook_beats_round_to_nearest_and_stays_on_the_grid(name):
    spec = gguf_types.spec(name)
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(4))
    h = correlated(512)
    found = gptq_quantize(w, h, spec, GPTQArgs())
    rtn = grids.quantize_weight(w, spec, importance=h.diagonal())
    gptq_err, rtn_err = h_error(found.dequantize(), w, h), h_error(rtn.dequantize(), w, h)
    print(f"{name}: H-weighted relative error GPTQ {gptq_err:.5f}, round to nearest {rtn_err:.5f}")
    assert gptq_err < 0.7 * rtn_err
    assert torch.equal(gguf_values(found.k, found.qdata), found.dequantize())


def test_gptq_refuses_actorder_on_a_codebook():
    spec = gguf_types.spec("IQ2_XXS")
    with pytest.raises(SchemeError, match="actorder"):
        gptq_quantize(torch.randn(4, 256), torch.eye(256), spec, GPTQArgs(actorder=True))


@pytest.mark.parametrize("name", NAMES)
def test_the_family_holds_each_type(name):
    spec = gguf_types.spec(name)
    assert grids.family_of(spec) is CODEBOOK_GRID and spec.codebook_type == name and spec.block_type == name
    assert CODEBOOK_GRID.fake_quant(spec) == "grid"
    from quantkit.export.gguf import ggml_type
    assert ggml_type(spec) is Q[name]
    w = weights("gaussian")
    found = grids.quantize_weight(w, spec)
    empty = grids.empty_quantized(w, spec)
    assert [(t.shape, t.dtype) for t in (empty.qdata, empty.scale)] == [(t.shape, t.dtype) for t in (found.qdata, found.scale)]
    assert {k: (t.shape, t.dtype) for k, t in empty.k.parts().items()} == {k: (t.shape, t.dtype) for k, t in found.k.parts().items()}
    resumed = CODEBOOK_GRID.block_params(spec, found.k.parts())
    assert torch.equal(resumed.dequantize(found.qdata), found.dequantize())
    assert torch.equal(grids.fake_quantize_weight(w, spec), found.dequantize())


@pytest.mark.parametrize("name, bpw", [("IQ1_S", 1.5625), ("IQ1_M", 1.75), ("IQ2_XXS", 2.0625), ("IQ2_XS", 2.3125),
                                       ("IQ2_S", 2.5625), ("IQ3_XXS", 3.0625), ("IQ3_S", 3.4375)])
def test_the_gguf_type_table_knows_the_types(name, bpw):
    assert gguf_types.bits_per_weight(name.lower()) == bpw and gguf_types.canonical(name.lower()) == name
    assert gguf_types.fits(name, 512) and not gguf_types.fits(name, 128)
    assert levels(Q[name]).dtype == np.float32


@pytest.mark.parametrize("qtype", [Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_S], ids=lambda q: q.name)
def test_without_an_importance_matrix_every_weight_counts_alike(qtype, monkeypatch):
    """No imatrix (a token embedding, round to nearest without data): the search minimises the plain squared error,
    not llama.cpp's x^2-weighted one, which the exact search over-fits to the largest weights (an embedding row's
    small entries then carry twice the error)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 512, generator=g) * torch.exp(torch.randn(16, 512, generator=g))  # heavy-tailed rows
    codes, params = quantize_codebook(w, qtype)
    plain = float(((params.dequantize(codes) - w) ** 2).sum())
    monkeypatch.setattr(iq_low, "element_weights", lambda x, qw, fmt: x * x)  # llama.cpp's weights
    codes, params = quantize_codebook(w, qtype)
    squared = float(((params.dequantize(codes) - w) ** 2).sum())
    print(f"{qtype.name}: plain squared error {plain:.2f} unweighted, {squared:.2f} x^2-weighted")
    assert plain < 0.8 * squared
