"""The AutoRound step tunes toward the float model: its target is the float layer on the float model's hidden states
(`Layer.float_hidden`, which it hands on as the float layer's outputs), its inputs are the quantized stream, and with
`amp` its passes run in bfloat16 autocast only where the device multiplies bf16 natively."""

import copy
import functools
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.algorithms.methods.autoround import AutoRoundArgs
from quantkit.algorithms.autoround import Rounding, quantize
from quantkit.calibration.hooks import capture_inputs, hidden_states, run_layer, with_hidden
from quantkit.calibration.layer import CalibrationResult, Layer
from quantkit.calibration.steps.autoround import autoround_step
from quantkit.models.loading import decoder_layers
from quantkit.quant import registry
from quantkit.quant.plan import plan_model
from quantkit.runtime import precision

RECIPE = "autoround-w2a16"  # 2 bits: round-to-nearest leaves a large error to tune away


def _layer(float_hidden: bool):
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    model = AutoModelForCausalLM.from_config(config).eval()
    module = decoder_layers(model)[0]
    ids = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    inputs = capture_inputs(model, decoder_layers(model), list(ids.split(2)), torch.device("cpu"))
    # the float model's stream differs from the quantized one the layer reads (as after quantized layers)
    floats = [h + 0.5 * torch.randn_like(h) for h in hidden_states(inputs)] if float_hidden else None
    recipe = registry.resolve(RECIPE)
    plan = {e.name: e for e in plan_model(model, recipe)}
    return Layer(module, "model.layers.0", 0, inputs, plan, recipe, CalibrationResult(), None, floats)


def _mse(outputs, targets) -> float:
    per_sample = torch.cat([((o - t) ** 2).flatten(1).mean(1) for o, t in zip(outputs, targets)]).double()
    return per_sample.mean().item()


def test_targets_are_the_float_layer_on_the_float_models_hidden_states():
    layer = _layer(float_hidden=True)
    float_module = copy.deepcopy(layer.module)
    expected = run_layer(float_module, with_hidden(layer.inputs, layer.float_hidden))
    args = AutoRoundArgs(iters=3, amp=False)
    nearest = copy.deepcopy(layer.module)
    for name, linear in layer.linears.items():
        spec, weight = layer.plan[name].scheme.weights, linear.weight.data
        rtn = quantize(weight, Rounding.nearest(weight, spec), spec, args.full_range)
        nearest.get_submodule(name.removeprefix("model.layers.0.")).weight.data = rtn.dequantize()
    outputs = autoround_step(layer, args)
    for ours, theirs in zip(layer.float_hidden, expected):  # handed on: the next layer's float stream
        assert torch.equal(ours, theirs)
    summary = layer.result.tuning["model.layers.0"]
    # round-to-nearest's loss is the quantized layer, on the quantized stream, against the float model's output
    assert summary["loss_rtn"] == pytest.approx(_mse(run_layer(nearest, layer.inputs), expected), rel=1e-6)
    assert summary["loss_tuned"] == pytest.approx(_mse(outputs, expected), rel=1e-6)
    assert summary["loss_tuned"] < summary["loss_rtn"] and summary["compute"] == "float32"
    for ours, theirs in zip(outputs, run_layer(layer.module, layer.inputs)):  # the outputs: the quantized stream
        assert torch.equal(ours, theirs)


def test_without_a_float_stream_the_target_is_the_float_layer_on_the_layers_inputs():
    layer = _layer(float_hidden=False)
    expected = run_layer(copy.deepcopy(layer.module), layer.inputs)
    autoround_step(layer, AutoRoundArgs(iters=2, amp=False))
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(layer.float_hidden, expected))


@pytest.mark.parametrize("flags, compute", [(frozenset({"avx2", "fma"}), "float32"),
                                            (frozenset({"avx512f", "avx512_bf16"}), "bfloat16")])
def test_amp_runs_in_bfloat16_only_where_the_cpu_multiplies_it_natively(monkeypatch, flags, compute):
    monkeypatch.setattr(precision, "_cpu_flags", lambda: flags)
    layer = _layer(float_hidden=True)
    autocast = []
    real = torch.autocast

    def spy(*args, **kwargs):
        autocast.append(kwargs.get("enabled", True) and kwargs.get("dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "autocast", spy)
    autoround_step(layer, AutoRoundArgs(iters=2))
    summary = layer.result.tuning["model.layers.0"]
    assert summary["compute"] == compute and summary["loss_tuned"] <= summary["loss_rtn"]
    assert autocast and set(autocast) == {torch.bfloat16 if compute == "bfloat16" else False}


def test_amp_off_computes_in_the_model_dtype(monkeypatch):
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    layer = _layer(float_hidden=True)
    autoround_step(layer, AutoRoundArgs(iters=2, amp=False))
    assert layer.result.tuning["model.layers.0"]["compute"] == "float32"


def test_native_bf16_needs_known_cpu_flags(monkeypatch):
    monkeypatch.setattr(precision, "_cpu_flags", lambda: None)  # not x86 Linux: not known to be fast
    assert not precision.native_bf16(torch.device("cpu"))
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert precision.native_bf16(torch.device("cpu"))


def test_samples_are_dealt_out_only_when_their_other_arguments_are_the_same():
    """On several ranks each step's samples are dealt out over the ranks, every rank computing any sample from the
    first sample's other arguments: only right where every sample's are the same (equal-length samples, no padding)."""
    from quantkit.calibration.steps.autoround import _dealt, _row_call, _same_call

    layer = _layer(float_hidden=False)
    template = _row_call(layer.inputs[0], 0)
    assert all(_same_call(_row_call(call, r), template) for call in layer.inputs for r in range(2))
    args, kwargs = layer.inputs[1]
    padded = {**kwargs, "attention_mask": torch.zeros(2, 1, 12, 12)}
    padded["attention_mask"][1, :, :, :3] = float("-inf")  # the second sample padded: its mask differs
    assert _same_call(_row_call((args, padded), 0), _row_call((args, padded), 0))
    assert not _same_call(_row_call((args, padded), 1), _row_call((args, padded), 0))
    assert not _same_call(_row_call((args, padded), 0), template)  # a mask where the template has none
    three = [_dealt(SimpleNamespace(distributed=True, ctx=SimpleNamespace(rank=rank, world_size=3))) for rank in range(3)]
    assert [[p for p in range(8) if share.owner(p, [100 + p]) == share.rank] for share in three] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    alone = _dealt(SimpleNamespace(distributed=False))
    assert (alone.rank, alone.world_size) == (0, 1) and all(alone.owner(p, [p]) == 0 for p in range(3))


def test_a_pass_of_several_samples_gives_each_samples_own_loss():
    """The template call repeated for a pass of several samples gives each sample the loss its own pass gives it
    (the 4 samples, taken from 2 batches, in another order)."""
    from quantkit.calibration.steps.autoround import _every_sample, _every_sample_loss, _local

    layer = _layer(float_hidden=False)
    targets = run_layer(layer.module, layer.inputs)
    rows = [(b, r) for b in range(2) for r in range(2)]
    rows_of, template = _every_sample(layer, rows, targets, 0, 4)
    loss = _every_sample_loss(layer, rows_of, template, amp=False)
    fake = {name: (m.weight.data + 0.01).requires_grad_() for name, m in layer.linears.items()}
    together = loss(fake, [3, 0, 2])
    alone = torch.cat([loss(fake, [s]) for s in (3, 0, 2)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-9)
    assert torch.equal(rows_of([3, 0])[0], torch.cat([hidden_states(layer.inputs)[1][1:], hidden_states(layer.inputs)[0][:1]]))
    assert _local(layer, fake).keys() <= dict(layer.module.named_parameters()).keys()


@pytest.mark.parametrize("per_pass", [1, 2])
def test_the_summary_says_how_many_samples_a_pass_took(per_pass):
    layer = _layer(float_hidden=True)
    autoround_step(layer, AutoRoundArgs(iters=2, amp=False, batch_size=4, samples_per_pass=per_pass))
    summary = layer.result.tuning["model.layers.0"]
    assert summary["samples_per_pass"] == per_pass and summary["split"] == "one process"


def test_samples_whose_other_arguments_differ_take_a_pass_each():
    layer = _layer(float_hidden=True)
    for b, (args, kwargs) in enumerate(layer.inputs):
        mask = torch.zeros(2, 1, 12, 12)
        mask[1, :, :, : b + 1] = float("-inf")  # padded samples: every mask differs
        layer.inputs[b] = (args, {**kwargs, "attention_mask": mask})
    autoround_step(layer, AutoRoundArgs(iters=2, amp=False, batch_size=4, samples_per_pass=4))
    assert layer.result.tuning["model.layers.0"]["samples_per_pass"] == 1


def _padded(layer):
    """The layer's samples padded differently (each mask its own): AutoRound runs them where they are held."""
    for b, (args, kwargs) in enumerate(layer.inputs):
        mask = torch.zeros(2, 1, 12, 12)
        mask[1, :, :, : b + 1] = float("-inf")
        layer.inputs[b] = (args, {**kwargs, "attention_mask": mask})
    return layer


@pytest.mark.parametrize("padded", [False, True], ids=["dealt", "held"])
def test_two_gloo_ranks_tune_what_one_process_tunes(tmp_path, padded):
    """The step on 2 forked gloo ranks, each holding one of the 2 batches: the passes (dealt out, or run where their
    samples are held) are gathered onto both ranks and added up in pass order, so each rank's outputs are the
    one-process outputs of its batch, bit for bit, and the summaries agree."""
    from forked_ranks import on_ranks
    from same_threads import pinned

    args = AutoRoundArgs(iters=3, amp=False, batch_size=4, samples_per_pass=2)
    with pinned():  # the ranks' thread count, for the layer's inputs and the tuning
        whole = _padded(_layer(float_hidden=True)) if padded else _layer(float_hidden=True)
        outputs = autoround_step(whole, args)

    ranks = on_ranks(2, functools.partial(_tuned_on_rank, padded=padded, args=args), tmp_path, start="spawn")
    summary = whole.result.tuning["model.layers.0"]
    for rank, result in enumerate(ranks):
        assert torch.equal(result["outputs"], outputs[rank])
        assert result["summary"].tolist() == [summary["loss_rtn"], summary["loss_tuned"], summary["best_step"],
                                              1 if padded else 2]


def _tuned_on_rank(ctx, padded: bool, args: AutoRoundArgs) -> dict:
    """A rank's share of `test_two_gloo_ranks_tune_what_one_process_tunes` (module level: spawned ranks unpickle it)."""
    layer = _padded(_layer(float_hidden=True)) if padded else _layer(float_hidden=True)
    layer.inputs, layer.float_hidden = layer.inputs[ctx.rank : ctx.rank + 1], layer.float_hidden[ctx.rank : ctx.rank + 1]
    layer.ctx = ctx
    mine = autoround_step(layer, args)
    keys = ("loss_rtn", "loss_tuned", "best_step", "samples_per_pass")
    return {"outputs": mine[0], "summary": torch.tensor([layer.result.tuning["model.layers.0"][k] for k in keys], dtype=torch.float64)}
