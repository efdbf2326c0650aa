"""Rotations (R1, R2 fused; R4 fused into the down projections with their inputs rotated online) leave the float
model computing what it computed, on every architecture they take; the others are refused before any weight is
read, naming why."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.errors import UnsupportedModelError
from quantkit.models import moe
from quantkit.models.tiny import TINY_LLAMA
from quantkit.quant.registry import Transform, TransformType
from quantkit.quant.rotations import ONLINE_ATTRIBUTE, Rotator

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


@pytest.mark.parametrize("model_type", TAKEN)
@pytest.mark.parametrize("kind", [TransformType.HADAMARD, TransformType.RANDOM_HADAMARD])
def test_an_online_r4_keeps_the_float_function(model_type, kind):
    """R4 with R1 and R2: every down projection (each MoE expert's, the shared expert's) holds W·Q and rotates its
    input by Q at run time; the logits are the float model's."""
    sizes = {"intermediate_size": 128} if kind is TransformType.HADAMARD else {}  # hadamard: powers of two only
    extra = {**TAKEN[model_type], **sizes}
    if kind is TransformType.HADAMARD and "moe_intermediate_size" in extra:
        extra["moe_intermediate_size"] = 64
    model = _model(model_type, **extra)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    seed = 5 if kind is TransformType.RANDOM_HADAMARD else 0
    rotator = Rotator((R1_R2[0], Transform(kind, ("R4",), seed=seed, online=True)), model.config)
    if "moe" in model_type or model_type == "mixtral":  # the math holds; the artifact's runtimes could not apply it
        with pytest.raises(UnsupportedModelError, match="R4 on MoE experts is not supported"):
            rotator.check(model)
    else:
        rotator.check(model)
    rotator.rotate_model(model)
    downs = [m for n, m in model.named_modules() if n.endswith(("down_proj", "w2"))]
    assert downs and all(getattr(m, ONLINE_ATTRIBUTE, None) is not None for m in downs)
    assert (_logits(model, ids) - before).abs().max() <= 1e-5 * before.abs().max()
    assert rotator.describe()["R4"] == "online"


def test_r4_spreads_an_outlier_in_the_down_projections_input():
    model = _model("llama", intermediate_size=128)
    down = model.model.layers[0].mlp.down_proj
    seen = []
    x = torch.randn(4, 128)
    x[:, 7] *= 64
    handle = down.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    Rotator((Transform(TransformType.HADAMARD, ("R4",), online=True),), model.config).rotate_model(model)
    handle.remove()
    down.register_forward_pre_hook(lambda m, args: seen.append(args[0]))  # after the rotation's hook
    down(x)
    peak = lambda t: (t.abs().amax(-1) / t.abs().mean(-1)).mean()  # noqa: E731
    assert peak(seen[-1]) < peak(x) / 4


def test_r4_of_type_hadamard_refuses_a_width_that_is_not_a_power_of_two():
    model = _model("llama")  # intermediate 176
    r4 = Transform(TransformType.HADAMARD, ("R4",), online=True)
    with pytest.raises(UnsupportedModelError, match="input is 176 wide: use type: random-hadamard"):
        Rotator((r4,), model.config).check(model)


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
