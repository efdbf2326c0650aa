"""The pipeline's plan of layer steps, checked before any weight moves, and what a layer's turn does with its inputs:
the last pass over them (or GPTQ's staged pass) consumes them, dropping the resume checkpoint that references them."""

import pytest

from quantkit.calibration.pipeline import layer_steps
from quantkit.calibration.steps.static_scales import static_scales_step
from quantkit.errors import RecipeError
from quantkit.quant import registry


def _recipe(tmp_path, algorithm: str, activations: str = ""):
    path = tmp_path / "r.yaml"
    path.write_text(f"scheme: {{weights: {{dtype: int8, granularity: channel}}{activations}}}\n"
                    f"format: compressed-tensors\nalgorithm: {algorithm}")
    return registry.resolve(str(path))


def test_transforms_then_static_scales_then_the_quantizer(tmp_path):
    recipe = _recipe(tmp_path, "[{name: smoothquant}, {name: rtn}]", ", activations: {dtype: int8, dynamic: false}")
    steps = layer_steps(recipe)
    assert len(steps) == 3 and steps[1] is static_scales_step


def test_dynamic_activations_need_no_static_scales():
    steps = layer_steps(registry.resolve("gptq-w4a16"))
    assert len(steps) == 1 and static_scales_step not in steps


def test_gptq_with_static_scales_is_refused_when_the_recipe_is_read(tmp_path):
    """GPTQ's own refusal (`Algorithm.refusal`), decided from the recipe before anything runs."""
    with pytest.raises(RecipeError, match="algorithm: GPTQ with calibrated activation scales"):
        _recipe(tmp_path, "{name: gptq}", ", activations: {dtype: int8, dynamic: false}")


def _layer_with(outputs_error: float):
    from torch import nn

    from quantkit.calibration.layer import CalibrationResult, Layer
    from quantkit.quant.plan import ModulePlan

    module = nn.Sequential(nn.Linear(4, 4))
    recipe = registry.resolve("gptq-w4a16")
    plan = {"m.0": ModulePlan("m.0", 4, 4, recipe.scheme)}
    result = CalibrationResult(errors={"m.0": outputs_error})
    return Layer(module, "m", 0, [], plan, recipe, result)


def test_a_layer_with_non_finite_outputs_stops_the_run_naming_it():
    import torch

    from quantkit.calibration.pipeline import check_layer
    from quantkit.errors import CalibrationError

    layer = _layer_with(0.1)
    check_layer(layer, [torch.ones(2, 3)])
    with pytest.raises(CalibrationError, match=r"decoder layer m gives non-finite outputs .*\(1 of 6 values\)"):
        check_layer(layer, [torch.tensor([[1.0, float("nan"), 1.0], [1.0, 1.0, 1.0]])])


@pytest.mark.parametrize("error", [1.5, float("nan")])
def test_a_module_whose_error_is_as_large_as_its_output_stops_the_run(error):
    import torch

    from quantkit.calibration.pipeline import check_layer
    from quantkit.errors import CalibrationError

    with pytest.raises(CalibrationError, match="m.0: relative output error"):
        check_layer(_layer_with(error), [torch.ones(2, 3)])


def _tiny_llama_inputs():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.calibration.hooks import capture_inputs
    from quantkit.models.loading import decoder_layers

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config).eval()
    layers = decoder_layers(model)
    ids = torch.randint(0, 300, (6, 16), generator=torch.Generator().manual_seed(0))
    return model, layers, capture_inputs(model, layers, list(ids.split(3)), torch.device("cpu"))


def test_the_propagation_frees_each_batchs_inputs_as_it_makes_its_outputs():
    """`run_layer_consuming`: the same outputs as `run_layer`, each call becoming the next layer's (its hidden states
    the output), and the inputs' hidden states gone once their outputs are made: one copy held, not two."""
    import gc
    import weakref

    import torch

    from quantkit.calibration.hooks import run_layer, run_layer_consuming

    _, layers, inputs = _tiny_llama_inputs()
    expected = run_layer(layers[0], inputs)
    gone = [weakref.ref(args[0]) for args, _ in inputs]
    kwargs_before = [kwargs for _, kwargs in inputs]
    outputs = run_layer_consuming(layers[0], inputs)
    gc.collect()
    assert all(ref() is None for ref in gone)
    for out, ref, (args, kwargs), before in zip(outputs, expected, inputs, kwargs_before):
        assert torch.equal(out, ref) and args[0] is out and kwargs is before


class _Pending:
    """A resume state whose held-back checkpoint references the layer's inputs."""

    def __init__(self):
        self.dropped = self.saved = 0

    def drop_pending(self):
        self.dropped += 1

    def save_layer(self, *args, **kwargs):
        self.saved += 1


@pytest.mark.parametrize("kv_cache", [None, "fp8"])
def test_after_awq_the_inputs_last_reader_consumes_them(kv_cache):
    """The propagation, or the KV cache step that makes the outputs, is the inputs' last reader: the held-back resume
    checkpoint is dropped, and the next layer's calls are the same list, its hidden states the outputs."""
    import torch

    from quantkit.calibration import pipeline
    from quantkit.calibration.layer import CalibrationResult
    from quantkit.quant.plan import plan_model

    recipe = registry.with_kv_cache(registry.resolve("awq-w4a16"), kv_cache)
    model, layers, inputs = _tiny_llama_inputs()
    plan = {e.name: e for e in plan_model(model, recipe)}
    pending, result = _Pending(), CalibrationResult()
    outputs, _ = pipeline._calibrate_one(0, layers[0], "model.layers.0", inputs, None, plan, recipe, result, None,
                                         pipeline.layer_steps(recipe), torch.device("cpu"), pending, 2)
    assert (result.seconds["propagate"] > 0) is (kv_cache is None) and (result.seconds["kv cache"] > 0) is bool(kv_cache)
    assert pending.dropped == 1 and pending.saved == 1
    assert all(args[0] is out for (args, _), out in zip(inputs, outputs))


@pytest.mark.parametrize("kv_cache, in_place", [(None, True), ("fp8", False)])
def test_gptq_overwrites_a_layers_inputs_only_when_no_later_step_reads_them(kv_cache, in_place):
    """GPTQ's staged pass takes the inputs (and the resume checkpoint that references them is dropped first) when
    the quantizer is the layer's last step; with KV cache scales computed after it, it leaves them as they were,
    and the KV cache step, their last reader, takes them."""
    import torch

    from quantkit.calibration import pipeline
    from quantkit.calibration.layer import CalibrationResult
    from quantkit.quant.plan import plan_model

    recipe = registry.with_kv_cache(registry.resolve("gptq-w4a16"), kv_cache)
    model, layers, inputs = _tiny_llama_inputs()
    plan = {e.name: e for e in plan_model(model, recipe)}
    originals = [a[0] for a, _ in inputs]
    before = [h.clone() for h in originals]
    pending, result = _Pending(), CalibrationResult()
    outputs, _ = pipeline._calibrate_one(0, layers[0], "model.layers.0", inputs, None, plan, recipe, result, None,
                                         pipeline.layer_steps(recipe), torch.device("cpu"), pending, 2)
    assert result.true_sequential and pending.saved == 1 and pending.dropped == 1
    kept = all(torch.equal(h, b) for h, b in zip(originals, before))
    assert kept is not in_place
    assert (outputs[0].data_ptr() == originals[0].data_ptr()) is in_place


def test_memory_outside_torchs_allocator_is_the_gpus_use_less_what_torch_reserved(monkeypatch):
    import torch

    from quantkit.calibration import pipeline

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))  # 10 GiB in use
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 7 * gib)
    assert pipeline.outside_allocator_bytes(torch.device("cuda")) == 3 * gib
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 11 * gib)  # read at another moment
    assert pipeline.outside_allocator_bytes(torch.device("cuda")) == 0
