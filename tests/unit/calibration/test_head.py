"""lm_head, where a format quantizes it (GGUF's output, MLX): calibrated by the recipe's quantizer on its own inputs
(the final norm of the last decoder layer's outputs) when the quantizer can (GPTQ), else rounded to nearest; a tied
lm_head, which is the token embedding too, is rounded to nearest."""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.algorithms.rtn import rtn_quantize
from quantkit.calibration.pipeline import calibrate
from quantkit.quant import registry
from quantkit.quant.plan import plan_model

CPU = torch.device("cpu")


def _model(tied: bool):
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                  tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # a final norm that is not the identity, and rows of different scales: as trained models
        model.model.norm.weight.uniform_(0.5, 2.0)
        model.lm_head.weight.mul_(torch.linspace(0.2, 3.0, 64))
    return model


def _logits_error(model, quantized, samples) -> float:
    with torch.no_grad():
        reference, got = model(samples).logits, quantized(samples).logits
    return ((got - reference).norm() / reference.norm()).item()


def _calibrated(model, recipe_name: str, samples):
    recipe = registry.resolve(recipe_name)
    quantized = copy.deepcopy(model)
    result = calibrate(quantized, plan_model(quantized, recipe), recipe, samples, CPU, batch_size=4)
    return quantized, result


def test_gptq_calibrates_an_untied_lm_head_on_its_inputs():
    """The head's GPTQ weights give logits closer to the float model's, on the calibration text, than the same run
    with the head rounded to nearest on the same grid."""
    model = _model(tied=False)
    samples = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    quantized, result = _calibrated(model, "mlx-gptq-4bit-g64", samples)
    assert "lm_head" in result.qweights and result.seconds["head"] > 0
    nearest = rtn_quantize(model.lm_head.weight.data, registry.resolve("mlx-gptq-4bit-g64").scheme.weights)
    assert not torch.equal(result.qweights["lm_head"].dequantize(torch.float32), nearest.dequantize(torch.float32))
    rounded = copy.deepcopy(quantized)
    rounded.lm_head.weight.data = nearest.dequantize(torch.float32)
    assert _logits_error(model, quantized, samples) < 0.9 * _logits_error(model, rounded, samples)


@pytest.mark.parametrize("recipe_name", ["mlx-gptq-4bit-g64", "mlx-awq-4bit-g64"])
def test_a_tied_head_or_a_quantizer_that_cannot_calibrate_it_is_rounded_to_nearest(recipe_name):
    tied = recipe_name.startswith("mlx-gptq")
    model = _model(tied=tied)
    samples = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    weight = model.lm_head.weight.data.clone()
    _, result = _calibrated(model, recipe_name, samples)
    expected = rtn_quantize(weight, registry.resolve(recipe_name).scheme.weights)
    assert torch.equal(result.qweights["lm_head"].qdata, expected.qdata)
    assert torch.equal(result.qweights["lm_head"].scale, expected.scale)
