"""The IQ4 grids: llama.cpp's own bytes (below), packed bytes that gguf decodes to exactly our dequantization, the
grid's properties, GPTQ's two halves, and the edge cases of the search.

The golden bytes and digests are llama.cpp's: ggml_quantize_chunk (what llama-quantize calls: quantize_iq4_nl /
quantize_iq4_xs, ntry = 7, with or without an imatrix) from libggml-base.a, built with cmake (-O3, no -march, as
llama.cpp builds ggml-base) from llama-cpp-python 0.3.36's vendored ggml, by a small C main that read these tests'
inputs (written by numpy from the generators below) and wrote the blocks it got."""

import hashlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from quantkit.grids.iq_grids import (
    IQ4_FORMATS, IQ4_QTYPES, KVALUES_IQ4NL, IQ4Params, choose_iq4_params, nearest_code, pack_iq4, quantize_iq4,
    round_iq4, unpack_iq4,
)

Q = GGMLQuantizationType
IDS = [q.name for q in IQ4_QTYPES]


def _weight(rows=24, cols=512, seed=3) -> np.ndarray:
    """Gaussian rows of varied magnitude, outlier columns, and rows the search branches on: zero, constant, one
    sign, sparse, d past fp16's range (both types), blocks below GROUP_MAX_EPS, d below fp16's, one huge outlier
    per block, integers (ties), -0, a zero super-block in a row."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * np.exp(rng.uniform(-6, 2, (rows, 1))).astype(np.float32)
    w[:, [7, 100, 300]] *= 30
    w[0] = 0
    w[1] = 0.25
    w[2] = np.abs(w[2])
    w[3] = -np.abs(w[3])
    w[4] *= rng.random(cols) < 0.05
    w[5] = rng.standard_normal(cols) * 1e5
    w[6] = rng.standard_normal(cols) * 3e6
    w[7] = rng.standard_normal(cols) * 1e-16
    w[8] = rng.standard_normal(cols) * 1e-9
    w[9, ::32] = 1000.0
    w[10] = np.round(rng.standard_normal(cols) * 4)
    w[11] = -0.0
    w[12, :256] = 0
    return w


def _importance(cols=512, seed=4) -> np.ndarray:
    rng = np.random.default_rng(seed)
    importance = rng.gamma(0.5, 1.0, cols).astype(np.float32)
    importance[rng.random(cols) < 0.02] = 0
    return importance


def _small(cols: int) -> np.ndarray:
    """Two rows: a Gaussian one, and one with an outlier and a zero block (for IQ4_XS, a zero sub-block)."""
    w = np.random.default_rng(11).standard_normal((2, cols)).astype(np.float32) * 0.02
    w[1, 5], w[1, 32:64] = 0.9, 0
    return w


LLAMA_CPP_SHA256 = {  # first 16 hex digits of sha256(llama.cpp's bytes of _weight()), without / with _importance()
    Q.IQ4_NL: ("019b8dff7b407dd8", "880b519cb8e5922c"),
    Q.IQ4_XS: ("9a65d3a9e58b3525", "2547f1bd68dfe27b"),
}

LLAMA_CPP_HEX = {  # llama.cpp's bytes of _small(64) (IQ4_NL) / _small(256) (IQ4_XS), without / with _importance(cols)
    Q.IQ4_NL: (
        "c30cc87e7ec53615ab480c405f271c87d66b5b0cb44afcd6cbadd713cab90ea164c35089429f8888888888808888888878878888"
        "8888000088888888888888888888888888888888",
        "e40cc87e7ec53615ab480c405f271c87c67ac10cb44aecc6bbadd724bab90da264c35089142088888888888f8888888888888888"
        "8888000088888888888888888888888888888888",
    ),
    Q.IQ4_XS: (
        "d4000f3f57083c6dc87e7ec53615ab480c405f271c87d66bb44afcd6cbadd713cab90ea164c35089d62ce55825fba3e5691502f0"
        "bf4315681b87a8d93b06b7b859bd9a93794d8346567990621b859bdabd5c5cf7b5f5f6435b7b5cbb89c910d73339654cad4a2a39"
        "9d78b348b26e32aaeac269bc6a798c0957cdeb9e9eac3411a843394f37a64a06148c585900ee1ffe78888888888f888888888888"
        "88888888888888888888888888888888888888889bc8a579cf9c8157656a17bdab7bb9986991977a9d8daca4626ad88bb7996359"
        "a93abc6134876fc08b44fbe5facf7a5bcab297ff185fc7aeffa728ffb3702f107615a9d757abad39b7ca9288b43e8ab811eec560"
        "a7222a31aea33ac4d69ee965",
        "d2000f307808e66ec87e7ec53615ab480c405f271b87c67ab44aecc6bbadd724bab90da264c35089d62ce55825fba3e5691402f0"
        "bf4315681b87a8d93b06b7b859bd9a93794d8346ba867faef48b753552b4b3084b1b0acdb595b4548647ff29ddd79bc463c6e6d7"
        "9d78b348b26e32aaeac269bc6a798c0957cdeb9e9eac3411a843394f37a64a06148c585900ee1ffe78888888888f888888888888"
        "88888888888888888888888888888888888888889bc8a579cf9c8157656a17bdab7bb9986991977a9d8daca4626ad88bb7996359"
        "a93abc6134876fc08b44fbe5facf7a5bcab297ff185fc7aeffa728ffb3702f107615a9d757abad39b7ca9288b43e8ab811eec560"
        "a7222a31aea33ac4d69ee965",
    ),
}


def _quantize(w: np.ndarray, qtype, weighted: bool):
    importance = torch.from_numpy(_importance(w.shape[1])) if weighted else None
    return quantize_iq4(torch.from_numpy(w), qtype, importance)


@pytest.mark.parametrize("qtype", IQ4_QTYPES, ids=IDS)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
def test_bytes_equal_llama_cpps(qtype, weighted):
    packed = _quantize(_weight(), qtype, weighted).ggml_blocks()
    assert hashlib.sha256(packed.tobytes()).hexdigest()[:16] == LLAMA_CPP_SHA256[qtype][weighted]
    small = _quantize(_small(IQ4_FORMATS[qtype].super_block * (2 if qtype is Q.IQ4_NL else 1)), qtype, weighted)
    assert small.ggml_blocks().tobytes().hex() == LLAMA_CPP_HEX[qtype][weighted]


@pytest.mark.parametrize("qtype", IQ4_QTYPES, ids=IDS)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
def test_gguf_decodes_our_values_and_unpack_inverts_pack(qtype, weighted):
    weight = _weight(rows=16, seed=5)
    result = _quantize(weight, qtype, weighted)
    rows, cols = weight.shape
    fmt, params = IQ4_FORMATS[qtype], result.qparams
    assert result.codes.dtype == torch.int8 and result.codes.shape == (rows, cols)
    assert 0 <= result.codes.min() and result.codes.max() <= 15
    assert params.d.dtype == torch.float16 and params.d.shape == (rows, cols // fmt.super_block)
    assert params.mins is None and params.dmin is None
    packed = result.ggml_blocks()
    assert packed.shape == (rows, cols // fmt.super_block * fmt.type_bytes)
    decoded = torch.from_numpy(quants.dequantize(packed, qtype))
    torch.testing.assert_close(decoded, result.dequantize(), atol=0, rtol=0, equal_nan=True)
    assert torch.equal(IQ4Params.from_parts(qtype, params.parts()).round(torch.from_numpy(weight)), result.codes)
    back = unpack_iq4(packed, qtype)
    assert torch.equal(back.codes, result.codes) and torch.equal(back.qparams.d.view(torch.int16), params.d.view(torch.int16))
    assert (back.qparams.scales is None) == (params.scales is None)
    if params.scales is not None:
        assert torch.equal(back.qparams.scales, params.scales)


@pytest.mark.parametrize("qtype", IQ4_QTYPES, ids=IDS)
def test_a_value_is_its_steps_kvalue(qtype):
    """Each weight decodes to float(d) * kvalue (IQ4_NL) or float(d) * (ls - 32) * kvalue (IQ4_XS), in float32."""
    result = _quantize(_weight(rows=16, seed=6), qtype, weighted=False)
    codes, params = result.codes.numpy(), result.qparams
    d = params.d.numpy().astype(np.float32).repeat(IQ4_FORMATS[qtype].super_block, axis=1)
    if params.scales is not None:
        d = d * (params.scales.numpy().astype(np.float32) - 32).repeat(32, axis=1)
    expected = d * np.array(KVALUES_IQ4NL, np.float32)[codes]
    np.testing.assert_array_equal(result.dequantize().numpy(), expected)


def _best_index_int8(x: np.float32) -> int:
    """ggml-quants.c's best_index_int8 over kvalues_iq4nl, line by line."""
    values = np.array(KVALUES_IQ4NL, np.float32)
    if x <= values[0]:
        return 0
    if x >= values[15]:
        return 15
    low, high = 0, 15
    while high - low > 1:
        middle = (low + high) // 2
        if x < values[middle]:
            high = middle
        else:
            low = middle
    return high - 1 if np.float32(x - values[high - 1]) < np.float32(values[high] - x) else high


def test_nearest_code_is_best_index_int8():
    values = np.array(KVALUES_IQ4NL, np.float32)
    midpoints = (values[1:] + values[:-1]) / 2
    near = [m + np.arange(-40, 41, dtype=np.float32) * np.spacing(m) for m in np.concatenate([midpoints, values])]
    xs = np.concatenate(near + [np.random.default_rng(0).uniform(-140, 130, 3000).astype(np.float32),
                                np.array([-1e30, 1e30, 0.0, -0.0], np.float32)])
    expected = np.array([_best_index_int8(x) for x in xs])
    np.testing.assert_array_equal(nearest_code(torch.from_numpy(xs)).numpy(), expected)


@pytest.mark.parametrize("qtype", IQ4_QTYPES, ids=IDS)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
def test_choose_then_round_is_quantize(qtype, weighted):
    """GPTQ's two halves: the grid of the second half's columns (whole super-blocks) is the whole weight's there,
    and rounding columns onto it, a few at a time, gives quantize_iq4's codes and values."""
    weight = torch.from_numpy(_weight(rows=16, cols=512, seed=7))
    importance = torch.from_numpy(_importance()) if weighted else None
    whole = quantize_iq4(weight, qtype, importance)
    params = choose_iq4_params(weight[:, 256:], qtype, None if importance is None else importance[256:])
    for part in ("d", "scales", "d_search"):
        if getattr(params, part) is not None:
            expected = getattr(whole.qparams, part)
            assert torch.equal(getattr(params, part), expected[:, expected.shape[1] // 2:])
    codes, values = round_iq4(weight[:, 256:], params)
    assert torch.equal(codes, whole.codes[:, 256:])
    torch.testing.assert_close(values, whole.dequantize()[:, 256:], atol=0, rtol=0, equal_nan=True)
    for first in range(0, 256, 37):
        some, _ = round_iq4(weight[:, 256 + first:256 + first + 5], params, first_column=first)
        assert torch.equal(some, codes[:, first:first + 5])
    assert torch.equal(params.dequantize(codes[:, 40:], first_column=40), values[:, 40:])


@pytest.mark.parametrize("qtype", IQ4_QTYPES, ids=IDS)
def test_importance_changes_the_choice_and_lowers_its_error(qtype):
    weight = torch.randn(32, 512, generator=torch.Generator().manual_seed(8)) * 0.02
    importance = torch.from_numpy(_importance())
    plain, weighted = quantize_iq4(weight, qtype), quantize_iq4(weight, qtype, importance)
    assert not torch.equal(plain.codes, weighted.codes)
    error = lambda r: ((r.dequantize() - weight).pow(2) * importance).sum().item()  # noqa: E731
    assert error(weighted) < error(plain)


def test_zero_blocks_and_an_outlier():
    """An all-zero block: d 0 and every code 8 (the value 1), as llama.cpp leaves it; an IQ4_XS super-block of
    zeros stores d = -0. A block with one huge outlier keeps it on the grid's end, the others near zero."""
    weight = torch.zeros(2, 256)
    weight[1] = torch.randn(256, generator=torch.Generator().manual_seed(9)) * 0.01
    weight[1, 0:32] = 0
    weight[1, 40] = 50.0
    nl, xs = quantize_iq4(weight, Q.IQ4_NL), quantize_iq4(weight, Q.IQ4_XS)
    assert (nl.codes[0] == 8).all() and (nl.qparams.d[0] == 0).all() and (nl.codes[1, :32] == 8).all()
    assert (xs.codes[0] == 8).all() and xs.qparams.d[0, 0].view(torch.int16) == torch.tensor(-0.0).half().view(torch.int16)
    assert (xs.qparams.scales[0] == 32).all() and xs.qparams.scales[1, 0] == 32 and (xs.codes[1, :32] == 8).all()
    for result in (nl, xs):
        assert result.codes[1, 40] in (0, 15)
        torch.testing.assert_close(result.dequantize()[1, 40], torch.tensor(50.0), rtol=0.05, atol=0)


def test_xs_sub_scales_span_their_range():
    """IQ4_XS: d = -(the sub-scale of largest magnitude) / 32, so that sub-block's code is 0 (ls - 32 = -32) and
    every code lies in [0, 63]."""
    weight = torch.randn(64, 1024, generator=torch.Generator().manual_seed(10)) * torch.logspace(-3, 0, 1024)
    result = quantize_iq4(weight, Q.IQ4_XS)
    scales = result.qparams.scales
    assert scales.dtype == torch.int8 and scales.shape == (64, 32)
    assert scales.min() >= 0 and scales.max() <= 63
    assert (scales.reshape(-1, 8) == 0).any(1).all()
    assert scales.max() > 48  # the small sub-blocks of a super-block use the other end


def test_refusals():
    with pytest.raises(ValueError, match="Q4_K is not an IQ4 type; iq_grids quantizes IQ4_NL, IQ4_XS"):
        quantize_iq4(torch.zeros(2, 256), Q.Q4_K)
    with pytest.raises(ValueError, match="cols a multiple of 256, got shape \\[2, 288\\]"):
        choose_iq4_params(torch.zeros(2, 288), Q.IQ4_XS)
    with pytest.raises(ValueError, match="one value per input column, shape \\[64\\]"):
        quantize_iq4(torch.zeros(2, 64), Q.IQ4_NL, torch.ones(63))
    params = IQ4Params(Q.IQ4_NL, None, torch.zeros(2, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="codes must be integers in \\[0, 15\\]"):
        pack_iq4(torch.full((2, 64), 16, dtype=torch.int8), params)


@pytest.mark.parametrize("qtype", IQ4_QTYPES, ids=IDS)
def test_chunks_and_blocks_of_rows_change_nothing(qtype, monkeypatch):
    """Blocks are searched independently: chunks of one super-block give the bytes of whole chunks; rounding,
    decoding and packing a block of rows at a time give the whole tensor's; a bfloat16 weight searches as its
    float32 copy."""
    from quantkit.grids import ggml_blocks, iq_grids

    weight = (torch.randn(7, 512, generator=torch.Generator().manual_seed(12)) * 0.02).to(torch.bfloat16)
    importance = torch.from_numpy(_importance())
    found = quantize_iq4(weight, qtype, importance)
    whole = found.ggml_blocks(), found.dequantize(torch.bfloat16)
    assert np.array_equal(quantize_iq4(weight.float(), qtype, importance).ggml_blocks(), whole[0])
    monkeypatch.setattr(iq_grids, "_CHUNK_WEIGHTS", 1)
    monkeypatch.setattr(ggml_blocks, "ROW_BLOCK_ELEMENTS", 3 * 512)
    assert np.array_equal(quantize_iq4(weight, qtype, importance).ggml_blocks(), whole[0])
    assert torch.equal(found.dequantize(torch.bfloat16), whole[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", IQ4_QTYPES, ids=IDS)
def test_cuda_equals_cpu(qtype):
    weight, importance = torch.from_numpy(_weight()), torch.from_numpy(_importance())
    for imp in (None, importance):
        cpu = quantize_iq4(weight, qtype, imp)
        gpu = quantize_iq4(weight.cuda(), qtype, None if imp is None else imp.cuda())
        assert gpu.codes.is_cuda
        assert np.array_equal(gpu.ggml_blocks(), cpu.ggml_blocks())
