import pytest

from quantkit.grids.schemes import ActivationSpec, Granularity, QDtype, QuantScheme, ScaleDtype, SchemeError, WeightSpec


def test_group_needs_group_size():
    with pytest.raises(SchemeError, match="group_size"):
        WeightSpec(QDtype.INT4, Granularity.GROUP)


def test_channel_refuses_group_size():
    with pytest.raises(SchemeError, match="group_size"):
        WeightSpec(QDtype.INT8, Granularity.CHANNEL, group_size=32)


def test_float8_weights_are_symmetric_per_channel_per_block_or_mx_groups():
    with pytest.raises(SchemeError, match="float8"):
        WeightSpec(QDtype.FLOAT8, Granularity.GROUP, group_size=32)
    with pytest.raises(SchemeError, match="symmetric"):
        WeightSpec(QDtype.FLOAT8, Granularity.CHANNEL, symmetric=False)
    WeightSpec(QDtype.FLOAT8, Granularity.BLOCK, block_shape=(128, 128))
    WeightSpec(QDtype.FLOAT8, Granularity.GROUP, 32, scale_dtype=ScaleDtype.E8M0)
    with pytest.raises(SchemeError, match="block_shape"):
        WeightSpec(QDtype.FLOAT8, Granularity.BLOCK)
    with pytest.raises(SchemeError, match="block scales are for float8"):
        WeightSpec(QDtype.INT4, Granularity.BLOCK, block_shape=(128, 128))


def test_fp4_weights_are_nvfp4_or_mxfp4():
    nvfp4 = WeightSpec(QDtype.FLOAT4, Granularity.GROUP, 16, scale_dtype=ScaleDtype.FLOAT8, global_scale=True)
    assert nvfp4.describe() == "fp4 g16 fp8 scales + global" and not nvfp4.group_size_adjustable
    assert nvfp4.label() == "nvfp4"
    mlx = WeightSpec(QDtype.FLOAT4, Granularity.GROUP, 16, scale_dtype=ScaleDtype.FLOAT8)  # MLX's nvfp4: no global scale
    assert mlx.describe() == "fp4 g16 fp8 scales mlx" and mlx.label() == "nvfp4 mlx" and not mlx.group_size_adjustable
    assert mlx.qparam_bytes(8, 64, 2) == 8 * 4
    assert WeightSpec(QDtype.FLOAT4, Granularity.GROUP, 32, scale_dtype=ScaleDtype.E8M0).describe() == "fp4 g32 e8m0 scales"
    for bad in (dict(group_size=32, scale_dtype=ScaleDtype.FLOAT8),
                dict(group_size=32, scale_dtype=ScaleDtype.FLOAT8, global_scale=True),
                dict(group_size=16, scale_dtype=ScaleDtype.E8M0),
                dict(group_size=16)):
        with pytest.raises(SchemeError, match="NVFP4|MX|global"):
            WeightSpec(QDtype.FLOAT4, Granularity.GROUP, **bad)
    with pytest.raises(SchemeError, match="global"):
        WeightSpec(QDtype.INT4, Granularity.GROUP, 128, global_scale=True)


def test_group_activations():
    nvfp4 = ActivationSpec(QDtype.FLOAT4, Granularity.GROUP, group_size=16, scale_dtype=ScaleDtype.FLOAT8, global_scale=True)
    assert nvfp4.calibrated and not ActivationSpec(QDtype.FLOAT8, Granularity.GROUP, group_size=128).calibrated
    with pytest.raises(SchemeError, match="float4_e2m1fn activations"):
        ActivationSpec(QDtype.FLOAT4, Granularity.GROUP, group_size=16)
    with pytest.raises(SchemeError, match="per-group activations"):
        ActivationSpec(QDtype.INT8, Granularity.GROUP, group_size=128)
    with pytest.raises(SchemeError, match="group_size"):
        ActivationSpec(QDtype.FLOAT8, Granularity.TOKEN, group_size=128)


def test_activations_are_per_token_int8_or_float8():
    for dtype in (QDtype.INT2, QDtype.INT3, QDtype.INT4, QDtype.INT6):
        with pytest.raises(SchemeError, match="activations.dtype"):
            ActivationSpec(dtype)
    with pytest.raises(SchemeError, match="activations.granularity"):
        ActivationSpec(QDtype.INT8, granularity=Granularity.CHANNEL)


def test_with_group_size_changes_only_the_group_size():
    scheme = QuantScheme(WeightSpec(QDtype.INT4, Granularity.GROUP, 128), ActivationSpec(QDtype.INT8, symmetric=False))
    smaller = scheme.with_group_size(64)
    assert smaller.weights.group_size == 64 and smaller.activations == scheme.activations
    assert scheme.weights.group_size == 128


def test_qranges():
    assert QDtype.INT2.qrange == (-2, 1) and QDtype.INT3.qrange == (-4, 3) and QDtype.INT4.qrange == (-8, 7) and QDtype.INT8.qrange == (-128, 127)
    assert QDtype.FLOAT8.qrange == (-448.0, 448.0) and QDtype.FLOAT4.qrange == (-6.0, 6.0)
    assert [QDtype(f"int{n}").bits for n in range(2, 9)] == list(range(2, 9)) and QDtype.FLOAT4.bits == 4
    assert [d.bits for d in QDtype] == [2, 3, 4, 5, 6, 7, 8, 8, 4, 4, 3, 3, 2, 2, 2, 1, 1]  # iq4_nl: 4-bit indices
    assert QDtype.IQ4_NL.qrange == (0, 15) and QDtype.IQ4_NL.is_codebook and not QDtype.INT4.is_codebook
    # the codebook types below 4 bits: a signed level index per weight (IQ2, IQ3), a level index (IQ1)
    assert QDtype.IQ2_XXS.qrange == (-3, 3) and QDtype.IQ3_S.qrange == (-8, 8) and QDtype.IQ1_M.qrange == (0, 2)
    assert all(QDtype(f"iq{n}").is_codebook for n in ("3_xxs", "3_s", "2_xxs", "2_xs", "2_s", "1_s", "1_m"))


def test_codebook_grids_take_their_types_sub_blocks_only():
    from quantkit.grids.schemes import Granularity, ScaleDtype, SchemeError, WeightSpec

    assert WeightSpec(QDtype.IQ2_XS, Granularity.GROUP, 16, scale_dtype=ScaleDtype.K_QUANT).codebook_type == "IQ2_XS"
    assert WeightSpec(QDtype.IQ2_XXS, Granularity.GROUP, 32, scale_dtype=ScaleDtype.K_QUANT).describe() == "iq2_xxs i-quant"
    with pytest.raises(SchemeError, match="iq2_xs values take granularity group, group_size 16"):
        WeightSpec(QDtype.IQ2_XS, Granularity.GROUP, 32, scale_dtype=ScaleDtype.K_QUANT)
    with pytest.raises(SchemeError, match="scale_dtype k_quant"):
        WeightSpec(QDtype.IQ1_S, Granularity.GROUP, 32, scale_dtype=ScaleDtype.FLOAT16)


def test_k_quant_scales_take_llama_cpps_k_grids_only():
    from quantkit.grids.schemes import K_QUANT_TYPES, ScaleDtype

    for (dtype, group, symmetric), name in K_QUANT_TYPES.items():
        spec = WeightSpec(dtype, Granularity.GROUP, group, symmetric=symmetric, scale_dtype=ScaleDtype.K_QUANT)
        assert spec.k_quant_type == name and name.lower() in spec.describe() and not spec.group_size_adjustable
    with pytest.raises(SchemeError, match="k_quant scales take one of llama.cpp's K grids"):
        WeightSpec(QDtype.INT4, Granularity.GROUP, 32, symmetric=True, scale_dtype=ScaleDtype.K_QUANT)
    with pytest.raises(SchemeError, match="float16 scales are for integer weights"):
        WeightSpec(QDtype.FLOAT8, Granularity.CHANNEL, scale_dtype=ScaleDtype.FLOAT16)
