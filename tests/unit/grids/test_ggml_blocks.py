"""Packed GGML blocks decode, through gguf's own dequantizers, to exactly the values their codes define; where
gguf has a quantizer, packing the codes it chose gives its bytes."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from quantkit.grids.ggml_blocks import FORMATS, PACKERS, block_format, pack

Q = GGMLQuantizationType
ROWS, COLS = 6, 512


def _random_fields(qtype, seed=0):
    """Random codes and scale codes of `qtype`, and the float32 values ggml decodes them to (its order of
    operations: d * sc first, then times q, minus dmin * mn)."""
    fmt, rng = FORMATS[qtype], np.random.default_rng(seed)
    codes = rng.integers(*fmt.code_range, endpoint=True, size=(ROWS, COLS))
    half = lambda n: (rng.standard_normal((ROWS, COLS // n)) * 0.01).astype(np.float16)  # noqa: E731
    per_sub = lambda values: np.repeat(values, fmt.sub_block, axis=1)  # noqa: E731
    per_super = lambda values: np.repeat(values.astype(np.float32), fmt.super_block, axis=1)  # noqa: E731
    q = codes.astype(np.float32)
    if fmt.scale_range is None:
        fields = {"d": half(32)}
        if fmt.has_mins:
            fields["m"] = half(32)
            return codes, fields, per_super(fields["d"]) * q + per_super(fields["m"])
        return codes, fields, per_super(fields["d"]) * q
    fields = {"scales": rng.integers(*fmt.scale_range, endpoint=True, size=(ROWS, COLS // fmt.sub_block)), "d": half(256)}
    scaled = per_super(fields["d"]) * per_sub(fields["scales"]).astype(np.float32)
    if not fmt.has_mins:
        return codes, fields, scaled * q
    fields["mins"] = rng.integers(*fmt.scale_range, endpoint=True, size=fields["scales"].shape)
    fields["dmin"] = np.abs(half(256))
    return codes, fields, scaled * q - per_super(fields["dmin"]) * per_sub(fields["mins"]).astype(np.float32)


SCALED = [q for q in FORMATS if q != Q.MXFP4]  # d x scale x code (MXFP4: an E2M1 table under a power of two, below)


@pytest.mark.parametrize("qtype", SCALED, ids=lambda q: q.name)
def test_packed_blocks_decode_to_the_defined_values(qtype):
    codes, fields, expected = _random_fields(qtype)
    packed = pack(qtype, codes, **fields)
    block_weights, type_bytes = GGML_QUANT_SIZES[qtype]
    assert packed.dtype == np.uint8 and packed.shape == (ROWS, COLS // block_weights * type_bytes)
    np.testing.assert_array_equal(quants.dequantize(packed, qtype), expected)


@pytest.mark.parametrize("qtype", SCALED, ids=lambda q: q.name)
def test_extreme_codes_decode_exactly(qtype):
    """All codes at one end of their range, and scale codes at theirs: the bits that only they set."""
    fmt = FORMATS[qtype]
    for end in (0, 1):
        codes, fields, _ = _random_fields(qtype, seed=1)
        codes = np.full_like(codes, fmt.code_range[end])
        d = fields["d"].astype(np.float32)
        if fmt.scale_range is not None:
            fields["scales"] = np.full_like(fields["scales"], fmt.scale_range[end])
            d = d * np.float32(fmt.scale_range[end])
        expected = np.repeat(d, 256 if fmt.scale_range else 32, axis=1) * np.float32(fmt.code_range[end])
        if fmt.has_mins:
            fields = {**fields, **{k: np.zeros_like(fields[k]) for k in ("m", "mins") if k in fields}}
        np.testing.assert_array_equal(quants.dequantize(pack(qtype, codes, **fields), qtype), expected)


LEGACY = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda q: q.name)
def test_packing_ggufs_choice_gives_ggufs_bytes(qtype):
    """gguf.quants.quantize picks codes and scales; recover them from its bytes' values and pack them again."""
    weight = np.random.default_rng(2).standard_normal((ROWS, COLS)).astype(np.float32)
    theirs = quants.quantize(weight, qtype)
    blocks = theirs.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    d = blocks[:, :2].copy().view(np.float16).reshape(ROWS, -1)
    values = quants.dequantize(theirs, qtype).reshape(ROWS, -1, 32)
    scale = np.where(d == 0, 1, d).astype(np.float32)[..., None]
    fields = {"d": d}
    if FORMATS[qtype].has_mins:
        fields["m"] = blocks[:, 2:4].copy().view(np.float16).reshape(ROWS, -1)
        values = values - fields["m"].astype(np.float32)[..., None]
    codes = np.rint(values / scale).astype(np.int16).reshape(ROWS, COLS)
    np.testing.assert_array_equal(pack(qtype, codes, **fields), theirs)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])  # by bit pattern (OCP MX spec)


def test_mxfp4_blocks_decode_to_e2m1_values_times_their_power_of_two():
    """block_mxfp4: every E2M1 code under E8M0 exponents across the range (0 and 1 are ggml's subnormal halves,
    252 the largest under which 6 x 2^(e - 127) is a finite float32) decodes to e2m1(code) x 2^(e - 127) exactly."""
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 15, endpoint=True, size=(ROWS, COLS))
    e = rng.integers(0, 252, endpoint=True, size=(ROWS, COLS // 32))
    e[0, :4] = [0, 1, 127, 252]
    expected = (E2M1[codes] * np.exp2(np.repeat(e, 32, axis=1).astype(np.float64) - 127)).astype(np.float32)
    packed = pack(Q.MXFP4, codes, e=e.astype(np.uint8))
    assert packed.shape == (ROWS, COLS // 32 * 17)
    np.testing.assert_array_equal(quants.dequantize(packed, Q.MXFP4), expected)


def test_packing_ggufs_mxfp4_choice_gives_ggufs_bytes():
    """gguf's MXFP4 quantizer (llama.cpp's quantize_row_mxfp4_ref) picks exponents and codes; the codes recovered
    from its values (E2M1 bit patterns of value / 2^(e - 127)) pack to its bytes."""
    weight = (np.random.default_rng(4).standard_normal((ROWS, COLS)) * np.exp2(np.arange(COLS) % 40 - 20)).astype(np.float32)
    theirs = quants.quantize(weight, Q.MXFP4)
    e = theirs.reshape(ROWS, -1, 17)[:, :, 0]
    scale = np.repeat(np.exp2(e.astype(np.float64) - 127), 32, axis=1)
    values = quants.dequantize(theirs, Q.MXFP4).reshape(ROWS, COLS) / scale
    codes = np.array([np.flatnonzero(E2M1 == v)[0] for v in values.reshape(-1)]).reshape(ROWS, COLS)
    np.testing.assert_array_equal(pack(Q.MXFP4, codes, e=e), theirs)


def _with_corner(values, corner):
    values = values.copy()
    values[0, 0] = corner
    return values


def test_codes_out_of_range_are_refused():
    codes, fields, _ = _random_fields(Q.Q4_0)
    with pytest.raises(ValueError, match=r"codes must lie in \[-8, 7\], got \[-9"):
        pack(Q.Q4_0, np.where(codes == -8, -9, codes), **fields)
    codes, fields, _ = _random_fields(Q.Q4_K)
    with pytest.raises(ValueError, match=r"Q4_K scales must lie in \[0, 63\]"):
        pack(Q.Q4_K, codes, **{**fields, "scales": _with_corner(fields["scales"], 64)})
    codes, fields, _ = _random_fields(Q.Q3_K)
    with pytest.raises(ValueError, match=r"Q3_K scales must lie in \[-32, 31\]"):
        pack(Q.Q3_K, codes, **{**fields, "scales": _with_corner(fields["scales"], -33)})


def test_columns_off_the_block_are_refused():
    codes, fields, _ = _random_fields(Q.Q6_K)
    with pytest.raises(ValueError, match="multiple of 256"):
        pack(Q.Q6_K, codes[:, :300], **fields)
    codes, fields, _ = _random_fields(Q.Q8_0)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack(Q.Q8_0, codes[:, :40], **fields)


def test_wrong_shapes_and_dtypes_are_refused():
    codes, fields, _ = _random_fields(Q.Q2_K)
    with pytest.raises(ValueError, match=r"Q2_K mins must have shape \[6, 32\] \(one per 16 weights\)"):
        pack(Q.Q2_K, codes, **{**fields, "mins": fields["mins"][:, :8]})
    with pytest.raises(ValueError, match="Q2_K d must be float16"):
        pack(Q.Q2_K, codes, **{**fields, "d": fields["d"].astype(np.float32)})
    with pytest.raises(ValueError, match="codes must be integers"):
        pack(Q.Q2_K, codes.astype(np.float32), **fields)
    with pytest.raises(ValueError, match="2-D"):
        pack(Q.Q2_K, codes.reshape(-1), **fields)


def test_unsupported_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="no block packer for GGML type IQ4_XS; supported: Q8_0, Q4_0"):
        block_format(Q.IQ4_XS)


def test_table_agrees_with_gguf():
    assert set(PACKERS) == set(FORMATS)
    for qtype, fmt in FORMATS.items():
        assert GGML_QUANT_SIZES[qtype][0] == fmt.super_block
        assert fmt.super_block % fmt.sub_block == 0
    assert [FORMATS[q].bits for q in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0)] == [2, 3, 4, 5, 6, 8]
