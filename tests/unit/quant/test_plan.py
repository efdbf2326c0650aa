import pytest
from torch import nn

from quantkit.quant import registry
from quantkit.quant.plan import fitting_group_size, is_ignored, plan_model
from quantkit.quant.registry import IndivisiblePolicy


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(128, 96)
        self.down = nn.Linear(96, 128)
        self.odd = nn.Linear(40, 8)
        self.lm_head = nn.Linear(128, 10)


@pytest.mark.parametrize(
    "name, patterns, expected",
    [
        ("lm_head", ("lm_head",), True),
        ("model.lm_head", ("lm_head",), True),
        ("model.not_lm_head", ("lm_head",), False),
        ("model.layers.3.mlp.down_proj", ("re:layers\\.3\\.",), True),
        ("model.layers.13.mlp.down_proj", ("re:layers\\.3\\.",), False),
    ],
)
def test_ignore_patterns(name, patterns, expected):
    assert is_ignored(name, patterns) is expected


@pytest.mark.parametrize("in_features, group, expected", [(256, 128, 128), (96, 128, 32), (176, 32, 16), (40, 32, None)])
def test_fitting_group_size(in_features, group, expected):
    assert fitting_group_size(in_features, group) == expected


def test_plan_smaller_group_policy():
    recipe = registry.resolve("int4-weight-only")
    plan = {e.name: e for e in plan_model(Toy(), recipe)}
    assert plan["up"].scheme == recipe.scheme and plan["up"].note == ""
    assert plan["down"].scheme.weights.group_size == 32 and "128 -> 32" in plan["down"].note
    assert plan["odd"].scheme is None and "does not divide input size 40" in plan["odd"].note
    assert plan["lm_head"].scheme is None and plan["lm_head"].note == "ignored by recipe"


def test_plan_skip_policy():
    from dataclasses import replace

    recipe = replace(registry.resolve("int4-weight-only"), on_indivisible=IndivisiblePolicy.SKIP)
    plan = {e.name: e for e in plan_model(Toy(), recipe)}
    assert plan["down"].scheme is None and "left in full precision" in plan["down"].note
    assert plan["up"].quantized


def test_per_channel_recipes_quantize_any_width():
    plan = plan_model(Toy(), registry.resolve("int8-weight-only"))
    assert [e.name for e in plan if e.quantized] == ["up", "down", "odd"]


def test_fused_moe_experts_are_refused_not_left_in_full_precision():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.errors import UnsupportedModelError

    config = AutoConfig.for_model("mixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=64, num_local_experts=4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match=r"fused 3-D parameters \(model.layers.0.mlp.experts"):
        plan_model(model, registry.resolve("int4-weight-only"))


def test_coverage_counts_parameters_and_names_every_full_precision_tensor():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.quant.plan import coverage

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = plan_model(model, registry.resolve("int4-weight-only"))
    found = coverage(model, plan)
    quantized = sum(e.in_features * e.out_features for e in plan if e.quantized)
    assert found["quantized_parameters"] == quantized
    assert found["linear_parameters"] == quantized + 64 * 100  # lm_head is ignored
    assert found["all_parameters"] == sum(p.numel() for p in model.parameters())
    reasons = {t["tensor"]: t["reason"] for t in found["full_precision"]}
    assert reasons["lm_head.weight"] == "ignored by recipe"
    assert reasons["model.embed_tokens.weight"].startswith("not an nn.Linear weight")
    assert reasons["model.norm.weight"].startswith("a norm")
    assert found["quantized_parameters"] + sum(t["parameters"] for t in found["full_precision"]) == found["all_parameters"]


def test_coverage_counts_a_tensor_the_format_quantizes_as_quantized_with_its_type():
    """A tensor outside the plan that the format stores quantized (GGUF: a mixture's token embedding) is counted as
    quantized, with its type, and not listed as full precision; the Linear share counts Linear weights only."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.quant.plan import coverage

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = plan_model(model, registry.resolve("int4-weight-only"))
    linear = sum(e.in_features * e.out_features for e in plan if e.quantized)
    found = coverage(model, plan, {"model.embed_tokens.weight": "Q4_K"})
    assert found["quantized_by_format"] == [{"tensor": "model.embed_tokens.weight", "parameters": 64 * 100, "type": "Q4_K"}]
    assert "model.embed_tokens.weight" not in {t["tensor"] for t in found["full_precision"]}
    assert found["quantized_linear_parameters"] == linear
    assert found["quantized_parameters"] == linear + 64 * 100
    assert found["quantized_parameters"] + sum(t["parameters"] for t in found["full_precision"]) == found["all_parameters"]
    with pytest.raises(ValueError, match="model.embed_token.weight"):
        coverage(model, plan, {"model.embed_token.weight": "Q4_K"})  # a name the model does not have: not dropped
