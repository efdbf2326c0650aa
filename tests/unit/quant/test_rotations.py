"""Fused rotations (R1, R2) leave the float model computing what it computed, on every architecture they take;
the others are refused before any weight is read, naming why."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.errors import UnsupportedModelError
from quantkit.models import moe
from quantkit.models.tiny import TINY_LLAMA
from quantkit.quant.registry import Transform, TransformType
from quantkit.quant.rotations import Rotator

R1_R2 = (Transform(TransformType.HADAMARD, ("R1", "R2")),)
TAKEN = {
    "llama": {}, "qwen2": {}, "mistral": {}, "qwen3": {"head_dim": 16}, "gemma": {"head_dim": 16},
    "phi3": {"pad_token_id": 0}, "granite": {"residual_multiplier": 0.5, "embedding_multiplier": 2.0},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
                  "shared_expert_intermediate_size": 64, "num_hidden_layers": 1},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 96, "head_dim": 16,
                  "num_hidden_layers": 1},
}
REFUSED = {
    "gemma2": ({"head_dim": 16}, "pre-norm"), "olmo2": ({"pad_token_id": 0}, "pre-norm"),
    "starcoder2": ({}, "RMS norms|pre-norm"),
}


def _model(model_type: str, seed: int = 0, **extra):
    config = AutoConfig.for_model(model_type, **{**TINY_LLAMA, **extra})
    torch.manual_seed(seed)
    model = moe.linearize(AutoModelForCausalLM.from_config(config).float().eval())
    with torch.no_grad():  # norms that are not all ones (nor all zeros, Gemma's offset), biases that are not zero
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


@pytest.mark.parametrize("model_type", TAKEN)
@pytest.mark.parametrize("kind", [TransformType.HADAMARD, TransformType.RANDOM_HADAMARD])
def test_rotations_keep_the_float_function(model_type, kind):
    model = _model(model_type, **TAKEN[model_type])
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    rotator = Rotator((Transform(kind, ("R1", "R2"), seed=3 if kind is TransformType.RANDOM_HADAMARD else 0),),
                      model.config)
    rotator.check(model)
    rotator.rotate_model(model)
    after = _logits(model, ids)
    assert (after - before).abs().max() <= 1e-5 * before.abs().max()
    moved = model.get_input_embeddings().weight  # the weights did change
    assert not torch.allclose(moved, _model(model_type, **TAKEN[model_type]).get_input_embeddings().weight)


def test_tied_embeddings_are_untied_and_keep_the_function():
    model = _model("llama", tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    before = _logits(model, ids)
    Rotator(R1_R2, model.config).rotate_model(model)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert model.config.tie_word_embeddings is False
    assert (_logits(model, ids) - before).abs().max() <= 1e-5 * before.abs().max()


def test_rotations_spread_an_outlier_channel():
    """What they are for: a residual channel 64x the others, after R1, is spread over all channels."""
    model = _model("llama")
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 5] *= 64
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    stream = lambda: model.get_input_embeddings()(ids).abs()  # noqa: E731
    peak_before = (stream().amax(-1) / stream().mean(-1)).mean()
    Rotator(R1_R2, model.config).rotate_model(model)
    assert (stream().amax(-1) / stream().mean(-1)).mean() < peak_before / 4


@pytest.mark.parametrize("model_type", REFUSED)
def test_layers_a_rotation_would_change_are_refused(model_type):
    extra, reason = REFUSED[model_type]
    model = _model(model_type, **extra)
    with pytest.raises(UnsupportedModelError, match=reason):
        Rotator(R1_R2, model.config).check(model)


def test_a_width_without_a_hadamard_matrix_is_refused_naming_it():
    config = AutoConfig.for_model("llama", **{**TINY_LLAMA, "hidden_size": 130, "num_attention_heads": 5,
                                              "num_key_value_heads": 5})
    with pytest.raises(UnsupportedModelError, match="hidden size \\(R1\\), 130"):
        Rotator(R1_R2, config)
