"""What quantkit does itself for older compressed-tensors releases (0.17, 0.19) equals what the newer library does,
bit for bit; each comparison is skipped where the installed release has nothing to compare against."""

import copy
import dataclasses

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle import apply

from quantkit.export import ct_compat, exporter
from quantkit.export.compressed_tensors import experts_targets, quantization_config
from quantkit.finalization.finalize import prepare
from quantkit.models import loading as models
from quantkit.quant import registry
from quantkit.quant.registry import Format
from quantkit.grids.schemes import QDtype

HAS_ALLOWED_MODULES = "allowed_modules" in apply.apply_quantization_config.__code__.co_varnames
NEWER = f"compressed-tensors {ct_compat.version()} is installed, the newer release is not"


def _installed(model: torch.nn.Module) -> dict[str, tuple]:
    """Every module compressed-tensors initialised: its scheme, status and tensors (names, dtypes, shapes: it leaves
    the qparams' values uninitialised)."""
    return {name: (module.quantization_scheme, module.quantization_status, {key: (value.dtype, value.shape)
                                                for key, value in module.state_dict().items()})
            for name, module in model.named_modules() if hasattr(module, "quantization_scheme")}


@pytest.mark.skipif(not HAS_ALLOWED_MODULES, reason=f"{NEWER} (allowed_modules: 0.20+)")
@pytest.mark.parametrize("recipe_name", ["int4-weight-only", "nvfp4", "w4a8-fp8"])
def test_narrowed_apply_equals_the_librarys_allowed_modules(tiny_model_dir, recipe_name):
    """The streamed writer's per-layer install on 0.17 / 0.19 (the library's module matching narrowed while it runs)
    initialises what 0.20's `allowed_modules` does: the same modules, schemes and qparam slots."""
    recipe = registry.with_kv_cache(registry.resolve(recipe_name), "fp8")
    model = models.load_model(tiny_model_dir)
    config = quantization_config(prepare(tiny_model_dir, recipe).plan, recipe, experts_targets(model))
    ours, theirs = model, copy.deepcopy(model)
    layer = [module for name, module in ours.named_modules() if name.endswith("layers.1")][0]
    allowed = list(layer.modules())
    with ct_compat._narrowed(apply, {id(module) for module in allowed}):
        apply.apply_quantization_config(ours, config, show_progress=False)
    theirs_layer = [module for name, module in theirs.named_modules() if name.endswith("layers.1")][0]
    apply.apply_quantization_config(theirs, config, show_progress=False, allowed_modules=list(theirs_layer.modules()))
    installed = _installed(ours)
    assert installed and all(".layers.1." in name for name in installed)
    assert installed == _installed(theirs)


@pytest.mark.skipif(ct_compat.dequantizes_by_scheme(), reason="the installed compressed-tensors computes as 0.19+")
def test_older_releases_get_the_newer_decompression_and_eager_fp4_rounding():
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA

    compiled = FP4_E2M1_DATA.cast_to_fp4
    ct_compat.compute_as_newer_releases()
    assert NaiveQuantizationCompressor.decompress.__func__ is ct_compat._decompress
    assert FP4_E2M1_DATA.cast_to_fp4 is ct_compat._cast_to_fp4
    x = _fp4_inputs()
    assert torch.equal(ct_compat._cast_to_fp4(x.clone()), compiled(x.clone()))  # 0.17's, through torch.compile


def _fp4_inputs() -> torch.Tensor:
    """Every FP4 value, the midpoints between them (ties), values beyond 6, zeros of both signs, random values."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    edges = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([5.5, 7.0, 100.0, -0.0, 0.25, 0.2500001])])
    random = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4
    values = torch.cat([edges, -edges, random])
    return torch.cat([values.to(dtype).float() for dtype in (torch.bfloat16, torch.float16, torch.float32)])


@pytest.mark.skipif(not ct_compat.dequantizes_by_scheme(), reason=f"{NEWER} (eager FP4 rounding: 0.19+)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fp4_rounding_equals_the_newer_librarys(dtype):
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    x = _fp4_inputs().to(dtype)
    ours, theirs = ct_compat._cast_to_fp4(x.clone()), cast_to_fp4(x.clone())
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    assert torch.equal(ours.signbit(), theirs.signbit())


BLOCK = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128])
CHANNEL = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
INT8 = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")


@pytest.mark.skipif(not ct_compat.dequantizes_by_scheme(), reason=f"{NEWER} (dequantizing by scheme: 0.19+)")
@pytest.mark.parametrize("args, rows, cols", [(BLOCK, 256, 128), (BLOCK, 352, 256), (BLOCK, 128, 128),
                                              (CHANNEL, 96, 64), (INT8, 96, 64)], ids=str)
def test_decompression_equals_the_newer_librarys(args, rows, cols):
    """0.17 guesses a weight's layout from its scale's shape; quantkit's loader gives it 0.20's decompression, which
    reads the layout from the scheme."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor

    generator = torch.Generator().manual_seed(0)
    if args.strategy == "block":
        scale_shape = (-(-rows // 128), -(-cols // 128))
    else:
        scale_shape = (rows, 1)
    grid = torch.randn(rows, cols, generator=generator) * 100
    weight = grid.to(torch.float8_e4m3fn) if args.type == "float" else grid.clamp(-128, 127).round().to(torch.int8)
    state = {"weight": weight, "weight_scale": torch.rand(scale_shape, generator=generator) + 0.01}
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    ours = ct_compat._decompress(NaiveQuantizationCompressor, state, scheme)
    theirs = NaiveQuantizationCompressor.decompress(state, scheme)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key


def test_three_bit_weights_are_refused_in_one_line_where_the_library_packs_them_sparsely(monkeypatch):
    recipe = registry.resolve("int4-weight-only")
    three_bits = dataclasses.replace(recipe, name="int3-weight-only", scheme=_with_bits(recipe.scheme, "int3"))
    monkeypatch.setattr(ct_compat, "version", lambda: "0.17.0")
    reason = exporter(Format.COMPRESSED_TENSORS).unsupported(three_bits)
    assert reason and "compressed-tensors >= 0.18" in reason and "0.17.0" in reason and "\n" not in reason
    assert exporter(Format.COMPRESSED_TENSORS).unsupported(recipe) is None  # 4 bits: the same layout in every release
    monkeypatch.setattr(ct_compat, "version", lambda: "0.19.0")
    assert exporter(Format.COMPRESSED_TENSORS).unsupported(three_bits) is None


def _with_bits(scheme, dtype: str):
    return dataclasses.replace(scheme, weights=dataclasses.replace(scheme.weights, dtype=QDtype(dtype)))
