"""The MLX format without mlx (mlx itself reads quantkit's files in tests/engines/test_mlx_lm.py): the packing against a
bit stream built from Python integers, MLX's affine grid against a scalar port of mlx's CPU quantizer, GPTQ on it,
which schemes are held exactly and which refused, and the written directory (tensors, config.json, shards, reader)."""

import json
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.algorithms.gptq import gptq_quantize
from quantkit.algorithms.methods.gptq import GPTQArgs
from quantkit.errors import FormatError, QuantkitError
from quantkit.export import check_supported, exporter, for_format, reader_for
from quantkit.export import mlx
from quantkit.grids import family_of, quantize_weight
from quantkit.grids.mlx_grids import MLX_GRID, AffineParams
from quantkit.grids.schemes import Granularity, QDtype, QuantScheme, ScaleDtype, SchemeError, WeightSpec
from quantkit.quant.registry import Format, resolve


def affine(bits: int, group: int = 64) -> WeightSpec:
    return WeightSpec(QDtype(f"int{bits}"), Granularity.GROUP, group, symmetric=False, scale_dtype=ScaleDtype.MLX_AFFINE)


def weight(rows=32, cols=256, dtype=torch.float32, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=generator) * 0.05
    w[0, :64] = 0.0  # an all-zero group: mx.quantize's smallest step
    w[1, :64] = torch.linspace(0.01, 0.2, 64)  # a group of one sign
    return w.to(dtype)


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_is_a_little_endian_bit_stream(bits):
    codes = torch.randint(0, 1 << bits, (3, 64), generator=torch.Generator().manual_seed(bits), dtype=torch.int64)
    packed = mlx.pack(codes.to(torch.uint8), bits)
    assert packed.dtype == torch.uint32 and packed.shape == (3, 64 * bits // 32)
    for row in range(3):
        stream = sum(int(c) << (k * bits) for k, c in enumerate(codes[row].tolist()))
        words = [(stream >> (32 * j)) & 0xFFFFFFFF for j in range(packed.shape[1])]
        assert packed[row].view(torch.int32).tolist() == [w - (1 << 32) if w >= 1 << 31 else w for w in words]
    assert torch.equal(mlx.unpack(packed, bits), codes.to(torch.uint8))


def test_pack_refuses_a_row_of_partial_words():
    with pytest.raises(QuantkitError, match="whole 32-bit words"):
        mlx.pack(torch.zeros(2, 8, dtype=torch.uint8), 3)


# ---------------------------------------------------------------- the grid


def mx_quantize_reference(w: np.ndarray, group: int, bits: int):
    """mlx's CPU quantizer (mlx/backend/cpu/quantized.cpp, `quantize`), one group at a time in numpy float32."""
    f = np.float32
    n_bins, eps = f((1 << bits) - 1), f(1e-7)
    scales, biases, codes = [], [], []
    for g in w.astype(f).reshape(-1, group):
        w_max, w_min = g.max(), g.min()
        mask = abs(w_min) > abs(w_max)
        scale = max(f((w_max - w_min) / n_bins), eps)
        scale = scale if mask else -scale
        edge = w_min if mask else w_max
        q0 = np.rint(f(edge / scale))
        bias = f(0)
        if q0 != 0:
            scale, bias = f(edge / q0), edge
        codes.append(np.clip(np.rint((g - bias) / scale), 0, n_bins))
        scales.append(scale)
        biases.append(bias)
    rows = w.shape[0]
    return (np.array(scales, f).reshape(rows, -1), np.array(biases, f).reshape(rows, -1),
            np.array(codes).reshape(w.shape).astype(np.uint8))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_rtn_is_mx_quantize_for_float32(bits, group):
    w = weight()
    ours = quantize_weight(w, affine(bits, group))
    scales, biases, codes = mx_quantize_reference(w.numpy(), group, bits)
    assert family_of(affine(bits, group)) is MLX_GRID
    assert np.array_equal(ours.k.scales.numpy(), scales) and np.array_equal(ours.k.biases.numpy(), biases)
    assert np.array_equal(ours.qdata.numpy(), codes)
    assert (ours.k.scales < 0).any()  # groups whose larger end is positive step downwards, as mlx's do


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rtn_rounds_onto_the_grid_as_stored(dtype):
    """Scales and biases are mx.quantize's, in the model's dtype; the codes are the nearest on that stored grid (mlx
    rounds onto its float32 grid before casting it, so a few of its codes are one off for a 16-bit model)."""
    w = weight(dtype=dtype)
    ours = quantize_weight(w, affine(4))
    scales, biases, _ = mx_quantize_reference(w.float().numpy(), 64, 4)
    assert ours.k.scales.dtype == dtype and ours.k.biases.dtype == dtype
    assert torch.equal(ours.k.scales, torch.from_numpy(scales).to(dtype))
    assert torch.equal(ours.k.biases, torch.from_numpy(biases).to(dtype))
    every = torch.arange(16, dtype=torch.uint8).reshape(16, 1, 1).expand(16, *w.shape)
    values = torch.stack([ours.k.dequantize(codes) for codes in every])  # each element's 16 grid values, float32
    nearest = (w.float() - values).abs().amin(0)
    error = (w.float() - ours.dequantize(torch.float32)).abs()
    assert (error <= nearest * (1 + 1e-6) + 1e-12).all()  # every code the nearest on the grid as stored


def test_dequantize_is_scale_times_code_plus_bias():
    w = weight(dtype=torch.bfloat16)
    ours = quantize_weight(w, affine(3))
    expected = ours.k.scales.float().repeat_interleave(64, 1) * ours.qdata.float() + ours.k.biases.float().repeat_interleave(64, 1)
    assert torch.equal(ours.dequantize(torch.bfloat16), expected.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gptq_with_an_identity_hessian_is_rtn(dtype):
    w = weight(dtype=dtype)
    spec = affine(4)
    ours, rtn = gptq_quantize(w, torch.eye(256), spec, GPTQArgs()), quantize_weight(w, spec)
    assert torch.equal(ours.qdata, rtn.qdata)
    assert torch.equal(ours.k.scales, rtn.k.scales) and torch.equal(ours.k.biases, rtn.k.biases)


def test_gptq_lowers_the_hessian_weighted_error():
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(512, 256, generator=generator) * (1 + 4 * torch.rand(256, generator=generator))) @ (
        torch.randn(256, 256, generator=generator) / 16)
    hessian = 2 * x.T @ x / x.shape[0]
    w, spec = weight(), affine(4)
    def error(q):
        delta = w - q.dequantize(torch.float32)
        return torch.trace(delta @ hessian @ delta.T).item()
    assert error(gptq_quantize(w, hessian, spec, GPTQArgs())) < 0.8 * error(quantize_weight(w, spec))


def test_the_grid_round_trips_through_its_parts():
    q = quantize_weight(weight(), affine(5))
    back = MLX_GRID.block_params(affine(5), q.k.parts())
    assert torch.equal(back.dequantize(q.qdata), q.dequantize(torch.float32))


def test_mlx_affine_specs_are_checked():
    with pytest.raises(SchemeError, match="groups of 32, 64 or 128"):
        affine(4, 16)
    with pytest.raises(SchemeError, match="int2, int3"):
        WeightSpec(QDtype.INT7, Granularity.GROUP, 64, symmetric=False, scale_dtype=ScaleDtype.MLX_AFFINE)
    with pytest.raises(SchemeError, match="symmetric: false"):
        WeightSpec(QDtype.INT4, Granularity.GROUP, 64, symmetric=True, scale_dtype=ScaleDtype.MLX_AFFINE)
    assert affine(4).describe() == "int4 g64 mlx"
    assert affine(4).qparam_bytes(8, 128, 2) == 8 * 2 * 2 * 2


# ---------------------------------------------------------------- which schemes MLX holds


def test_symmetric_integer_grids_are_held_exactly():
    """Symmetric int4: code q + 8 and bias -8 x scale, exact in any dtype, decode to the recipe's values."""
    spec = WeightSpec(QDtype.INT4, Granularity.GROUP, 128)
    for dtype in (torch.bfloat16, torch.float16):
        w = weight(dtype=dtype)
        q = quantize_weight(w, spec)
        codes, scales, biases = mlx.grid_tensors(q.dequantize(dtype), q.qparams)
        assert torch.equal(codes.to(torch.int16) - 8, q.qdata.to(torch.int16))
        assert torch.equal(biases.float(), -8 * scales.float())
        grid = AffineParams(scales, biases, 4, 128)
        assert torch.equal(grid.dequantize(codes, dtype=dtype), q.dequantize(dtype))


@pytest.mark.parametrize("name", ["gptq-w4a16", "awq-w4a16", "int4-weight-only", "mlx-4bit-g64",
                                  "mlx-3bit-g64", "mlx-8bit-g64", "mlx-gptq-4bit-g64", "mlx-awq-4bit-g64", "mxfp4-a16",
                                  "mlx-nvfp4", "mlx-gptq-nvfp4"])
def test_recipes_mlx_holds(name):
    check_supported(resolve(name), Format.MLX)


@pytest.mark.parametrize("name, reason", [
    ("int4-asym", "integer zero point's bias .* the nearest is recipe mlx-4bit-g64"),
    ("gptq-w4a16-asym", "integer zero point"),
    ("gptq-w8a16", "MLX takes groups of 32, 64, 128, not int8 channel"),
    ("nvfp4-a16", "nvfp4 mode holds FP8 group scales alone, not nvfp4's under a per-tensor global scale; the nearest "
                  "is recipe mlx-nvfp4"),
    ("gptq-nvfp4-a16", "global scale; the nearest is recipe mlx-nvfp4"),
    ("nvfp4", "weight-only .* mlx-nvfp4 for FP4"),
    ("mxfp4", "weight-only"),
    ("gguf-q4-0", "integer grids with scales in the model's dtype"),
    ("int8-dynamic-act-int8-weight", "weight-only"),
    ("quarot-w4a8", "weight-only"),
])
def test_recipes_mlx_refuses_in_one_line(name, reason):
    with pytest.raises(FormatError, match=reason) as raised:
        check_supported(resolve(name), Format.MLX)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("dtype", [QDtype.FLOAT4, QDtype.FLOAT8])
def test_mx_grids_are_held_as_they_are(dtype):
    """MXFP4 / MXFP8: E2M1 nibbles or E4M3 bytes and each group's E8M0 exponent, decoding to the grid's values."""
    from quantkit.grids import float_grids

    spec = WeightSpec(dtype, Granularity.GROUP, 32, scale_dtype=ScaleDtype.E8M0)
    w = weight(dtype=torch.bfloat16)
    q = quantize_weight(w, spec)
    values = q.dequantize(torch.bfloat16)
    codes, exponents = mlx.mx_tensors(values, q.qparams)
    assert exponents.dtype == torch.uint8 and exponents.shape == (32, 256 // 32)
    scale = torch.exp2(exponents.float() - 127).repeat_interleave(32, dim=1)
    decoded = float_grids.fp4_values(codes) if dtype is QDtype.FLOAT4 else codes.view(torch.float8_e4m3fn).float()
    assert torch.equal((decoded * scale).to(torch.bfloat16), values)
    assert mlx.mode_of(spec) == ("mxfp4" if dtype is QDtype.FLOAT4 else "mxfp8")
    assert mlx.pack(codes, spec.dtype.bits).shape == (32, 256 * spec.dtype.bits // 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nvfp4_grids_are_held_as_mx_quantize_writes_them(dtype):
    """MLX's nvfp4 (recipe mlx-nvfp4): E2M1 nibbles and each group's FP8 e4m3 scale byte, decoding to the grid's
    values; a zero as +0 and an all-zero group's codes all 0 (mx.quantize's), config {16, 4, nvfp4}, one byte a group."""
    from quantkit.grids import float_grids

    spec = resolve("mlx-nvfp4").scheme.weights
    w = weight(dtype=dtype)
    w[2, :16] = torch.tensor([-0.01] + [0.0] * 14 + [6.0])  # a negative weight rounded to zero
    q = quantize_weight(w, spec)
    values = q.dequantize(dtype)
    codes, scales = mlx.mx_tensors(values, q.qparams)
    assert scales.dtype == torch.uint8 and scales.shape == (32, 256 // 16)
    decoded = float_grids.fp4_values(codes) * scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
    assert torch.equal(decoded.to(dtype), values)
    assert (codes[0, :64] == 0).all() and (scales[0, :4] == 0).all() and codes[2, 0] == 0
    assert mlx.mode_of(spec) == "nvfp4" and mlx.spec_refusal(spec) is None
    assert mlx.quantization_config(spec, []) == {"group_size": 16, "bits": 4, "mode": "nvfp4"}
    assert mlx.pack(codes, 4).shape == (32, 256 * 4 // 32)


@pytest.mark.parametrize("fmt", [Format.COMPRESSED_TENSORS, Format.TORCHAO, Format.GGUF])
@pytest.mark.parametrize("name", ["mlx-4bit-g64", "mlx-nvfp4"])
def test_other_formats_refuse_mlx_grids(fmt, name):
    with pytest.raises(FormatError, match="use --format mlx"):
        check_supported(resolve(name), fmt)


def test_float32_scales_are_chosen_in_the_model_dtype():
    recipe = resolve("gptq-w4a16")
    spec = replace(recipe.scheme.weights, scale_dtype=ScaleDtype.FLOAT32)
    adapted = for_format(replace(recipe, scheme=QuantScheme(spec)), Format.MLX)
    assert adapted.scheme.weights.scale_dtype is ScaleDtype.MODEL


# ---------------------------------------------------------------- the written directory


def finalize(src: Path, dst: Path, recipe: str, fmt: Format | None = None, **options):
    from quantkit.finalization.finalize import finalize as run

    return run(src, dst, resolve(recipe), fmt, **options)


@pytest.fixture(scope="module")
def written(wide_model_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("mlx") / "out"
    finalize(wide_model_dir, dst, "mlx-4bit-g64")
    return dst


def header(file: Path) -> dict:
    with open(file, "rb") as fh:
        return json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))


def test_the_directory_is_mlx_lms_layout(written, wide_model_dir):
    files = {p.name for p in written.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "quantkit.json", "README.md"} <= files
    assert (written / "README.md").read_text().startswith("---\nlibrary_name: mlx\n")
    config = json.loads((written / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert config["rope_theta"] == 10000.0
    tensors = header(written / "model.safetensors")
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q["dtype"] == "U32" and q["shape"] == [128, 128 * 4 // 32]
    assert tensors["model.layers.0.self_attn.q_proj.scales"]["shape"] == [128, 2]
    assert tensors["model.layers.0.self_attn.q_proj.biases"]["dtype"] == "F32"  # the model's dtype
    assert tensors["model.embed_tokens.weight"]["dtype"] == "U32"  # the embedding quantized, as mlx-lm does
    assert tensors["lm_head.weight"]["dtype"] == "U32"
    assert tensors["model.norm.weight"]["dtype"] == "F32"


def test_the_files_hold_the_preview_exactly(written, wide_model_dir):
    """Every quantized tensor, unpacked and dequantized from the file, is the in-memory preview's weight."""
    from safetensors.torch import load_file

    from quantkit.finalization.checks import prepare
    from quantkit.finalization.finalize import quantize_model

    recipe = for_format(resolve("mlx-4bit-g64"), Format.MLX)
    preview = quantize_model(prepare(wide_model_dir, recipe), recipe)
    stored = load_file(written / "model.safetensors")
    modules = dict(preview.named_modules())
    names = [n[: -len(".scales")] for n in stored if n.endswith(".scales")]
    assert len(names) == 2 * 7 + 2
    for name in names:
        grid = AffineParams(stored[f"{name}.scales"], stored[f"{name}.biases"], 4, 64)
        values = grid.dequantize(mlx.unpack(stored[f"{name}.weight"], 4), dtype=torch.float32)
        assert torch.equal(values, modules[name].weight.detach()), name


def test_shards_and_index(wide_model_dir, tmp_path):
    dst = tmp_path / "sharded"
    finalize(wide_model_dir, dst, "mlx-4bit-g64", max_shard_size="100KB")
    shards = sorted(p.name for p in dst.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert not (dst / "model.safetensors").exists()


def test_a_whole_model_writes_the_streamed_bytes(written, wide_model_dir, tmp_path):
    dst = tmp_path / "whole"
    finalize(wide_model_dir, dst, "mlx-4bit-g64", in_memory=True)
    from safetensors.torch import load_file

    whole, streamed = load_file(dst / "model.safetensors"), load_file(written / "model.safetensors")
    assert whole.keys() == streamed.keys() and all(torch.equal(whole[k], streamed[k]) for k in whole)
    assert (dst / "config.json").read_text() == (written / "config.json").read_text()


def test_a_refused_recipe_writes_nothing(wide_model_dir, tmp_path):
    dst = tmp_path / "refused"
    with pytest.raises(FormatError, match="mlx-4bit-g64"):
        finalize(wide_model_dir, dst, "int4-asym", Format.MLX)
    assert not dst.exists() and not any(tmp_path.iterdir())


def test_other_architectures_are_refused_in_one_line():
    from types import SimpleNamespace

    with pytest.raises(FormatError, match="not 'olmo2'; use --format gguf"):
        exporter(Format.MLX).check_model(Path("."), SimpleNamespace(model_type="olmo2"), torch.nn.Module())


def test_the_reader_detects_mlx_directories_only(written, wide_model_dir):
    from quantkit.errors import UsageError

    reader = reader_for(written)
    assert reader.format is Format.MLX and reader.TENSOR_PARALLEL is False
    assert reader_for(wide_model_dir).format is None
    with pytest.raises(UsageError, match="transformers cannot run; run it in mlx-lm"):
        reader.check_load(written)


def test_rope_keys_for_mlx_lm():
    config = {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0}}
    assert mlx.rope_keys(config) == {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert mlx.rope_keys({"rope_theta": 1.0}) == {}


# ---------------------------------------------------------------- per-tensor types (mlx-lm's mixed bits)


def typed(*overrides: str, base: str = "mlx-4bit-g64"):
    from quantkit.quant.registry import with_tensor_types

    return with_tensor_types(resolve(base), list(overrides))


@pytest.fixture(scope="module")
def mixed(wide_model_dir, tmp_path_factory):
    from quantkit.finalization.finalize import finalize as run

    dst = tmp_path_factory.mktemp("mlx") / "mixed"
    run(wide_model_dir, dst, typed("down_proj=mlx-8bit-g64", "embed_tokens=mlx-6bit-g64"))
    return dst


def test_tensor_types_are_per_layer_entries_mlx_lm_reads(mixed):
    """`--tensor-type down_proj=mlx-8bit-g64` on mlx-4bit-g64: those layers at 8 bits, each named in config.json's
    `quantization` by its module path with {group_size, bits, mode} (what mlx-lm's load passes to `to_quantized`),
    the others under the recipe's defaults."""
    config = json.loads((mixed / "config.json").read_text())
    eight, six = {"group_size": 64, "bits": 8, "mode": "affine"}, {"group_size": 64, "bits": 6, "mode": "affine"}
    assert config["quantization"] == config["quantization_config"] == {
        "group_size": 64, "bits": 4, "mode": "affine", "model.layers.0.mlp.down_proj": eight,
        "model.layers.1.mlp.down_proj": eight, "model.embed_tokens": six}
    tensors = header(mixed / "model.safetensors")
    assert tensors["model.layers.1.mlp.down_proj.weight"]["shape"] == [128, 256 * 8 // 32]
    assert tensors["model.layers.1.mlp.down_proj.scales"]["shape"] == [128, 4]
    assert tensors["model.layers.1.mlp.up_proj.weight"]["shape"] == [256, 128 * 4 // 32]
    assert tensors["model.embed_tokens.weight"]["shape"][1] == 128 * 6 // 32


def test_mixed_files_hold_the_preview_and_the_planned_bytes(mixed, wide_model_dir):
    """Each layer, unpacked at its own bits, is the preview's weight exactly; the safetensors bytes of every tensor
    are the sizes `weight_bytes` (the budget's and --dry-run's) gives."""
    from safetensors.torch import load_file

    from quantkit.finalization.checks import prepare
    from quantkit.finalization.finalize import quantize_model

    recipe = for_format(typed("down_proj=mlx-8bit-g64", "embed_tokens=mlx-6bit-g64"), Format.MLX)
    prepared = prepare(wide_model_dir, recipe)
    preview = quantize_model(prepared, recipe)
    stored = load_file(mixed / "model.safetensors")
    modules = dict(preview.named_modules())
    config = json.loads((mixed / "config.json").read_text())["quantization"]
    for name in (n[: -len(".scales")] for n in stored if n.endswith(".scales") and "embed" not in n):
        bits = config.get(name, config)["bits"]
        grid = AffineParams(stored[f"{name}.scales"], stored[f"{name}.biases"], bits, 64)
        assert torch.equal(grid.dequantize(mlx.unpack(stored[f"{name}.weight"], bits), dtype=torch.float32),
                           modules[name].weight.detach()), name
    entries = {entry.name: entry for entry in prepared.plan}
    assert entries["model.layers.0.mlp.down_proj"].scheme.weights.dtype.bits == 8
    for name, entry in entries.items():
        held = sum(stored[f"{name}.{part}"].numel() * stored[f"{name}.{part}"].element_size()
                   for part in ("weight", "scales", "biases"))
        assert held == mlx.weight_bytes(entry, 4), name


def test_an_nvfp4_directory_holds_the_preview_exactly(wide_model_dir, tmp_path):
    """mlx-nvfp4 written: mlx-lm's layout for the nvfp4 mode (uint32 codes, uint8 FP8 scales, no biases), every Linear,
    lm_head and the token embedding quantized, each decoding to the preview's weight; `weight_bytes` its bytes."""
    from safetensors.torch import load_file

    from quantkit.finalization.checks import prepare
    from quantkit.finalization.finalize import quantize_model
    from quantkit.grids import float_grids

    dst = tmp_path / "nvfp4"
    finalize(wide_model_dir, dst, "mlx-nvfp4")
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"] == {"group_size": 16, "bits": 4, "mode": "nvfp4"}
    recipe = for_format(resolve("mlx-nvfp4"), Format.MLX)
    prepared = prepare(wide_model_dir, recipe)
    modules = dict(quantize_model(prepared, recipe).named_modules())
    stored = load_file(dst / "model.safetensors")
    names = [n[: -len(".scales")] for n in stored if n.endswith(".scales")]
    assert len(names) == 2 * 7 + 2 and not [n for n in stored if n.endswith(".biases")]
    for name in names:
        codes, scales = stored[f"{name}.weight"], stored[f"{name}.scales"]
        assert codes.dtype == torch.uint32 and scales.dtype == torch.uint8
        scale = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
        values = (float_grids.fp4_values(mlx.unpack(codes, 4)) * scale).to(torch.bfloat16)  # MX / FP4 files: 16-bit
        assert torch.equal(values, modules[name].weight.detach()), name
    for entry in prepared.plan:
        held = sum(stored[f"{entry.name}.{part}"].numel() * stored[f"{entry.name}.{part}"].element_size()
                   for part in ("weight", "scales"))
        assert held == mlx.weight_bytes(entry, 2), entry.name


@pytest.mark.parametrize("override, error, message", [
    ("down_proj=int4-asym", FormatError, "down_proj: tensor type int4-asym: an integer zero point's bias"),
    ("down_proj=gptq-w8a16", FormatError, "MLX takes groups of 32, 64, 128, not int8 channel"),
    ("embed_tokens=nvfp4-a16", FormatError, "the token embedding: tensor type nvfp4-a16: mlx's nvfp4 mode holds FP8"),
    ("embed_tokens=fp8-block", FormatError, "the token embedding: tensor type fp8-block: MLX holds integer grids"),
    ("down_proj=q6_k", QuantkitError, "Q6_K is not one \\(use --format gguf for it\\)"),
])
def test_a_tensor_type_mlx_cannot_hold_is_one_line(wide_model_dir, tmp_path, override, error, message):
    from quantkit.finalization.finalize import finalize as run

    with pytest.raises(error, match=message) as raised:
        run(wide_model_dir, tmp_path / "out", typed(override))
    assert "\n" not in str(raised.value) and not (tmp_path / "out").exists()


def test_symmetric_integer_tensor_types_are_chosen_in_the_model_dtype(wide_model_dir):
    """A symmetric integer recipe as a tensor type (gptq-w4a16's int4 g128): its scales in the model's dtype, as MLX
    stores them (the grid the algorithm rounds onto is the file's)."""
    from quantkit.finalization.checks import prepare

    plan = prepare(wide_model_dir, typed("o_proj=gptq-w4a16"), Format.MLX).plan
    spec = next(e for e in plan if e.name.endswith("o_proj")).scheme.weights
    assert spec.scale_dtype is ScaleDtype.MODEL and spec.group_size == 128
