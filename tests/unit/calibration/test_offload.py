"""Calibration hidden states kept in CPU memory (`calibration.offload`): the containers, and a calibration run with
them that gives the resident run's qparams bit for bit."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.calibration import calibrate, offload
from quantkit.errors import UsageError
from quantkit.quant.plan import plan_model
from quantkit.quant.registry import resolve

CPU = torch.device("cpu")


def test_host_batches_keep_copies_and_give_copies():
    batches = offload.HostBatches(CPU)
    source = torch.arange(6.0).reshape(2, 3)
    batches.append(source)
    source += 100  # a later in-place change of the computed tensor does not reach the kept copy
    read = batches[0]
    read += 1  # nor does a change of what was read
    assert torch.equal(batches[0], torch.arange(6.0).reshape(2, 3))
    assert len(batches) == 1 and [t.tolist() for t in batches] == [[[0, 1, 2], [3, 4, 5]]]


def test_host_calls_put_the_hidden_states_back_where_they_were():
    mask = torch.ones(2)
    calls = offload.HostCalls(CPU)
    calls.append(((torch.zeros(2, 3),), {"mask": mask}))
    calls.append(((), {"hidden_states": torch.ones(2, 3), "mask": mask}))
    (first_args, first_kwargs), (second_args, second_kwargs) = list(calls)
    assert torch.equal(first_args[0], torch.zeros(2, 3)) and first_kwargs["mask"] is mask
    assert second_args == () and torch.equal(second_kwargs["hidden_states"], torch.ones(2, 3))
    nxt = offload.HostBatches(CPU, [torch.full((2, 3), 7.0), torch.full((2, 3), 8.0)])
    moved = offload.with_hidden(calls, nxt)
    assert offload.is_offloaded(moved) and offload.hidden_states(moved) is nxt
    assert torch.equal(moved[1][1]["hidden_states"], torch.full((2, 3), 8.0))


def test_resident_groups_hold_every_batch_unless_offloaded(monkeypatch):
    resident = [((torch.zeros(4, 8),), {})] * 5
    assert offload.resident_groups(resident) == [range(5)]
    calls = offload.offload(resident, CPU)
    monkeypatch.setattr(offload, "GROUP_BYTES", 2 * 4 * 8 * 4)  # two batches of float32 hidden states
    assert offload.resident_groups(calls) == [range(0, 2), range(2, 4), range(4, 5)]


def _model():
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("name", ["gptq-w4a16", "awq-w4a16", "fp8-static", "int8-dynamic-act-int8-weight"])
def test_offloaded_calibration_gives_the_resident_qparams(name, monkeypatch):
    """Every layer step reads offloaded calls as it reads resident ones: GPTQ's staged pass, AWQ's grid (in
    groups of batches: GROUP_BYTES set to two batches), static scales, round to nearest."""
    monkeypatch.setattr(offload, "GROUP_BYTES", 2 * 3 * 16 * 64 * 4)
    recipe = resolve(name)
    samples = torch.randint(0, 300, (7, 16), generator=torch.Generator().manual_seed(0))
    found = {}
    for offloaded in (False, True):
        model = _model()
        result = calibrate(model, plan_model(model, recipe), recipe, samples, CPU, batch_size=3, offloaded=offloaded)
        found[offloaded] = (result, {n: p.detach().clone() for n, p in model.state_dict().items()})
    (resident, weights), (moved, weights_moved) = found[False], found[True]
    assert resident.qweights.keys() == moved.qweights.keys() and resident.qweights
    for key, q in resident.qweights.items():
        assert torch.equal(q.qdata, moved.qweights[key].qdata) and torch.equal(q.scale, moved.qweights[key].scale), key
    for key, scale in resident.input_scales.items():
        assert torch.equal(scale, moved.input_scales[key]), key
    for key, tensor in weights.items():  # AWQ's folded norms too
        assert torch.equal(tensor, weights_moved[key]), key


def test_autoround_is_not_offloaded():
    recipe = resolve("autoround-w4a16")
    model = _model()
    with pytest.raises(UsageError, match="float model's hidden states"):
        calibrate(model, plan_model(model, recipe), recipe, torch.zeros(2, 8, dtype=torch.long), CPU, offloaded=True)
