"""The compressed-tensors exporter takes a QuantizedModel: installs its qparams once, then writes."""

import json

import pytest
import torch

from quantkit.export import compressed_tensors, exporter
from quantkit.finalization.finalize import prepare, quantize_without_data
from quantkit.models.loading import load_model
from quantkit.quant import registry
from quantkit.quant.quantized_model import QuantizedModel


def _quantized(src) -> QuantizedModel:
    recipe = registry.resolve("int8-weight-only")
    prepared = prepare(src, recipe)
    model = load_model(src)
    return QuantizedModel(model, prepared.plan, recipe, quantize_without_data(model, prepared.plan))


def test_as_loaded_installs_the_qparams_once(tiny_model_dir):
    quantized = _quantized(tiny_model_dir)
    name, qparams = next(iter(quantized.qparams.items()))
    weight = quantized.model.get_submodule(name).weight.data.clone()
    model = exporter(registry.Format.COMPRESSED_TENSORS).as_loaded(quantized)
    module = model.get_submodule(name)
    assert torch.equal(module.weight_scale.data.reshape(qparams.scale.shape), qparams.scale)
    assert torch.equal(module.weight.data, weight)
    scale = module.weight_scale
    assert compressed_tensors.as_loaded(quantized) is model and model.get_submodule(name).weight_scale is scale


def test_write_records_the_quantization_config(tiny_model_dir, tmp_path):
    compressed_tensors.write(_quantized(tiny_model_dir), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["ignore"] == ["lm_head"]
    assert list(tmp_path.glob("*.safetensors"))


def test_tensor_types_are_recipes_schemes_in_compressed_tensors(wide_model_dir):
    """--tensor-type in compressed-tensors: a recipe's scheme on the tensors it matches (its own config group);
    refused before any work: a GGML type, a scheme packed another way, another format's grid (MLX's), and GGUF
    refuses a recipe name."""
    from quantkit.errors import FormatError, UsageError
    from quantkit.finalization.finalize import prepare
    from quantkit.quant import registry

    recipe = registry.with_tensor_types(registry.resolve("int4-weight-only"), ["down_proj=int8-weight-only", "k_proj=float"])
    plan = {entry.name: entry for entry in prepare(wide_model_dir, recipe).plan}
    assert plan["model.layers.1.mlp.down_proj"].scheme.weights == registry.resolve("int8-weight-only").scheme.weights
    assert plan["model.layers.1.self_attn.q_proj"].scheme.weights == recipe.scheme.weights
    assert not plan["model.layers.0.self_attn.k_proj"].quantized
    with pytest.raises(UsageError, match="Q8_0 is not one .use --format gguf for it"):
        prepare(wide_model_dir, registry.with_tensor_types(registry.resolve("int4-weight-only"), ["down_proj=q8_0"]))
    with pytest.raises(FormatError, match="one compression format"):
        prepare(wide_model_dir, registry.with_tensor_types(registry.resolve("int4-weight-only"), ["down_proj=fp8-block"]))
    with pytest.raises(FormatError, match="down_proj: its tensor type's grid: mlx_affine is MLX's grid"):
        prepare(wide_model_dir, registry.with_tensor_types(registry.resolve("int4-weight-only"), ["down_proj=mlx-4bit-g64"]))
    with pytest.raises(FormatError, match="without a global scale are MLX's nvfp4 grid"):  # not packed as MXFP4
        prepare(wide_model_dir, registry.with_tensor_types(registry.resolve("mxfp4-a16"), ["down_proj=mlx-nvfp4"]))
    with pytest.raises(UsageError, match="a gguf artifact holds GGML types.*use --format compressed-tensors"):
        prepare(wide_model_dir, registry.with_tensor_types(registry.resolve("gguf-q4-0"), ["down_proj=int8-weight-only"]))
