"""Per-tensor type overrides: REGEX=TYPE, searched in quantkit's and GGUF's names, the last match wins."""

import pytest

from quantkit.errors import RecipeError
from quantkit.grids.schemes import SchemeError
from quantkit.quant import registry, tensor_types
from quantkit.quant.tensor_types import Override


def test_parse_splits_at_the_last_equals_and_names_the_type_as_llama_cpp():
    assert Override.parse("a=b=q8_0") == Override("a=b", "Q8_0")
    assert tensor_types.parse_all(["ffn_down = q6_k", "attn_v=float"]) == ("ffn_down=Q6_K", "attn_v=float")


@pytest.mark.parametrize("text, message", [("ffn_down", "REGEX=TYPE"), ("=q4_0", "REGEX=TYPE"), ("x=", "REGEX=TYPE"),
                                           ("(=q4_0", "regular expression"), ("x=Q9 K!", "neither a GGML type")])
def test_bad_overrides_say_what_to_write(text, message):
    with pytest.raises(SchemeError, match=message):
        Override.parse(text)


def test_the_last_match_wins_on_either_name():
    overrides = ("ffn_down=Q4_K", r"^blk\.1\.ffn_down$=Q6_K", "mlp=Q8_0", "layers.1.mlp.down_proj=Q5_K")
    names = ("model.layers.1.mlp.down_proj", tensor_types.gguf_name("model.layers.1.mlp.down_proj"))
    assert names[1] == "blk.1.ffn_down"
    assert tensor_types.type_for(names, overrides) == "Q5_K"
    assert tensor_types.type_for(names, overrides[:2]) == "Q6_K"
    assert tensor_types.type_for(("model.layers.1.self_attn.q_proj", "blk.1.attn_q"), overrides) is None
    assert tensor_types.gguf_name("lm_head") == "output"


def test_unmatched_overrides_are_reported():
    tensors = [("model.layers.0.mlp.down_proj", "blk.0.ffn_down")]
    assert tensor_types.unmatched(("down_proj=Q8_0", "ffn_dwn=Q8_0"), tensors) == ["ffn_dwn=Q8_0"]


def test_a_recipe_carries_them_and_the_command_line_comes_after():
    recipe = registry.parse_recipe("r", {**registry.resolve("gguf-q4-0").to_file(), "tensor_types": ["ffn_down=q6_k"]})
    assert recipe.tensor_types == ("ffn_down=Q6_K",)
    assert registry.with_tensor_types(recipe, ["attn_v=q8_0"]).tensor_types == ("ffn_down=Q6_K", "attn_v=Q8_0")
    again = registry.parse_recipe("r", registry.with_tensor_types(recipe, ["attn_v=q8_0"]).to_file())
    assert again.tensor_types == ("ffn_down=Q6_K", "attn_v=Q8_0")


def test_a_type_the_recipes_algorithm_cannot_round_onto_is_refused():
    with pytest.raises(RecipeError, match="--tensor-type .*hqq"):
        registry.with_tensor_types(registry.resolve("hqq-w4a16"), ["mlp=q4_k"])
    with pytest.raises(RecipeError, match="REGEX=TYPE"):
        registry.with_tensor_types(registry.resolve("gguf-q4-0"), ["mlp"])
    with pytest.raises(RecipeError, match="'q9_k' is neither a GGML type nor a recipe"):
        registry.with_tensor_types(registry.resolve("gguf-q4-0"), ["mlp=q9_k"])
    with pytest.raises(RecipeError, match="did you mean gptq-w8a16"):
        registry.with_tensor_types(registry.resolve("gptq-w4a16"), ["mlp=gptq-w8a61"])
