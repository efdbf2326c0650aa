"""MoE layers while they calibrate: every expert sees every token, and the tokens really routed are counted."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.calibration.experts import RoutedTokens, calibrating
from quantkit.calibration.hooks import capture_inputs, observe
from quantkit.calibration.layer import CalibrationResult, Layer
from quantkit.models.loading import decoder_layers
from quantkit.models.moe import expert_linears, linearize
from quantkit.quant import registry
from quantkit.grids.observers import HessianObserver
from quantkit.quant.plan import plan_model


@pytest.mark.parametrize("split", [1, 3])
def test_routed_token_counts_over_parts_sum_to_the_whole(split):
    index = torch.randint(0, 5, (6, 10, 2), generator=torch.Generator().manual_seed(0))
    index[0, 0, 0] = 4  # "no expert" (the number of experts): not counted
    whole, first, second = (RoutedTokens(4, torch.device("cpu")) for _ in range(3))
    whole.update(index)
    first.update(index[:split])
    second.update(index[split:])
    first.merge([second])
    assert torch.equal(first.state["count"], whole.state["count"])
    assert whole.state["count"].tolist() == [int((index == e).sum()) for e in range(4)]


def _layer(model_type="mixtral", **extra):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=300, num_local_experts=8, num_experts_per_tok=2, **extra)
    model = linearize(AutoModelForCausalLM.from_config(config).eval())
    recipe = registry.resolve("gptq-w4a16")
    plan = {e.name: e for e in plan_model(model, recipe)}
    layers = decoder_layers(model)
    ids = torch.randint(0, 300, (4, 6), generator=torch.Generator().manual_seed(0))
    inputs = capture_inputs(model, layers, list(ids.split(2)), torch.device("cpu"))
    return Layer(layers[0], "model.layers.0", 0, inputs, plan, recipe, CalibrationResult()), expert_linears(layers[0])


def test_while_calibrating_every_expert_has_statistics_on_every_token():
    """24 tokens, top-2 of 8 experts: with real routing some experts get few tokens or none; calibrating, every
    expert Linear sees all 24, and the experts' gate and up share one Hessian (they read one tensor)."""
    layer, names = _layer()
    linears = {n: layer.module.get_submodule(n) for n in names}
    routed = observe(linears, HessianObserver, layer.module, layer.inputs)
    with calibrating(layer):
        counts = layer.result.routed_tokens["model.layers.0.mlp.experts"]
        everyone = observe(linears, HessianObserver, layer.module, layer.inputs)
    assert sum(counts) == 24 * 2 and min(counts) < 24
    assert [int(routed[f"mlp.experts.{e}.w1"].state["count"]) for e in range(8)] == counts
    assert all(int(o.state["count"]) == 24 for o in everyone.values())
    assert len({id(everyone[n]) for n in names if not n.endswith(".w2")}) == 1
    assert not any(m.all_tokens for m in layer.module.modules() if hasattr(m, "all_tokens"))  # reset on exit


def test_a_dense_layer_is_left_alone():
    layer, _ = _layer("llama")
    with calibrating(layer):
        pass
    assert layer.result.routed_tokens == {}


def test_gptq_stages_the_dense_layers_of_a_model_whose_first_layer_is_dense_and_not_its_moe_layers():
    """Qwen2-MoE with `mlp_only_layers=[0]` (as DeepSeek's first dense layers): GPTQ's staged pass, chosen at layer 0,
    runs on the dense layer; the MoE layer after it takes the observe-and-propagate passes."""
    from quantkit.calibration import calibrate

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                  shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=300, num_experts=4, num_experts_per_tok=2,
                                  mlp_only_layers=[0])
    model = linearize(AutoModelForCausalLM.from_config(config).eval())
    recipe = registry.resolve("gptq-w4a16")
    plan = plan_model(model, recipe)
    ids = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    result = calibrate(model, plan, recipe, ids, torch.device("cpu"), batch_size=2)
    assert result.true_sequential and "propagate" in result.seconds and "forward" in result.seconds
    assert set(result.qweights) == {e.name for e in plan if e.quantized}
    assert sum(result.routed_tokens["model.layers.1.mlp.experts"]) == 64 * 2
