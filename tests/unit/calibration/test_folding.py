"""Scales fold into the norm a layer's Linears really read, whatever its name or weight convention, leaving
the float function unchanged (Gemma2: the MLP reads pre_feedforward_layernorm, and norms compute x * (1 + w);
an MoE block's router and gates read that norm too and take the scales with the experts)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.algorithms.awq import fold_scales
from quantkit.architectures import LLAMA, norm_weight_offset, traced_wiring
from quantkit.calibration.hooks import capture_inputs, run_layer
from quantkit.models import decoder_layers


def _layer_and_inputs(model_type: str, **extra):
    from quantkit.moe import linearize

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300, **extra)
    model = linearize(AutoModelForCausalLM.from_config(config).eval())
    for name, param in model.named_parameters():  # norms away from their init, so a wrong fold shows
        if param.dim() == 1:
            param.data.uniform_(0.5, 1.5)
    layers = decoder_layers(model)
    ids = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    return layers[0], capture_inputs(model, layers, list(ids.split(2)), torch.device("cpu"))


@pytest.mark.parametrize("model_type, extra, mlp_norm, offset", [
    ("llama", {}, "post_attention_layernorm", 0.0),
    ("gemma2", {"head_dim": 16}, "pre_feedforward_layernorm", 1.0),
])
def test_folding_into_the_traced_norms_keeps_the_layers_function(model_type, extra, mlp_norm, offset):
    layer, inputs = _layer_and_inputs(model_type, **extra)
    wiring = traced_wiring(layer, inputs[0])
    assert wiring.post_attention_norm == mlp_norm and wiring.input_norm == LLAMA.input_norm
    reference = run_layer(layer, inputs)
    scales = torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5
    for norm, linears in wiring.smoothing:
        module = layer.get_submodule(norm)
        assert norm_weight_offset(module) == offset
        fold_scales(module.weight, None, [layer.get_submodule(n).weight for n in linears], scales, offset)
    for ours, theirs in zip(run_layer(layer, inputs), reference):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_folding_into_the_norm_the_names_suggest_would_change_gemma2():
    """What quantkit did before it traced the wiring: the names say post_attention_layernorm feeds the MLP."""
    layer, inputs = _layer_and_inputs("gemma2", head_dim=16)
    reference = run_layer(layer, inputs)
    scales = torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5
    fold_scales(layer.post_attention_layernorm.weight, None, [layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight], scales)
    assert not torch.allclose(run_layer(layer, inputs)[0], reference[0], rtol=1e-3, atol=1e-4)


MOE = {"mixtral": dict(num_local_experts=4), "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32)}


@pytest.mark.parametrize("model_type", MOE)
def test_folding_into_an_moe_layer_keeps_its_function_with_the_router_and_gates_scaled_along(model_type):
    from quantkit.moe import traced_moe_wiring

    layer, inputs = _layer_and_inputs(model_type, **MOE[model_type])
    wiring = traced_moe_wiring(layer, inputs[0])
    gates = {"mlp.gate"} | ({"mlp.shared_expert_gate"} if model_type == "qwen2_moe" else set())
    assert wiring.norm == "post_attention_layernorm" and set(wiring.gates) == gates
    assert len(wiring.pairs) == 4 + (model_type == "qwen2_moe") and len(wiring.inputs) == 2 * len(wiring.pairs)
    reference = run_layer(layer, inputs)
    generator = torch.Generator().manual_seed(1)
    saved = {name: p.detach().clone() for name, p in layer.named_parameters()}
    for prev, linears, _ in wiring.awq_mappings[2:]:  # the MoE block's input, then every (up, down)
        module = layer.get_submodule(prev)
        scales = torch.rand(module.weight.shape[0], generator=generator) + 0.5
        fold_scales(module.weight, None, [layer.get_submodule(n).weight for n in linears], scales)
    for ours, theirs in zip(run_layer(layer, inputs), reference):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)

    for name, p in layer.named_parameters():  # the control: the norm's scales without the router's
        p.data.copy_(saved[name])
    norm, linears = wiring.smoothing[1]
    scales = torch.rand(64, generator=generator) + 0.5
    fold_scales(layer.get_submodule(norm).weight, None, [layer.get_submodule(n).weight for n in linears if n not in gates], scales)
    assert not torch.allclose(run_layer(layer, inputs)[0], reference[0], rtol=1e-3, atol=1e-4)
