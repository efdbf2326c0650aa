"""llama.cpp's codebook i-quants' tables and bytes (`grids.iq_codebooks`): the grids as the gguf package holds
ggml-common.h's, and the packer's refusals of codes no block can store. Bit for bit against gguf's dequantization:
tests/unit/grids/test_iq_low.py."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from quantkit.grids import iq_codebooks
from quantkit.grids.iq_codebooks import FORMATS, grid, grid_index, grid_levels, levels, pack

TYPES = list(FORMATS)
POINTS = {Q.IQ2_XXS: 256, Q.IQ2_XS: 512, Q.IQ2_S: 1024, Q.IQ3_XXS: 256, Q.IQ3_S: 512, Q.IQ1_S: 2048, Q.IQ1_M: 2048}


@pytest.mark.parametrize("qtype", TYPES)
def test_each_grid_is_ggmls_table_and_every_point_finds_its_index(qtype):
    points = grid(qtype)
    assert points.shape == (POINTS[qtype], FORMATS[qtype].width)
    assert len(np.unique(points, axis=0)) == len(points)  # distinct points
    assert np.array_equal(levels(qtype)[grid_levels(qtype)], points)
    assert np.array_equal(grid_index(qtype, grid_levels(qtype)), np.arange(len(points)))


def test_the_first_iq2xxs_and_iq3xxs_points_are_ggml_commons():
    # ggml-common.h: iq2xxs_grid[0] = 0x0808080808080808, iq2xxs_grid[1] = 0x080808080808082b;
    # iq3xxs_grid[0] = 0x04040404, iq3xxs_grid[1] = 0x04040414; iq1s_grid[0] = 0xffffffffffffffff
    assert grid(Q.IQ2_XXS)[0].tolist() == [8] * 8 and grid(Q.IQ2_XXS)[1].tolist() == [43] + [8] * 7
    assert grid(Q.IQ3_XXS)[0].tolist() == [4] * 4 and grid(Q.IQ3_XXS)[1].tolist() == [20, 4, 4, 4]
    assert grid(Q.IQ1_S)[0].tolist() == [-1] * 8


@pytest.mark.parametrize("qtype", TYPES)
def test_block_sizes_are_ggmls(qtype):
    assert FORMATS[qtype].type_bytes == GGML_QUANT_SIZES[qtype][1] and GGML_QUANT_SIZES[qtype][0] == 256


def _valid(qtype, rows=2, cols=256, seed=0):
    """Codes on the grid, all signs positive, and their scales."""
    fmt = FORMATS[qtype]
    rng = np.random.default_rng(seed)
    index = rng.integers(0, POINTS[qtype], size=(rows, cols // fmt.width))
    level = grid_levels(qtype)[index].reshape(rows, cols)
    codes = (level + 1 if fmt.signed else level).astype(np.int8)
    scales = rng.integers(0, fmt.max_scale + 1, size=(rows, cols // fmt.scale_block)).astype(np.int8)
    d = np.full((rows, cols // 256), 0.01, np.float16)
    shifts = rng.integers(0, 2, size=(rows, cols // fmt.shift_block)).astype(np.int8) if fmt.shift_block else None
    return codes, scales, d, shifts


@pytest.mark.parametrize("qtype", TYPES)
def test_pack_writes_whole_blocks(qtype):
    codes, scales, d, shifts = _valid(qtype, rows=3, cols=512)
    assert pack(qtype, codes, scales, d, shifts).shape == (3, 2 * FORMATS[qtype].type_bytes)


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ3_XXS])
def test_seven_stored_signs_refuse_an_odd_count_of_negatives(qtype):
    codes, scales, d, shifts = _valid(qtype)
    codes[0, 3] = -codes[0, 3]
    with pytest.raises(ValueError, match="count of negatives must be even"):
        pack(qtype, codes, scales, d, shifts)
    codes[0, 5] = -codes[0, 5]  # two negatives: stored
    pack(qtype, codes, scales, d, shifts)


@pytest.mark.parametrize("qtype", [Q.IQ2_S, Q.IQ3_S])
def test_a_bit_per_sign_takes_any_signs(qtype):
    codes, scales, d, shifts = _valid(qtype)
    codes[0, 3] = -codes[0, 3]
    pack(qtype, codes, scales, d, shifts)


@pytest.mark.parametrize("qtype, bad, says", [
    (Q.IQ2_XXS, lambda c: c.__setitem__((0, 0), 0), "0 is none"),
    (Q.IQ2_XXS, lambda c: c.__setitem__((0, 0), 4), r"integers in \[-3, 3\]"),
    (Q.IQ1_S, lambda c: c.__setitem__((0, 0), 3), r"integers in \[0, 2\]"),
])
def test_codes_off_the_types_range_are_refused(qtype, bad, says):
    codes, scales, d, shifts = _valid(qtype)
    bad(codes)
    with pytest.raises(ValueError, match=says):
        pack(qtype, codes, scales, d, shifts)


def test_a_vector_that_is_no_grid_point_is_refused():
    codes, scales, d, shifts = _valid(Q.IQ2_XXS)
    codes[0, :8] = 3  # eight 43s: not one of iq2xxs_grid's 256 points
    assert iq_codebooks._index_table(Q.IQ2_XXS)[iq_codebooks._keys(np.full((1, 8), 2), 3)][0] == -1
    with pytest.raises(ValueError, match="off the type's grid"):
        pack(Q.IQ2_XXS, codes, scales, d, shifts)


def test_shapes_are_checked():
    codes, scales, d, shifts = _valid(Q.IQ1_M)
    with pytest.raises(ValueError, match="multiple of 256"):
        pack(Q.IQ1_M, codes[:, :128], scales, d, shifts)
    with pytest.raises(ValueError, match="sub-scale codes"):
        pack(Q.IQ1_M, codes, scales[:, :4], d, shifts)
    with pytest.raises(ValueError, match="float16"):
        pack(Q.IQ1_M, codes, scales, d.astype(np.float32), shifts)
    with pytest.raises(ValueError, match="needs shifts"):
        pack(Q.IQ1_M, codes, scales, d, None)
    with pytest.raises(ValueError, match=r"\[0, 7\]"):
        pack(Q.IQ1_M, codes, scales + 8, d, shifts)
