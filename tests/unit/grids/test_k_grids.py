"""The K-quant grids: codes in range, packed bytes that gguf decodes to exactly our dequantization, less error
than plain round-to-nearest of the same bits, and llama.cpp's own bytes (digests of its quantize_q*_K output on a
fixed weight, from scripts/check_k_grids.py's harness built with gcc -O2 from llama-cpp-python 0.3.36's ggml)."""

import hashlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from quantkit.grids.ggml_blocks import FORMATS
from quantkit.grids.k_grids import K_QTYPES, choose_k_qparams, quantize_k, round_k

Q = GGMLQuantizationType
IDS = [q.name for q in K_QTYPES]


def _weight(rows=32, cols=512, seed=3) -> np.ndarray:
    """Gaussian rows of varied magnitude, three outlier columns, and rows the searches branch on: zero, constant,
    positive, negative, sparse."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((rows, cols)).astype(np.float32) * np.exp(rng.uniform(-4, 1, (rows, 1))).astype(np.float32)
    weight[:, [7, 100, 300]] *= 20
    weight[0] = 0
    weight[1] = 0.25
    weight[2] = np.abs(weight[2])
    weight[3] = -np.abs(weight[3])
    weight[4] *= rng.random(cols) < 0.05
    return weight


def _importance(cols=512) -> np.ndarray:
    return np.random.default_rng(4).gamma(0.5, 1.0, cols).astype(np.float32)


LLAMA_CPP_SHA256 = {  # first 16 hex digits of sha256(llama.cpp's quantize_q*_K bytes of _weight()), without / with _importance()
    Q.Q2_K: ("bc8949a962a466be", "53b6c159716cbafc"),
    Q.Q3_K: ("a771cf2f6abbe564", "2828a2bf9ecd0aef"),
    Q.Q4_K: ("e57d60acffcba452", "c40e8045ed72119c"),
    Q.Q5_K: ("24fbdb8ae93aa74d", "462f2d2a4665b2ed"),
    Q.Q6_K: ("1704c0194a10ae74", "dc034aaf4899b76e"),
}


@pytest.mark.parametrize("qtype", K_QTYPES, ids=IDS)
@pytest.mark.parametrize("weighted", [False, True], ids=["ref", "imatrix"])
def test_bytes_equal_llama_cpps(qtype, weighted):
    importance = torch.from_numpy(_importance()) if weighted else None
    packed = quantize_k(torch.from_numpy(_weight()), qtype, importance).ggml_blocks()
    assert hashlib.sha256(packed.tobytes()).hexdigest()[:16] == LLAMA_CPP_SHA256[qtype][weighted]


@pytest.mark.parametrize("qtype", K_QTYPES, ids=IDS)
@pytest.mark.parametrize("weighted", [False, True], ids=["ref", "imatrix"])
def test_codes_in_range_and_gguf_decodes_our_values(qtype, weighted):
    weight = torch.from_numpy(_weight(rows=16, seed=5))
    importance = torch.from_numpy(_importance()) if weighted else None
    result = quantize_k(weight, qtype, importance)
    fmt = FORMATS[qtype]
    rows, cols = weight.shape
    assert result.codes.dtype == torch.int8 and result.codes.shape == (rows, cols)
    assert fmt.code_range[0] <= result.codes.min() and result.codes.max() <= fmt.code_range[1]
    assert result.qparams.scales.shape == (rows, cols // fmt.sub_block) and result.qparams.d.shape == (rows, cols // 256)
    assert result.qparams.d.dtype == torch.float16
    assert fmt.scale_range[0] <= result.qparams.scales.min() and result.qparams.scales.max() <= fmt.scale_range[1]
    assert (result.qparams.mins is not None) == fmt.has_mins
    decoded = quants.dequantize(result.ggml_blocks(), qtype)
    torch.testing.assert_close(torch.from_numpy(decoded), result.dequantize(), atol=0, rtol=0)


def _rtn_error(weight: torch.Tensor, bits: int, group: int = 32) -> float:
    """Q4_0-style round-to-nearest: per group of 32, d = signed absmax / -2^(bits-1), codes in [-2^(bits-1), 2^(bits-1) - 1]."""
    groups = weight.reshape(-1, group)
    peak = groups.gather(1, groups.abs().argmax(1, keepdim=True))
    d = peak / -(2 ** (bits - 1))
    d = torch.where(d == 0, 1.0, d)
    codes = torch.round(groups / d).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return (codes * d - groups).pow(2).mean().item()


@pytest.mark.parametrize("qtype", K_QTYPES, ids=IDS)
def test_error_below_plain_rtn_of_the_same_bits(qtype):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 512, generator=generator)
    weight[:, [5, 300, 477]] *= 15
    error = (quantize_k(weight, qtype).dequantize() - weight).pow(2).mean().item()
    assert error < _rtn_error(weight, FORMATS[qtype].bits)


@pytest.mark.parametrize("qtype", K_QTYPES, ids=IDS)
def test_choose_then_round_is_quantize(qtype):
    """GPTQ's two halves: the grid of a super-block's columns, then columns rounded onto it one at a time,
    decode as `quantize_k` does (its codes differ only where a sub-block's step is 0, where all decode alike)."""
    weight = torch.from_numpy(_weight(rows=16, cols=512, seed=6))
    whole = quantize_k(weight, qtype)
    qparams = choose_k_qparams(weight[:, 256:], qtype)
    torch.testing.assert_close(qparams.scales, whole.qparams.scales[:, whole.qparams.scales.shape[1] // 2:], atol=0, rtol=0)
    columns = [round_k(weight[:, 256 + j: 257 + j], qparams, first_column=j) for j in range(0, 256, 37)]
    expected = round_k(weight[:, 256:], qparams)
    torch.testing.assert_close(torch.cat(columns, 1), expected[:, ::37], atol=0, rtol=0)
    torch.testing.assert_close(qparams.dequantize(expected), whole.dequantize()[:, 256:], atol=0, rtol=0)


def test_importance_changes_the_choice():
    weight = torch.from_numpy(_weight(rows=16, seed=8))
    importance = torch.from_numpy(_importance())
    plain, weighted = quantize_k(weight, Q.Q4_K), quantize_k(weight, Q.Q4_K, importance)
    err = lambda r: ((r.dequantize() - weight).pow(2) * importance).sum().item()  # noqa: E731
    assert err(weighted) < err(plain)


def test_refusals():
    with pytest.raises(ValueError, match="Q4_0 is not a K-quant; k_grids quantizes Q2_K, Q3_K"):
        quantize_k(torch.zeros(2, 256), Q.Q4_0)
    with pytest.raises(ValueError, match="cols a multiple of 256, got shape \\[2, 300\\]"):
        choose_k_qparams(torch.zeros(2, 300), Q.Q4_K)
    with pytest.raises(ValueError, match="one value per input column, shape \\[256\\]"):
        quantize_k(torch.zeros(2, 256), Q.Q6_K, torch.ones(255))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", K_QTYPES, ids=IDS)
def test_cuda_equals_cpu(qtype):
    weight, importance = torch.from_numpy(_weight()), torch.from_numpy(_importance())
    for imp in (None, importance):
        cpu = quantize_k(weight, qtype, imp)
        gpu = quantize_k(weight.cuda(), qtype, None if imp is None else imp.cuda())
        assert gpu.codes.is_cuda
        assert np.array_equal(gpu.ggml_blocks(), cpu.ggml_blocks())


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_the_chunk_size_changes_no_byte(qtype, monkeypatch):
    """Super-blocks are searched independently: chunks of 3 (a GPU's 64 Ki, in small) give the bytes of chunks of
    1024, the last chunk short."""
    from quantkit.grids import k_grids

    weight = torch.randn(5, 4 * 256, generator=torch.Generator().manual_seed(3)) * 0.02
    qtype = GGMLQuantizationType[qtype]
    whole = k_grids.quantize_k(weight, qtype).ggml_blocks()
    monkeypatch.setattr(k_grids, "_CHUNK_SUPER_BLOCKS", 3)
    assert np.array_equal(k_grids.quantize_k(weight, qtype).ggml_blocks(), whole)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_blocks_of_rows_change_no_value(qtype, monkeypatch):
    """round_k, dequantize and the packers work a block of rows at a time (`ggml_blocks.row_blocks`, so that a
    128k-token embedding holds no whole float32 copies): blocks of one row and a few rows, the last one short,
    give the codes, values and bytes of the whole tensor at once; a bfloat16 weight searches as its float32 copy."""
    from quantkit.grids import ggml_blocks

    weight = (torch.randn(7, 2 * 256, generator=torch.Generator().manual_seed(4)) * 0.02).to(torch.bfloat16)
    qtype = GGMLQuantizationType[qtype]
    found = quantize_k(weight, qtype)
    assert np.array_equal(found.ggml_blocks(), quantize_k(weight.float(), qtype).ggml_blocks())
    whole = (found.ggml_blocks(), round_k(weight, found.qparams), found.qparams.dequantize(found.codes, dtype=torch.bfloat16))
    for elements in (1, 3 * 512):  # one row a block (at least one row), then blocks of 3 rows
        monkeypatch.setattr(ggml_blocks, "ROW_BLOCK_ELEMENTS", elements)
        assert len(ggml_blocks.row_blocks(7, 512)) == (7 if elements == 1 else 3)
        assert np.array_equal(found.ggml_blocks(), whole[0])
        assert torch.equal(round_k(weight, found.qparams), whole[1])
        assert torch.equal(found.qparams.dequantize(found.codes, dtype=torch.bfloat16), whole[2])
