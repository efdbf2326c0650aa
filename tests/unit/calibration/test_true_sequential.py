"""GPTQ's one-pass staged layer: the staged computation is the layer's own forward, stage by stage."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.calibration import calibrate, true_sequential
from quantkit.calibration.hooks import capture_inputs, run_layer
from quantkit.calibration.steps.gptq import can_stage
from quantkit.models.architectures import LLAMA, find_wiring
from quantkit.models.loading import decoder_layers
from quantkit.quant.plan import plan_model
from quantkit.grids import fake_quantize_weight
from quantkit.quant.registry import resolve

ARCHITECTURES = ["llama", "qwen2", "mistral"]


def _model(model_type: str):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                  max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config).eval()


def _inputs(model):
    ids = torch.randint(0, 300, (6, 16), generator=torch.Generator().manual_seed(0))
    layers = decoder_layers(model)
    return layers, capture_inputs(model, layers, list(ids.split(3)), torch.device("cpu"))


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_staged_pass_is_the_layers_forward(arch, hold):
    model = _model(arch)
    layers, inputs = _inputs(model)
    calls = [true_sequential.split_call(a, k) for a, k in inputs]
    assert find_wiring(layers[0]) is LLAMA and true_sequential.matches_layer(layers[0], LLAMA, calls[0])
    assert can_stage(layers[0], inputs)
    staged = true_sequential.run_stages(layers[0], LLAMA, calls, lambda stage, xs: None, hold)
    for ours, reference in zip(staged, run_layer(layers[0], inputs)):
        assert torch.equal(ours, reference)


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_stage_is_quantized_before_the_next_one_runs(arch, hold):
    """The staged outputs equal the fully quantized layer's forward: every stage's inputs were computed with the
    stages before it already quantized (a wrong order would leave float upstream in the outputs)."""
    model = _model(arch)
    layers, inputs = _inputs(model)
    layer, spec = layers[0], resolve("int8-weight-only").scheme.weights
    seen = []

    def quantize(stage, xs):
        seen.append((stage, len(list(xs))))
        for name in stage:
            module = layer.get_submodule(name)
            module.weight.data = fake_quantize_weight(module.weight.data, spec)

    staged = true_sequential.run_stages(layer, LLAMA, [true_sequential.split_call(a, k) for a, k in inputs], quantize, hold)
    assert [s for s, _ in seen] == list(LLAMA.stages) and all(n == len(inputs) for _, n in seen)
    for ours, reference in zip(staged, run_layer(layer, inputs)):
        assert torch.equal(ours, reference)


def test_a_stages_inputs_come_one_batch_at_a_time():
    """A stage's inputs are computed as they are reached and none is held after its turn: the down projection's
    (2.75x the hidden states) are never all in memory at once."""
    import weakref

    model = _model("llama")
    layers, inputs = _inputs(model)
    assert len(inputs) >= 2
    alive = {}

    def quantize(stage, xs):
        assert not isinstance(xs, (list, tuple)), stage
        refs = []
        for x in xs:
            refs.append(weakref.ref(x))
            del x
            alive[stage] = sum(ref() is not None for ref in refs)

    true_sequential.run_stages(layers[0], LLAMA, [true_sequential.split_call(a, k) for a, k in inputs], quantize,
                               hold=False)
    assert alive and all(count == 0 for count in alive.values()), alive


def test_a_layer_the_stages_do_not_reproduce_falls_back_to_two_passes():
    model = _model("llama")
    layer_class = type(decoder_layers(model)[0])

    class Scaled(layer_class):  # a different forward with the same parts: the staged pass would be wrong
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            return out * 0.5 if isinstance(out, torch.Tensor) else (out[0] * 0.5, *out[1:])

    for layer in decoder_layers(model):
        layer.__class__ = Scaled
    layers, inputs = _inputs(model)
    recipe = resolve("gptq-w4a16")
    assert not can_stage(layers[0], inputs)
    plan = plan_model(model, recipe)
    samples = torch.randint(0, 300, (6, 16), generator=torch.Generator().manual_seed(0))
    result = calibrate(model, plan, recipe, samples, torch.device("cpu"), batch_size=3)
    assert not result.true_sequential and result.seconds["propagate"] > 0
    assert result.qweights  # quantized all the same, the two-pass way


def test_gptq_computes_the_same_qparams_whether_stage_inputs_are_held_or_recomputed(monkeypatch):
    """The GPU's way (inputs recomputed batch by batch) and the CPU's (held) give the same integers and scales."""
    from quantkit.runtime import placement

    recipe = resolve("gptq-w4a16")
    samples = torch.randint(0, 300, (6, 16), generator=torch.Generator().manual_seed(1))
    found = {}
    for hold in (True, False):
        monkeypatch.setattr(placement, "holds_stage_inputs", lambda device, held_bytes=0, hold=hold: hold)
        model = _model("llama")
        result = calibrate(model, plan_model(model, recipe), recipe, samples, torch.device("cpu"), batch_size=3)
        assert result.true_sequential and result.stage_inputs_held is hold
        found[hold] = result.qweights
    assert found[True].keys() == found[False].keys()
    for name, held in found[True].items():
        again = found[False][name]
        assert torch.equal(held.qdata, again.qdata) and torch.equal(held.scale, again.scale), name


@pytest.mark.parametrize("hold", [True, False])
def test_in_place_the_residual_stream_is_built_in_the_inputs_with_the_same_outputs(hold):
    """`in_place`: the layer's outputs are its input tensors, updated (one copy of the hidden states less), and equal
    to the outputs of the pass that keeps its inputs."""
    model = _model("llama")
    layers, inputs = _inputs(model)
    calls = [true_sequential.split_call(a, k) for a, k in inputs]
    expected = true_sequential.run_stages(layers[0], LLAMA, calls, lambda stage, xs: None, hold)
    before = [h.clone() for h, _ in calls]
    assert all(torch.equal(h, b) for (h, _), b in zip(calls, before))  # the pass that keeps them left them alone
    staged = true_sequential.run_stages(layers[0], LLAMA, calls, lambda stage, xs: None, hold, in_place=True)
    for ours, reference, (h, _), b in zip(staged, expected, calls, before):
        assert torch.equal(ours, reference)
        assert ours.data_ptr() == h.data_ptr() and not torch.equal(h, b)


@pytest.mark.parametrize("hold", [True, False])
def test_the_down_projections_inputs_come_a_few_rows_at_a_time_with_the_same_outputs(hold, monkeypatch):
    """The MLP's pass up to the down projection's input runs on ROW_CHUNK_BYTES of it at once, not on a whole batch:
    the down stage sees one input per chunk of rows, and the layer's outputs are the same, in place too."""
    model = _model("llama")
    layers, inputs = _inputs(model)
    calls = [true_sequential.split_call(a, k) for a, k in inputs]
    expected = true_sequential.run_stages(layers[0], LLAMA, calls, lambda stage, xs: None, hold)
    monkeypatch.setattr(true_sequential, "ROW_CHUNK_BYTES", 1)  # one row a chunk
    seen = {}

    def quantize(stage, xs):
        seen[stage] = [x.shape for x in xs]

    staged = true_sequential.run_stages(layers[0], LLAMA, calls, quantize, hold, in_place=True)
    rows = sum(h.shape[0] for h, _ in calls)
    assert seen[LLAMA.stages[3]] == [torch.Size([1, 16, 128])] * rows  # the down projection's: 6 rows of 16 tokens
    assert len(seen[LLAMA.stages[2]]) == len(calls)  # the other stages: a batch at a time
    for ours, reference, (h, _) in zip(staged, expected, calls):
        assert torch.equal(ours, reference) and ours.data_ptr() == h.data_ptr()


@pytest.mark.parametrize("offloaded", [False, True])
def test_gptq_gives_the_same_qparams_and_outputs_with_the_down_inputs_in_chunks_of_rows(offloaded, monkeypatch):
    recipe = resolve("gptq-w4a16")
    samples = torch.randint(0, 300, (6, 16), generator=torch.Generator().manual_seed(2))
    found = {}
    for chunk in (true_sequential.ROW_CHUNK_BYTES, 1):
        monkeypatch.setattr(true_sequential, "ROW_CHUNK_BYTES", chunk)
        model = _model("llama")
        result = calibrate(model, plan_model(model, recipe), recipe, samples, torch.device("cpu"), batch_size=3,
                           offloaded=offloaded)
        assert result.true_sequential
        found[chunk] = result.qweights
    whole, chunked = found.values()
    assert whole.keys() == chunked.keys() and any(".down_proj" in name for name in whole)
    for name, qweight in whole.items():
        assert torch.equal(qweight.qdata, chunked[name].qdata) and torch.equal(qweight.scale, chunked[name].scale), name
