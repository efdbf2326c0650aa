"""llama.cpp's named mixtures: which tensor gets which type (llama_tensor_get_type, restated in gguf_mixtures)."""

import pytest

from quantkit.quant import registry
from quantkit.quant.gguf_mixtures import k_spec, more_bits, role_of, tensor_type
from quantkit.grids.schemes import SchemeError


def test_more_bits_is_llama_cpps_use_more_bits():
    """For 32 layers: the first and last four, and every third one from layer 6 (llama.cpp's Q4_K_M on Llama 2 7B
    keeps attn_v and ffn_down in Q6_K on layers 0-3, 6, 9, ..., 27, 28-31)."""
    assert [i for i in range(32) if more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(2) if more_bits(i, 2)] == [1]  # (0 - 0) % 3 is 0; 1 >= 7 * 2 // 8


@pytest.mark.parametrize("mixture, role, layer, expected", [
    ("Q4_K_M", "attn_q", 5, "Q4_K"), ("Q4_K_M", "attn_v", 6, "Q6_K"), ("Q4_K_M", "attn_v", 7, "Q4_K"),
    ("Q4_K_M", "ffn_down", 31, "Q6_K"), ("Q4_K_M", "attn_output", 4, "Q4_K"), ("Q4_K_M", "output", None, "Q6_K"),
    ("Q4_K_M", "token_embd", None, "Q4_K"),
    ("Q5_K_M", "ffn_down", 0, "Q6_K"), ("Q5_K_M", "ffn_down", 4, "Q5_K"), ("Q5_K_M", "ffn_up", 0, "Q5_K"),
    ("Q3_K_M", "attn_v", 1, "Q5_K"), ("Q3_K_M", "attn_v", 2, "Q4_K"), ("Q3_K_M", "ffn_down", 1, "Q5_K"),
    ("Q3_K_M", "ffn_down", 2, "Q4_K"), ("Q3_K_M", "attn_output", 9, "Q4_K"), ("Q3_K_M", "ffn_gate", 9, "Q3_K"),
    ("Q2_K", "attn_v", 3, "Q4_K"), ("Q2_K", "ffn_down", 3, "Q3_K"), ("Q2_K", "attn_output", 3, "Q3_K"),
    ("Q2_K", "attn_k", 3, "Q2_K"), ("Q2_K", "output", None, "Q6_K"),
])
def test_tensor_types_follow_llama_cpps_rules(mixture, role, layer, expected):
    assert tensor_type(mixture, role, layer, 32, gqa=4) == expected


def test_q2_k_gives_attn_v_q3_k_without_grouped_queries():
    assert tensor_type("Q2_K", "attn_v", 0, 32, gqa=1) == "Q3_K"


def test_roles_come_from_the_llama_wiring():
    assert role_of("model.layers.12.self_attn.v_proj") == ("attn_v", 12)
    assert role_of("model.layers.3.mlp.down_proj") == ("ffn_down", 3)
    assert role_of("lm_head") == ("output", None)
    assert role_of("model.layers.3.mlp.experts.0.w1") == ("ffn_gate", 3)  # stacked into ffn_gate_exps
    assert role_of("model.layers.5.mlp.experts.12.down_proj") == ("ffn_down", 5)
    assert role_of("model.layers.3.mlp.gate") == (None, None)


def test_a_mixture_is_built_on_its_base_type():
    recipe = registry.resolve("gguf-q4-k-m")
    assert recipe.mixture == "Q4_K_M" and recipe.scheme.weights == k_spec("Q4_K")
    data = recipe.to_file()
    assert data["mixture"] == "Q4_K_M"
    with pytest.raises(SchemeError, match="Q5_K_M is built on Q5_K"):
        registry.parse_recipe("bad", {**data, "mixture": "Q5_K_M"})
    with pytest.raises(SchemeError, match="'Q4_K_L' is not one quantkit knows"):
        registry.parse_recipe("bad", {**data, "mixture": "Q4_K_L"})


def test_phi3s_fused_linears_take_llama_cpps_attn_qkv_and_ffn_up_rules():
    """llama.cpp files qkv_proj as attn_qkv, which its rules treat as attn_v (`category_is_attn_v`), and
    gate_up_proj as ffn_up."""
    assert role_of("model.layers.6.self_attn.qkv_proj") == ("attn_qkv", 6)
    assert role_of("model.layers.6.mlp.gate_up_proj") == ("ffn_up", 6)
    for mixture, layer in (("Q4_K_M", 6), ("Q4_K_M", 7), ("Q5_K_M", 6), ("Q3_K_M", 1), ("Q3_K_M", 2), ("Q2_K", 3)):
        assert tensor_type(mixture, "attn_qkv", layer, 32, gqa=1) == tensor_type(mixture, "attn_v", layer, 32, gqa=1)
    assert tensor_type("Q4_K_M", "attn_qkv", 6, 32, gqa=1) == "Q6_K"
    assert tensor_type("Q4_K_M", "ffn_up", 6, 32, gqa=1) == "Q4_K"
