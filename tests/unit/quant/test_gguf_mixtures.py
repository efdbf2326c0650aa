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
    assert role_of("model.layers.3.mlp.experts.0.w1") == ("ffn_gate_exps", 3)  # stacked into ffn_gate_exps
    assert role_of("model.layers.5.mlp.experts.12.down_proj") == ("ffn_down_exps", 5)
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


# ---- the mixtures added after the first four, restated from llama.cpp's llama_tensor_get_type (src/llama-quant.cpp at
# commit 0c1e570) as literal per-layer lists, independently of gguf_mixtures' rules

ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def first(k: int, then: str, rest: str, n: int) -> list[str]:
    """Layers 0 .. k-1 in `then`, the others in `rest`."""
    return [then] * k + [rest] * (n - k)


def llama_cpp_types(mixture: str, n: int, gqa: int) -> dict[str, list[str]]:
    """role -> the type of each of n layers (output, token_embd: one each), as llama.cpp assigns them."""
    base = {"Q2_K_S": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_L": "Q3_K", "Q4_K_S": "Q4_K", "Q5_K_S": "Q5_K", "Q6_K": "Q6_K"}[mixture]
    types = {role: [base] * n for role in ROLES}
    if mixture == "Q2_K_S":  # attn_v Q4_K where gqa >= 4; ffn_down Q4_K in the first eighth
        types["attn_v"] = [("Q4_K" if gqa >= 4 else "Q2_K")] * n
        types["ffn_down"] = first(n // 8, "Q4_K", "Q2_K", n)
    if mixture == "Q3_K_L":  # attn_v, ffn_down and attn_output Q5_K
        types["attn_v"] = types["ffn_down"] = types["attn_output"] = ["Q5_K"] * n
    if mixture == "Q4_K_S":  # attn_v Q5_K for the first 4 (i_attention_wv < 4), ffn_down Q5_K in the first eighth
        types["attn_v"] = first(4, "Q5_K", "Q4_K", n)
        types["ffn_down"] = first(n // 8, "Q5_K", "Q4_K", n)
    return {**types, "output": ["Q6_K"], "token_embd": [base]}


@pytest.mark.parametrize("mixture", ["Q2_K_S", "Q3_K_S", "Q3_K_L", "Q4_K_S", "Q5_K_S", "Q6_K"])
@pytest.mark.parametrize("n, gqa", [(32, 4), (32, 8), (28, 4), (28, 8), (32, 1)])
def test_each_k_mixture_gives_each_role_and_layer_llama_cpps_type(mixture, n, gqa):
    """A Llama-3-8B-like shape (32 layers), a Qwen2.5-7B-like one (28 layers, 7 query heads per KV head: >= 4),
    GQA 4 and 8, and no GQA (attn_v's rule in Q2_K_S)."""
    expected = llama_cpp_types(mixture, n, gqa)
    found = {role: [tensor_type(mixture, role, i, n, gqa) for i in range(n)] for role in ROLES}
    found["output"] = [tensor_type(mixture, "output", None, n, gqa)]
    found["token_embd"] = [tensor_type(mixture, "token_embd", None, n, gqa)]
    assert found == expected
    assert [tensor_type(mixture, "attn_qkv", i, n, gqa) for i in range(n)] == expected["attn_v"]  # category_is_attn_v
    assert [tensor_type(mixture, "ffn_down_exps", i, n, gqa, experts=8) for i in range(n)] == expected["ffn_down"]


def test_the_first_eighth_is_integer_division_as_in_c():
    """ffn_down's `i_layer < n_layer/8`: 3 layers of 28 (28/8 = 3 in C), 4 of 32, none of 7."""
    assert [tensor_type("Q2_K_S", "ffn_down", i, 28, 4) for i in range(4)] == ["Q4_K", "Q4_K", "Q4_K", "Q2_K"]
    assert [tensor_type("Q4_K_S", "ffn_down", i, 32, 4) for i in range(5)] == ["Q5_K"] * 4 + ["Q4_K"]
    assert tensor_type("Q4_K_S", "ffn_down", 0, 7, 4) == "Q4_K"


@pytest.mark.parametrize("n", [32, 28])
def test_the_existing_mixtures_on_a_28_layer_shape(n):
    """Q4_K_M's more_bits on 28 layers: 0-2, 5, 8, ..., 23 and 24-27 (n/8 = 3, 7n/8 = 24); Q3_K_M's ffn_down Q5_K
    for i < n/16 (1 of 28, 2 of 32)."""
    more = [i for i in range(n) if tensor_type("Q4_K_M", "attn_v", i, n, 4) == "Q6_K"]
    assert more == ([0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27] if n == 28 else
                    [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31])
    assert [tensor_type("Q3_K_M", "ffn_down", i, n, 4) for i in range(4)] == first(n // 16, "Q5_K", "Q4_K", 4)  # 1, 2


def test_mxfp4_moe_puts_experts_in_mxfp4_and_the_rest_in_q8_0():
    """llama.cpp's MXFP4_MOE: 3-D expert stacks MXFP4, every other tensor Q8_0 (output and token_embd too); a dense
    model's decoder Linears MXFP4 instead (llama.cpp's rule would leave none), output and token_embd Q8_0."""
    for role in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        assert tensor_type("MXFP4_MOE", role, 3, 48, 8, experts=128) == "MXFP4"
    for role in ROLES + ("output", "token_embd"):
        assert tensor_type("MXFP4_MOE", role, 3 if role in ROLES else None, 48, 8, experts=128) == "Q8_0"
    for role in ROLES:
        assert tensor_type("MXFP4_MOE", role, 3, 32, 4) == "MXFP4"
    assert tensor_type("MXFP4_MOE", "output", None, 32, 4) == tensor_type("MXFP4_MOE", "token_embd", None, 32, 4) == "Q8_0"


def test_mxfp4_moe_is_built_on_the_mxfp4_grid():
    from quantkit.quant import gguf_types

    recipe = registry.resolve("gguf-mxfp4")
    assert recipe.mixture == "MXFP4_MOE" and recipe.scheme.weights == gguf_types.spec("MXFP4")
    with pytest.raises(SchemeError, match="MXFP4_MOE is built on MXFP4: .*float8_e8m0fnu"):
        registry.parse_recipe("bad", {**registry.resolve("gguf-q4-k-m").to_file(), "mixture": "MXFP4_MOE"})
    with pytest.raises(SchemeError, match="Q4_K_S is built on Q4_K"):
        registry.parse_recipe("bad", {**recipe.to_file(), "mixture": "Q4_K_S"})


@pytest.mark.parametrize("name", ["gguf-q2-k-s", "gguf-q3-k-s", "gguf-q3-k-l", "gguf-q4-k-s", "gguf-q5-k-s", "gguf-q6-k"])
def test_each_new_mixture_has_its_recipe_on_its_base_grid(name):
    recipe = registry.resolve(name)
    assert recipe.mixture == name.removeprefix("gguf-").upper().replace("-", "_")
    assert recipe.scheme.weights == k_spec({"Q2_K_S": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_L": "Q3_K", "Q4_K_S": "Q4_K",
                                            "Q5_K_S": "Q5_K", "Q6_K": "Q6_K"}[recipe.mixture])


# ---- the i-quant mixtures' rules, restated from the same source as literal lists

def llama_cpp_iq_types(mixture: str, n: int, gqa: int, experts: int = 0, imatrix: bool = True) -> dict[str, list[str]]:
    base = {"IQ1_M": "IQ1_M", "IQ2_XXS": "IQ2_XXS", "IQ2_M": "IQ2_S", "IQ3_XXS": "IQ3_XXS", "IQ3_M": "IQ3_S",
            "IQ4_XS": "IQ4_XS"}[mixture]
    types = {role: [base] * n for role in ROLES}
    output, embedding = "Q6_K", base
    if mixture in ("IQ1_M", "IQ2_XXS", "IQ2_M"):  # llama.cpp's IQ1/IQ2 branch
        low = "IQ3_S" if mixture == "IQ2_M" else "Q2_K"
        types["attn_v"] = [("Q4_K" if gqa >= 4 or experts >= 4 else low)] * n
        types["ffn_down"] = first(n // 8, low, base, n)
        types["attn_output"] = [{"IQ1_M": "IQ2_XXS", "IQ2_M": "IQ3_S"}.get(mixture, base)] * n
        output, embedding = "Q5_K", low
    if mixture == "IQ3_XXS":
        types["attn_v"] = [("Q4_K" if gqa >= 4 else "IQ3_XXS" if imatrix else "IQ3_S")] * n
        types["attn_q"] = types["attn_k"] = ["IQ2_S"] * n
        types["ffn_down"] = [base] * n if imatrix else first(n // 8, "Q4_K", "Q3_K", n)
        types["attn_output"] = ["IQ3_S"] * n
        output, embedding = "Q5_K", "IQ3_S"
    if mixture == "IQ3_M":
        types["attn_v"] = types["attn_output"] = ["Q4_K"] * n
        types["ffn_down"] = first(n // 8, "Q4_K", base, n)
    if mixture == "IQ4_XS":
        types["attn_v"] = [("Q5_K" if gqa >= 4 else base)] * n
        types["ffn_down"] = [base] * n if imatrix else first(n // 8, "Q5_K", base, n)
    return {**types, "output": [output], "token_embd": [embedding]}


@pytest.mark.parametrize("mixture", ["IQ1_M", "IQ2_XXS", "IQ2_M", "IQ3_XXS", "IQ3_M", "IQ4_XS"])
@pytest.mark.parametrize("n, gqa, experts, imatrix", [(32, 4, 0, True), (32, 8, 0, True), (28, 1, 0, True),
                                                      (32, 1, 0, False), (48, 1, 128, True)])
def test_each_i_quant_mixtures_rules_give_llama_cpps_types(mixture, n, gqa, experts, imatrix):
    from quantkit.quant.gguf_mixtures import NEEDS_DATA

    expected = llama_cpp_iq_types(mixture, n, gqa, experts, imatrix)
    found = {role: [tensor_type(mixture, role, i, n, gqa, experts, imatrix) for i in range(n)] for role in ROLES}
    for role in ("output", "token_embd"):
        found[role] = [tensor_type(mixture, role, None, n, gqa, experts, imatrix)]
    assert found == expected
    assert (mixture in NEEDS_DATA) == (mixture in ("IQ1_M", "IQ2_XXS", "IQ2_M", "IQ3_XXS"))


@pytest.mark.parametrize("name, mixture, base", [("gguf-iq2-m", "IQ2_M", "IQ2_S"), ("gguf-iq3-m", "IQ3_M", "IQ3_S")])
def test_the_i_quant_mixture_recipes_are_on_their_base_grid(name, mixture, base):
    from quantkit.quant import gguf_types

    recipe = registry.resolve(name)
    assert recipe.mixture == mixture and recipe.scheme.weights == gguf_types.spec(base)


def test_an_i_quant_mixture_on_another_grid_names_the_recipe_whose_scheme_it_takes():
    with pytest.raises(SchemeError, match="IQ2_M is built on IQ2_S: .*recipe gguf-iq2-s"):
        registry.parse_recipe("bad", {**registry.resolve("gguf-q4-k-m").to_file(), "mixture": "IQ2_M"})
