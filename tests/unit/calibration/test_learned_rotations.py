"""Learned rotations (SpinQuant): the weights learning computes with are the ones `rotate_model` fuses, on every
layout; learning lowers the quantized model's loss, keeps the float function, leaves the model as it found it
(unrotated, plain Linears, on the CPU), and ranks learn the same matrices."""

import dataclasses
from functools import partial

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from forked_ranks import on_ranks
from quantkit.algorithms import hadamard
from quantkit.calibration import learned_rotations
from quantkit.calibration.learned_rotations import RotatedWeights, learn_rotations
from quantkit.models import moe
from quantkit.models.tiny import TINY_LLAMA
from quantkit.quant.plan import plan_model
from quantkit.quant.registry import Learning, Transform, TransformType, resolve
from quantkit.quant.rotations import Rotator

LAYOUTS = {"llama": {}, "qwen2": {}, "gemma": {"head_dim": 16}, "phi3": {"pad_token_id": 0},
           "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1}}


def _model(model_type: str = "llama", **extra):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**TINY_LLAMA, **extra})
    model = moe.linearize(AutoModelForCausalLM.from_config(config).float().eval())
    with torch.no_grad():  # norms that are not all ones, biases that are not zero, and an outlier channel
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
        model.get_input_embeddings().weight[:, 3] *= 30
    return model


def _recipe(name: str = "quarot-w4a8", steps: int = 10, rotations=("R1", "R2"), rate: float = 1.5):
    learned = Transform(TransformType.RANDOM_HADAMARD, rotations, seed=2, learn=Learning(steps, rate))
    return dataclasses.replace(resolve(name), transforms=(learned,))


def _ids(model, shape=(2, 24), seed=1):
    return torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", LAYOUTS)
def test_the_weights_learning_computes_with_are_the_ones_rotate_model_fuses(model_type):
    """Through `functional_call`, with any orthogonal R1 and per-layer R2s, the folded model computes what the same
    matrices fused in place compute (v_proj's biases in Qwen2, Gemma's norm offsets, Phi-3's fused qkv rows,
    Mixtral's experts and router)."""
    model = _model(model_type, **LAYOUTS[model_type])
    recipe = _recipe()
    rotator = Rotator.of(recipe, model.config)
    rotator.fold(model)
    layers = model.config.num_hidden_layers
    q, _ = torch.linalg.qr(torch.randn(rotator.hidden, rotator.hidden, dtype=torch.float64))
    r2 = torch.stack([torch.linalg.qr(torch.randn(rotator.head_dim, rotator.head_dim, dtype=torch.float64))[0]
                      for _ in range(layers)])
    ids = _ids(model)
    with torch.no_grad():
        learning = torch.func.functional_call(model, RotatedWeights(model, rotator)(q.float(), r2.float()), (ids,)).logits
        rotator.learned(q, list(r2), {})
        rotator.rotate_model(model)
        fused = model(ids).logits
    torch.testing.assert_close(learning, fused, rtol=1e-4, atol=1e-4)


def test_learning_lowers_the_quantized_loss_and_keeps_the_float_function():
    """One batch, seen at every step: its fake-quantized loss falls; the float model computes what it computed,
    with the learned matrices fused; the model is handed back unrotated, with plain Linears and its gradient flags."""
    model = _model()
    ids = _ids(model)
    with torch.no_grad():
        before = model(ids).logits
    recipe = _recipe(steps=15, rate=0.5)
    rotator = Rotator.of(recipe, model.config)
    samples = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(2))
    summary = learn_rotations(model, rotator, plan_model(model, recipe), recipe, samples, torch.device("cpu"), batch_size=4)
    assert summary["loss_last_steps"] < summary["loss_first_steps"]
    assert summary["steps"] == 15 and rotator.learning is None and rotator.learned_summary == summary
    assert summary["passes_over_samples"] == 15  # one batch of all 4 samples, 15 times
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n.endswith("proj"))
    assert all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-4)  # folded, not rotated
    start = hadamard.random_hadamard_matrix(rotator.hidden, 2)
    assert not torch.allclose(rotator.r1, start, atol=1e-3)  # it moved
    torch.testing.assert_close(rotator.r1.T @ rotator.r1, torch.eye(rotator.hidden, dtype=torch.float64), rtol=0, atol=1e-10)
    assert len(rotator.r2_per_layer) == model.config.num_hidden_layers
    rotator.rotate_model(model)
    with torch.no_grad():
        after = model(ids).logits
    assert (after - before).abs().max() <= 1e-5 * before.abs().max()


def test_for_gptq_with_quantized_activations_the_weights_stay_float_while_learning(monkeypatch):
    """GPTQ rounds the weights its own way afterwards: with quantized activations learning sees the weights float
    (SpinQuant's choice); weight-only, it sees them rounded to nearest (else nothing would depend on the rotation)."""
    seen = []
    original = learned_rotations._loss_and_gradients

    def spy(model, *args):
        from quantkit.quant import fake_quant

        seen.extend((m.weight_fake_quantizer.enabled, m.activation_fake_quantizer is not None)
                    for m in model.modules() if isinstance(m, fake_quant.QATLinear))
        return original(model, *args)

    monkeypatch.setattr(learned_rotations, "_loss_and_gradients", spy)
    cases = {"quarot-w4a8": (True, True), "smoothquant-w8a8": (False, True), "spinquant-gptq-w4a16": (True, False)}
    for name, (weights_quantized, activations_quantized) in cases.items():
        seen.clear()
        model = _model()
        recipe = _recipe(name, steps=1)
        learn_rotations(model, Rotator.of(recipe, model.config), plan_model(model, recipe), recipe,
                        _ids(model, (2, 16)), torch.device("cpu"))
        assert seen and {enabled for enabled, _ in seen} == {weights_quantized}, name
        assert {acts for _, acts in seen} == {activations_quantized}, name


def test_learned_matrices_survive_a_save_and_restore(tmp_path):
    model = _model()
    recipe = _recipe(steps=2)
    rotator = Rotator.of(recipe, model.config)
    learn_rotations(model, rotator, plan_model(model, recipe), recipe, _ids(model, (2, 16)), torch.device("cpu"))
    learned_rotations.save(tmp_path / "learned.safetensors", rotator)
    restored = Rotator.of(recipe, model.config)
    learned_rotations.restore(tmp_path / "learned.safetensors", restored)
    assert torch.equal(restored.r1, rotator.r1) and restored.learning is None
    assert all(torch.equal(a, b) for a, b in zip(restored.r2_per_layer, rotator.r2_per_layer))
    assert restored.learned_summary == {**rotator.learned_summary, "restored": True}


def _learn_on_rank(ctx, steps: int):
    torch.manual_seed(0)
    model = _model()
    recipe = _recipe(steps=steps, rate=0.02)  # below the step cap: a gradient summed wrongly would move R differently
    rotator = Rotator.of(recipe, model.config)
    samples = torch.randint(0, model.config.vocab_size, (6, 16), generator=torch.Generator().manual_seed(3))
    learn_rotations(model, rotator, plan_model(model, recipe), recipe, samples, torch.device("cpu"), batch_size=3, ctx=ctx)
    return {"R1": rotator.r1, "R2": torch.stack(rotator.r2_per_layer)}


def test_ranks_learn_the_same_matrices_as_one_process(tmp_path):
    """Each rank computes its share of every batch (3 samples: 2 and 1), the gradients are summed: both ranks end
    with identical matrices, and with one process's up to float summation order (which can flip a rounding of the
    fake-quantized activations, so not bit for bit)."""
    ranks = on_ranks(2, partial(_learn_on_rank, steps=4), tmp_path, start="spawn")
    assert torch.equal(ranks[0]["R1"], ranks[1]["R1"]) and torch.equal(ranks[0]["R2"], ranks[1]["R2"])
    alone = _learn_on_rank(None, steps=4)
    torch.testing.assert_close(ranks[0]["R1"], alone["R1"], rtol=0, atol=1e-5)
    torch.testing.assert_close(ranks[0]["R2"], alone["R2"], rtol=0, atol=1e-5)


def test_a_loss_that_is_not_finite_stops_learning_in_one_line(monkeypatch):
    from quantkit.errors import CalibrationError

    model = _model()
    with torch.no_grad():
        model.get_submodule("model.layers.0.mlp.down_proj").weight[0, 0] = float("inf")
    recipe = _recipe(steps=3)
    with pytest.raises(CalibrationError, match="not finite at step 1 .*--dtype float32"):
        learn_rotations(model, Rotator.of(recipe, model.config), plan_model(model, recipe), recipe, _ids(model, (2, 16)),
                        torch.device("cpu"))
