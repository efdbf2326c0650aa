"""Qwen3-MoE, Gemma2, Gemma3 and Phi-3 in MLX without mlx: the tensors and config.json keys mlx-lm's models read, as
`mlx_lm.convert -q` writes them (Qwen3-MoE's experts stacked into switch_mlp, Gemma's norms as stored, Phi-3's fused
projections whole), and the configs mlx-lm would compute differently refused before any weight is read. (mlx-lm
loading these directories to quantkit's logits: tests/engines/test_mlx_lm.py.)"""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from quantkit.errors import FormatError
from quantkit.export import exporter, for_format, mlx, mlx_archs
from quantkit.finalization.finalize import finalize, prepare, quantize_model
from quantkit.grids.mlx_grids import AffineParams
from quantkit.quant.registry import Format, resolve, with_tensor_types

MLX = Format.MLX
SHAPES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
CONFIGS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, head_dim=32),
    "gemma2": dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=16),
    "gemma3_text": dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    "phi3": dict(pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One tiny float32 model of each architecture, built on first use."""
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_model

    built = {}

    def model(arch):
        if arch not in built:
            built[arch] = build_tiny_model(tmp_path_factory.mktemp("archs") / arch, make_text(3000), arch,
                                           **SHAPES | CONFIGS[arch])
        return built[arch]
    return model


def written(src, tmp_path, recipe="mlx-4bit-g64"):
    """(tensors, config.json) of `src` finalized for MLX under `recipe` (a name, or a Recipe)."""
    out = tmp_path / "out"
    finalize(src, out, resolve(recipe) if isinstance(recipe, str) else recipe, MLX)
    return load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())


def test_qwen3_moe_experts_are_mlx_lms_switch_mlp(models, tmp_path):
    """Each projection's experts one [experts, out, in] tensor per part, as mlx_lm.convert writes them (mlx-lm's
    sanitize stacks float weights only); each expert's slice the preview's expert; the router in full precision."""
    src = models("qwen3_moe")
    tensors, config = written(src, tmp_path)
    assert not [name for name in tensors if ".experts." in name]
    switch = "model.layers.0.mlp.switch_mlp"
    assert tensors[f"{switch}.gate_proj.weight"].shape == (4, 128, 128 * 4 // 32)
    assert tensors[f"{switch}.gate_proj.scales"].shape == tensors[f"{switch}.gate_proj.biases"].shape == (4, 128, 2)
    assert tensors[f"{switch}.down_proj.weight"].shape == (4, 128, 128 * 4 // 32)
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    assert "model.layers.0.mlp.gate.scales" not in tensors
    assert config["num_experts"] == 4 and config["rope_theta"] == 10000.0
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}

    recipe = for_format(resolve("mlx-4bit-g64"), MLX)
    experts = dict(quantize_model(prepare(src, recipe), recipe).named_modules())["model.layers.0.mlp.experts"]
    for e in range(4):
        grid = AffineParams(tensors[f"{switch}.up_proj.scales"][e], tensors[f"{switch}.up_proj.biases"][e], 4, 64)
        values = grid.dequantize(mlx.unpack(tensors[f"{switch}.up_proj.weight"][e], 4), dtype=torch.float32)
        assert torch.equal(values, experts.expert(e).up_proj.weight.detach())


def test_stacked_experts_take_one_entry_per_projection(models, tmp_path):
    recipe = for_format(with_tensor_types(resolve("mlx-4bit-g64"), ["down_proj=mlx-8bit-g64"]), MLX)
    tensors, config = written(models("qwen3_moe"), tmp_path, recipe)
    layers = {k for k, v in config["quantization"].items() if isinstance(v, dict)}
    assert layers == {f"model.layers.{i}.mlp.switch_mlp.down_proj" for i in range(2)}
    assert tensors["model.layers.1.mlp.switch_mlp.down_proj.weight"].shape == (4, 128, 128 * 8 // 32)


def test_experts_of_one_projection_on_two_grids_are_refused(models, tmp_path):
    recipe = for_format(with_tensor_types(resolve("mlx-4bit-g64"), [r"experts\.0\.down_proj=mlx-8bit-g64"]), MLX)
    with pytest.raises(FormatError, match=r"layers\.0\.mlp\.switch_mlp\.down_proj: its experts are on more than one"):
        written(models("qwen3_moe"), tmp_path, recipe)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_gemma_norms_are_stored_as_hugging_face_stores_them(arch, models, tmp_path):
    """mlx-lm's Gemma RMSNorm multiplies by 1 + weight, as Hugging Face's: the weight as it is (GGUF: 1 + weight);
    the tied lm_head is the quantized embedding."""
    src = models(arch)
    tensors, _ = written(src, tmp_path)
    source = load_file(src / "model.safetensors")
    for name in ("model.norm.weight", "model.layers.0.pre_feedforward_layernorm.weight"):
        assert torch.equal(tensors[name], source[name])
    assert "lm_head.weight" not in tensors and tensors["model.embed_tokens.weight"].dtype == torch.uint32


def test_gemma3s_config_holds_both_ropes_and_its_sliding_pattern(models, tmp_path):
    _, config = written(models("gemma3_text"), tmp_path)
    assert config["rope_theta"] == 1e6 and config["rope_local_base_freq"] == 100.0
    assert config["rope_scaling"] == {"type": "linear", "factor": 4.0}
    assert config["sliding_window_pattern"] == 2 and config["sliding_window"] == 4


def test_phi3s_fused_projections_are_whole(models, tmp_path):
    tensors, config = written(models("phi3"), tmp_path)
    assert tensors["model.layers.0.self_attn.qkv_proj.weight"].shape == (128 + 2 * 64, 128 * 4 // 32)
    assert tensors["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 256, 128 * 4 // 32)
    assert config["partial_rotary_factor"] == 0.5 and config["rope_theta"] == 10000.0


def config_of(arch: str, **overrides):
    return AutoConfig.for_model(arch, **SHAPES | CONFIGS[arch] | overrides)


REFUSED = [
    ("qwen3_moe", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
     "RoPE scaling 'yarn': mlx-lm's Qwen3-MoE rotates without scaling"),
    ("gemma2", dict(tie_word_embeddings=False), "an lm_head apart from the embedding"),
    ("gemma2", dict(final_logit_softcapping=None), "no logit soft-capping"),
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation gelu"),
    ("gemma3_text", dict(final_logit_softcapping=30.0), "mlx-lm's Gemma3 caps neither"),
    ("gemma3_text", dict(layer_types=["full_attention", "sliding_attention"]), "sliding_window_pattern"),
    ("gemma3_text", dict(layer_types=["sliding_attention", "sliding_attention"]), "sliding_window_pattern"),
    ("gemma3_text", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "on the sliding layers"),
    ("phi3", dict(max_position_embeddings=4096, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 512,
        "long_factor": [2.0] * 16, "short_factor": [1.0] * 16}), "LongRoPE rotates by the long factors"),
]


@pytest.mark.parametrize("arch, overrides, reason", REFUSED, ids=[f"{c[0]}-{c[2][:24]}" for c in REFUSED])
def test_configs_mlx_lm_computes_otherwise_are_refused_in_one_line(arch, overrides, reason):
    with pytest.raises(FormatError, match=f"mlx-lm's {arch} would compute another model: ") as raised:
        exporter(MLX).check_model(None, config_of(arch, **overrides), torch.nn.Module())
    assert reason in str(raised.value) and "\n" not in str(raised.value)


def test_gemma3_multimodal_is_refused_in_one_line():
    with pytest.raises(FormatError, match="not 'gemma3'; use --format gguf"):
        exporter(MLX).check_model(None, SimpleNamespace(model_type="gemma3"), torch.nn.Module())


def test_a_window_mlx_lm_does_not_slide_is_a_note():
    assert "slides a window of 16 tokens" in mlx_archs.notes(config_of("gemma2"))[0]
    assert mlx_archs.notes(config_of("gemma3_text")) == []  # mlx-lm's Gemma3 slides its window
    assert mlx_archs.notes(config_of("phi3")) == []  # no window
