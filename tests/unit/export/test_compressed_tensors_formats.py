"""Which compressed-tensors formats the new schemes take, and what plain transformers cannot do with them."""

import pytest

from quantkit.export import ct_compat
from quantkit.export.compressed_tensors import compression_format, experts_load_problem, loading_caveat, quantization_config
from quantkit.models import compat
from quantkit.quant import registry
from quantkit.quant.plan import ModulePlan


@pytest.mark.parametrize("name,fmt", [
    ("nvfp4", "nvfp4-pack-quantized"), ("nvfp4-a16", "nvfp4-pack-quantized"), ("mxfp4-a16", "mxfp4-pack-quantized"),
    ("mxfp8", "mxfp8-quantized"), ("fp8-block", "float-quantized"), ("int4-asym", "pack-quantized"),
    ("w4a8-fp8", "int-quantized"), ("int4-weight-only", "pack-quantized"),
])
def test_each_recipe_names_the_format_compressed_tensors_infers(name, fmt):
    from compressed_tensors.compressors.format import infer_module_format
    from torch import nn

    recipe = registry.resolve(name)
    plan = [ModulePlan("layer", 256, 256, scheme=recipe.scheme)]
    scheme = quantization_config(plan, recipe).config_groups["group_0"]
    assert compression_format(recipe.scheme) == fmt == infer_module_format(nn.Linear, scheme).value


def test_only_asymmetric_packed_artifacts_carry_the_loading_caveat():
    caveats = {name for name in registry.recipe_names() if loading_caveat(registry.resolve(name))}
    expected = set()
    # transformers up to 5.22 loads the zero points as they are packed, and so does compressed-tensors 0.17
    if ct_compat.sizes_packed_zero_points_unpacked() and not compat.tolerates_quantized_shape_mismatch():
        expected |= {"int4-asym", "gptq-w4a16-asym", "awq-w4a16-asym", "hqq-w4a16", "hqq-w3a16", "hqq-w2a16"}
    if not ct_compat.dequantizes_by_scheme():  # compressed-tensors 0.17 and 0.18: FP8 blocks one block wide
        expected |= {"fp8-block"}
    assert caveats == expected


def _moe_config(fmt: str, symmetric: bool = True) -> dict:
    group = {"format": fmt, "targets": ["Linear"], "weights": {"symmetric": symmetric}}
    return {"num_experts": 4, "quantization_config": {"quant_method": "compressed-tensors", "format": fmt,
                                                      "config_groups": {"group_0": group}}}


def test_moe_artifacts_whose_experts_transformers_mishandles_are_named():
    assert "NVFP4" in experts_load_problem(_moe_config("nvfp4-pack-quantized"))
    assert "zero points" in experts_load_problem(_moe_config("pack-quantized", symmetric=False))
    assert experts_load_problem(_moe_config("int-quantized"))
    for fine in ("pack-quantized", "float-quantized", "mxfp4-pack-quantized"):
        assert experts_load_problem(_moe_config(fine)) is None
    dense = _moe_config("nvfp4-pack-quantized")
    del dense["num_experts"]
    assert experts_load_problem(dense) is None


# LLM Compressor 0.14's kv_cache_scheme for QuantizationModifier(kv_cache_scheme={num_bits: 8, type: float,
# strategy: tensor | attn_head, dynamic: false, symmetric: true}), as it wrote it in config.json
PEER_KV_CACHE_SCHEME = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                        "observer": None, "observer_kwargs": {}, "scale_dtype": None, "symmetric": True, "type": "float",
                        "zp_dtype": None}


@pytest.mark.parametrize("choice,strategy", [("fp8", "tensor"), ("fp8-head", "attn_head")])
def test_the_kv_cache_scheme_is_llm_compressors(choice, strategy):
    from compressed_tensors.quantization import QuantizationArgs

    recipe = registry.with_kv_cache(registry.resolve("fp8-block"), choice)
    config = quantization_config([ModulePlan("layer", 256, 256, scheme=recipe.scheme)], recipe)
    assert config.kv_cache_scheme == QuantizationArgs.model_validate({**PEER_KV_CACHE_SCHEME, "strategy": strategy})
    assert quantization_config([ModulePlan("layer", 256, 256, scheme=recipe.scheme)], registry.resolve("fp8-block")).kv_cache_scheme is None
