"""Gemma2, Gemma3 and Phi-3 in GGUF: every tensor as llama.cpp's converter writes it (Gemma's norms as 1 + weight,
Phi-3's fused projections whole, LongRoPE's factors), the header keys llama.cpp's graphs read, llama.cpp's mixture
types for their tensors, and the configs llama.cpp would compute differently refused before any weight is read.
(llama.cpp running these files: tests/integration/test_eval_gguf_archs.py.)"""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from quantkit.errors import FormatError  # noqa: E402
from quantkit.export import for_format  # noqa: E402
from quantkit.export.gguf import check_architecture  # noqa: E402
from quantkit.finalization.finalize import CalibrationOptions, finalize, prepare, quantize_model  # noqa: E402
from quantkit.quant import registry  # noqa: E402

GGUF = registry.Format.GGUF
SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 512,
            "long_factor": [1.0 + i for i in range(32)], "short_factor": [1.0 + i / 2 for i in range(32)]}
CONFIGS = {
    "gemma2": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=16, attn_logit_softcapping=20.0,
                   final_logit_softcapping=10.0),
    "gemma3_text": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=16, final_logit_softcapping=10.0,
                        layer_types=["full_attention", "sliding_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    "phi3": dict(intermediate_size=256, max_position_embeddings=4096, original_max_position_embeddings=512,
                 rope_parameters=LONGROPE, pad_token_id=None),
}
ARCH_NAMES = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One tiny float32 model of each architecture, built on first use (named without the architecture: llama.cpp
    gives a model named phi3 special tokens a tiny tokenizer lacks)."""
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_model

    built = {}

    def model(arch):
        if arch not in built:
            root = tmp_path_factory.mktemp("archs")
            built[arch] = build_tiny_model(root / f"tiny-{len(built)}", make_text(3000), arch, **{**SHAPES, **CONFIGS[arch]})
        return built[arch]
    return model


def read(path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    return {name: f.contents() for name, f in reader.fields.items()}, {t.name: t for t in reader.tensors}


def q8_0_file(src, tmp_path) -> tuple[dict, dict]:
    """(fields, tensors) of `src` finalized with gguf-q8-0 (round to nearest: no calibration data)."""
    out = tmp_path / "m.gguf"
    finalize(src, out, registry.resolve("gguf-q8-0"))
    return read(out)


def dequantized(tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type))).float()


def expected_tensors(src, recipe, options=None) -> tuple[dict[str, torch.Tensor], object]:
    """The in-memory quantized model's tensors under llama.cpp's names, as llama.cpp's converter changes them
    (Gemma: every norm weight + 1; a tied lm_head is token_embd)."""
    recipe = for_format(recipe, GGUF)
    model = quantize_model(prepare(src, recipe, GGUF, calibration=options), recipe, calibration=options)
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[ARCH_NAMES[config.model_type].upper()], config.num_hidden_layers)
    found = {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        value = value.float()
        if config.model_type.startswith("gemma") and key.endswith("norm.weight"):
            value = value + 1
        found[names.get_name(key, try_suffixes=(".weight", ".bias"))] = value
    return found, config


def assert_same_tensors(tensors: dict, expected: dict) -> None:
    assert set(tensors) - {"rope_factors_long.weight", "rope_factors_short.weight"} == set(expected)
    for name, value in expected.items():
        assert torch.equal(dequantized(tensors[name]).reshape(value.shape), value), name


@pytest.mark.parametrize("arch", CONFIGS)
def test_every_tensor_is_the_quantized_models_as_llama_cpp_reads_it(models, tmp_path, arch):
    """gguf-q8-0: the Linears Q8_0 bit for bit, Gemma's norms (q/k norms included) 1 + weight in F32, Phi-3's fused
    qkv_proj and gate_up_proj as attn_qkv and ffn_up whole, LongRoPE's factors as the config's."""
    fields, tensors = q8_0_file(models(arch), tmp_path)
    expected, config = expected_tensors(models(arch), registry.resolve("gguf-q8-0"))
    assert_same_tensors(tensors, expected)
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    if arch == "phi3":
        assert tensors["blk.0.attn_qkv.weight"].tensor_type.name == tensors["blk.1.ffn_up.weight"].tensor_type.name == "Q8_0"
        assert list(tensors["blk.0.ffn_up.weight"].shape) == [256, 512]  # gate rows first, as llama.cpp's SwiGLU splits
        for kind in ("long", "short"):
            assert dequantized(tensors[f"rope_factors_{kind}.weight"]).tolist() == LONGROPE[f"{kind}_factor"]
    else:
        assert "output.weight" not in tensors  # tied: llama.cpp's output is token_embd
        assert torch.all(dequantized(tensors["blk.0.attn_norm.weight"]) > 0.5)  # HF initialises Gemma's norms at 0
    if arch == "gemma3_text":
        assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= set(tensors)
        assert tensors["blk.1.attn_q.weight"].tensor_type.name == "Q8_0"


def test_gemma2s_header_holds_what_llama_cpps_graph_reads(models, tmp_path):
    fields, _ = q8_0_file(models("gemma2"), tmp_path)
    assert fields["general.architecture"] == "gemma2"
    assert {k: fields[f"gemma2.{k}"] for k in ("block_count", "context_length", "embedding_length", "feed_forward_length",
            "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length")} == {
        "block_count": 2, "context_length": 512, "embedding_length": 256, "feed_forward_length": 512,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 64, "attention.value_length": 64}
    assert fields["gemma2.attn_logit_softcapping"] == 20.0 and fields["gemma2.final_logit_softcapping"] == 10.0
    assert fields["gemma2.attention.sliding_window"] == 16
    assert fields["gemma2.attention.sliding_window_pattern"] == [True, False]  # Hugging Face's layer_types
    assert fields["gemma2.rope.freq_base"] == 10000.0
    assert fields["gemma2.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)


def test_gemma3s_header_holds_both_ropes_and_its_layer_types(models, tmp_path):
    fields, _ = q8_0_file(models("gemma3_text"), tmp_path)
    assert fields["general.architecture"] == "gemma3"
    assert fields["gemma3.rope.freq_base"] == 1e6 and fields["gemma3.rope.freq_base_swa"] == 100.0
    assert fields["gemma3.rope.scaling.type"] == "linear" and fields["gemma3.rope.scaling.factor"] == 4.0
    assert fields["gemma3.attention.sliding_window"] == 16
    assert fields["gemma3.attention.sliding_window_pattern"] == [False, True]
    assert fields["gemma3.final_logit_softcapping"] == 10.0 and "gemma3.attn_logit_softcapping" not in fields
    assert fields["gemma3.attention.key_length"] == 64 and fields["gemma3.attention.head_count_kv"] == 2


def test_phi3s_header_holds_longrope(models, tmp_path):
    fields, _ = q8_0_file(models("phi3"), tmp_path)
    assert fields["general.architecture"] == "phi3"
    assert fields["phi3.context_length"] == 4096 and fields["phi3.rope.scaling.original_context_length"] == 512
    assert fields["phi3.rope.dimension_count"] == 64 and fields["phi3.attention.sliding_window"] == 0
    assert fields["phi3.rope.scaling.attn_factor"] == pytest.approx((1 + np.log(8) / np.log(512)) ** 0.5)
    assert fields["phi3.feed_forward_length"] == 256 and fields["phi3.attention.head_count_kv"] == 2


@pytest.mark.parametrize("arch", CONFIGS)
def test_a_mixture_gives_llama_cpps_types_to_each_architecture(models, text_file, tmp_path, arch):
    """gguf-q4-k-m with GPTQ: llama.cpp's Q4_K_M types (llama_tensor_get_type: attn_qkv is attn_v to its rules, the
    fused gate/up is ffn_up; a tied lm_head is token_embd, in the output's Q6_K), the file bit for bit the in-memory
    quantized model's, the tied embedding included."""
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    out = tmp_path / "q4km.gguf"
    finalize(models(arch), out, registry.resolve("gguf-q4-k-m"), calibration=options)
    fields, tensors = read(out)
    types = {name: t.tensor_type.name for name, t in tensors.items()}
    values = "attn_qkv" if arch == "phi3" else "attn_v"
    assert [types[f"blk.{i}.{values}.weight"] for i in range(2)] == ["Q4_K", "Q6_K"]  # more_bits(i, 2): layer 1
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(2)] == ["Q4_K", "Q6_K"]
    assert types["blk.0.ffn_up.weight"] == types["blk.1.attn_output.weight"] == "Q4_K"
    if arch == "phi3":
        assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    else:
        assert "output.weight" not in types and types["token_embd.weight"] == "Q6_K"
        assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_gate.weight"] == "Q4_K"
    expected, _ = expected_tensors(models(arch), registry.resolve("gguf-q4-k-m"), options)
    assert_same_tensors(tensors, expected)
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M


def config_of(arch, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(arch, **{**SHAPES, **CONFIGS[arch], **overrides})


@pytest.mark.parametrize("arch, overrides, reason", [
    ("gemma2", dict(query_pre_attn_scalar=256), r"query_pre_attn_scalar 256: llama.cpp scales queries by 1/sqrt\(64\)"),
    ("gemma2", dict(attn_logit_softcapping=None), "llama.cpp's Gemma2 graph always caps"),
    ("gemma2", dict(final_logit_softcapping=None), "llama.cpp's Gemma2 graph always caps"),
    ("gemma2", dict(tie_word_embeddings=False), "an lm_head apart from the embedding"),
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation gelu"),
    ("gemma2", dict(layer_types=["full_attention"] * 2), "no sliding layer: llama.cpp's Gemma2 graph needs one"),
    ("gemma2", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "RoPE scaling 'dynamic'"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0), "attention logit soft-capping: llama.cpp's Gemma3 graph has none"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "RoPE scaling 'yarn' on the global layers"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "RoPE scaling 'linear' on the sliding layers"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "bidirectional attention"),
    ("phi3", dict(sliding_window=2047), "llama.cpp switches Phi-3's sliding window off"),
    ("phi3", dict(hidden_act="gelu"), "hidden_act gelu"),
])
def test_a_config_llama_cpp_would_compute_differently_is_refused(arch, overrides, reason):
    with pytest.raises(FormatError, match=reason) as refused:
        check_architecture(config_of(arch, **overrides))
    assert "\n" not in str(refused.value) and str(refused.value).endswith("use --format compressed-tensors")


@pytest.mark.parametrize("arch, layers", [("gemma2", 46), ("gemma3_text", 62)])
def test_gemmas_query_scale_follows_llama_cpps_model_size(arch, layers):
    """llama.cpp scales queries by 1/sqrt(hidden / heads) in the model it names 27B (by its layer count), else by
    1/sqrt(head_dim): a config is accepted where query_pre_attn_scalar is that."""
    check_architecture(config_of(arch))
    check_architecture(config_of(arch, num_hidden_layers=layers, layer_types=None, head_dim=32, query_pre_attn_scalar=64))
    with pytest.raises(FormatError, match=r"1/sqrt\(32\) for a model of 2 layers"):
        check_architecture(config_of(arch, layer_types=None, head_dim=32, query_pre_attn_scalar=64))


def test_phi3_without_longrope_and_with_an_idle_window_is_accepted():
    check_architecture(config_of("phi3", rope_parameters=None, sliding_window=262144))


def test_a_refused_model_is_refused_before_any_weight_is_read(models, tmp_path, monkeypatch):
    """finalize stops at the checks, on the config alone: no weight read, nothing written."""
    import json
    import shutil

    import safetensors

    bad = shutil.copytree(models("gemma2"), tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "query_pre_attn_scalar": 144}))
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(FormatError, match="query_pre_attn_scalar 144"):
        finalize(bad, tmp_path / "out" / "m.gguf", registry.resolve("gguf-q8-0"))
    assert not (tmp_path / "out").exists()


def test_a_tied_embedding_left_to_llama_cpps_rounding_is_on_its_grid_in_memory_too(models, tmp_path):
    """lm_head ignored, rounded to nearest: the tied token_embd is llama.cpp's output, in the output's Q6_K by
    llama.cpp's own rounding, and the in-memory model's embedding and lm_head hold those very values."""
    data = registry.resolve("gguf-q4-k-m").to_file()
    recipe = registry.parse_recipe("rtn-q4-k-m", {**data, "algorithm": {"name": "rtn"}, "ignore": ["lm_head"]})
    out = tmp_path / "m.gguf"
    finalize(models("gemma2"), out, recipe)
    _, tensors = read(out)
    assert tensors["token_embd.weight"].tensor_type.name == "Q6_K" and "output.weight" not in tensors
    expected, _ = expected_tensors(models("gemma2"), recipe)
    assert_same_tensors(tensors, expected)


def test_qwen3_moe_without_normalised_routing_is_refused():
    """llama.cpp's Qwen3-MoE always rescales the chosen experts' weights to sum to 1: a config that does not (the
    config class's default, though released models set it) would be written as another model."""
    from transformers import AutoConfig

    moe = dict(SHAPES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256)
    with pytest.raises(FormatError, match="norm_topk_prob false: llama.cpp's Qwen3-MoE always rescales"):
        check_architecture(AutoConfig.for_model("qwen3_moe", **moe, norm_topk_prob=False))
    check_architecture(AutoConfig.for_model("qwen3_moe", **moe, norm_topk_prob=True))
