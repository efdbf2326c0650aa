"""Scales fold into the norm a layer's Linears really read, whatever its name, weight convention or bias, leaving
the float function unchanged (Gemma2: the MLP reads pre_feedforward_layernorm, and norms compute x * (1 + w);
Starcoder2: LayerNorms with a bias; an MoE block's router and gates read that norm too and take the scales with
the experts), and between two Linears only where the op between them lets them through."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.algorithms.methods.awq import AWQArgs
from quantkit.algorithms.methods.smoothquant import SmoothQuantArgs
from quantkit.algorithms.awq import fold_scales
from quantkit.calibration.hooks import capture_inputs, run_layer
from quantkit.calibration.layer import CalibrationResult, Layer
from quantkit.calibration.steps.awq import awq_step
from quantkit.calibration.steps.smoothquant import smoothquant_step
from quantkit.models.architectures import LLAMA, norm_weight_offset, scales_fold, traced_wiring
from quantkit.models.loading import decoder_layers
from quantkit.quant import registry
from quantkit.quant.plan import plan_model


def _model_and_inputs(model_type: str, **extra):
    from quantkit.models.moe import linearize

    torch.manual_seed(0)
    params = {**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300, pad_token_id=0), **extra}
    model = linearize(AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **params)).eval())
    for name, param in model.named_parameters():  # norms (and biases) away from their init, so a wrong fold shows
        if param.dim() == 1:
            param.data.uniform_(0.5, 1.5)
    layers = decoder_layers(model)
    ids = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    return model, capture_inputs(model, layers, list(ids.split(2)), torch.device("cpu"))


def _layer_and_inputs(model_type: str, **extra):
    model, inputs = _model_and_inputs(model_type, **extra)
    return decoder_layers(model)[0], inputs


@pytest.mark.parametrize("model_type, extra, mlp_norm, offset", [
    ("llama", {}, "post_attention_layernorm", 0.0),
    ("gemma2", {"head_dim": 16}, "pre_feedforward_layernorm", 1.0),
    ("starcoder2", {}, "post_attention_layernorm", 0.0),  # nn.LayerNorm: the scales fold into weight and bias
    ("cohere", {}, "input_layernorm", 0.0),  # attention and MLP in parallel, on one norm's output
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
        fold_scales(module.weight, getattr(module, "bias", None), [layer.get_submodule(n).weight for n in linears], scales, offset)
    for ours, theirs in zip(run_layer(layer, inputs), reference):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", ["starcoder2", "cohere"])
@pytest.mark.parametrize("recipe, step, args", [("awq-w4a16", awq_step, AWQArgs(grid=4)),
                                                 ("smoothquant-w8a8", smoothquant_step, SmoothQuantArgs())])
def test_the_steps_fold_keeping_the_layers_function(model_type, recipe, step, args):
    """Starcoder2's LayerNorms have a bias (set away from 0 here): a step that divided only the weight by the scales
    would change the layer. Cohere's attention and MLP read one norm: folding a scale for each into it would too."""
    model, inputs = _model_and_inputs(model_type)
    module = decoder_layers(model)[0]
    norms = [p for name, p in module.named_parameters() if "layernorm" in name]
    before = [p.detach().clone() for p in norms]
    reference = run_layer(module, inputs)
    plan = {e.name: e for e in plan_model(model, registry.resolve(recipe))}
    layer = Layer(module, "model.layers.0", 0, inputs, plan, registry.resolve(recipe), CalibrationResult())
    step(layer, args)
    assert norms and all(not torch.equal(p, b) for p, b in zip(norms, before))  # folded, into the biases too
    for ours, theirs in zip(run_layer(module, inputs), reference):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type, extra, folds", [
    ("llama", {}, True),  # down reads act(gate(x)) * up(x): channel-wise in up's output
    ("starcoder2", {}, False),  # c_proj reads gelu(c_fc(x))
    ("starcoder2", {"hidden_act": "relu"}, True),  # relu(s x) = s relu(x) for s > 0: probed, not named
])
def test_scales_fold_between_two_linears_only_through_a_channel_wise_op(model_type, extra, folds):
    layer, inputs = _layer_and_inputs(model_type, num_key_value_heads=4, **extra)  # no GQA: v feeds o whole
    wiring = traced_wiring(layer, inputs[0])
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    assert scales_fold(layer, inputs[0], wiring.v, (wiring.o,))
    assert scales_fold(layer, inputs[0], wiring.up, (wiring.down,)) is folds
    assert all(torch.equal(v, state[k]) for k, v in layer.state_dict().items())  # the probe leaves the weights


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
    from quantkit.models.moe import traced_moe_wiring

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
