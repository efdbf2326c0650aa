"""The device rule (`quantkit.runtime.placement`): what reaches a writer is on the CPU, or the writer names what is not.

A CPU-only machine has no second real device; the meta device stands in for a GPU: a tensor there is one the
writer must refuse (today's bug on CUDA was scales left on the GPU reaching compressed-tensors' packing)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantkit.calibration.layer import CalibrationResult
from quantkit.grids import quantize_weight
from quantkit.grids.qparams import QuantizedWeight
from quantkit.grids.schemes import Granularity, QDtype, WeightSpec
from quantkit.runtime import placement


def _spec() -> WeightSpec:
    return WeightSpec(dtype=QDtype.INT4, granularity=Granularity.GROUP, group_size=32)


def test_to_host_moves_every_tensor_of_a_quantized_weight_and_keeps_host_tensors_as_they_are():
    qweight = quantize_weight(torch.randn(8, 64), _spec())
    moved = placement.to_host({"a": [qweight, (torch.ones(2),)], "b": 3})
    assert isinstance(moved["a"][0], QuantizedWeight) and moved["a"][0].qdata is qweight.qdata  # on the CPU already
    assert moved["b"] == 3 and isinstance(moved["a"][1], tuple)


def test_a_writer_handed_a_tensor_off_the_cpu_names_it():
    qweight = quantize_weight(torch.randn(8, 64), _spec())
    off = QuantizedWeight(qweight.qdata, qweight.scale.to("meta"), None, qweight.spec)
    with pytest.raises(placement.PlacementError, match=r"qparams\[model.layers.0.mlp.up_proj\].scale on meta"):
        placement.check_on_host("the writer", qparams={"model.layers.0.mlp.up_proj": off.qparams})
    with pytest.raises(placement.PlacementError, match=r"modules\[0\].weight on meta"):
        placement.check_on_host("the writer", modules=[nn.Linear(4, 4, device="meta")])
    placement.check_on_host("the writer", qparams={"x": qweight.qparams}, modules=[nn.Linear(4, 4)])


def test_the_compressed_tensors_writer_refuses_scales_off_the_cpu(tiny_model_dir, tmp_path):
    """The stream writer's boundary check, on the tiny model's first layer with one scale on the meta device."""
    from quantkit.export.compressed_tensors import StreamWriter
    from quantkit.models.loading import load_model
    from quantkit.quant import registry
    from quantkit.quant.plan import plan_model

    recipe = registry.resolve("int4-weight-only")
    model = load_model(tiny_model_dir)
    plan = plan_model(model, recipe)
    layer = model.model.layers[0]
    entries = [e for e in plan if e.quantized and e.name.startswith("model.layers.0.")]
    names = [e.name for e in entries]
    qparams = {e.name: quantize_weight(model.get_submodule(e.name).weight.data, e.scheme.weights).qparams for e in entries}
    qparams[names[0]].scale = qparams[names[0]].scale.to("meta")
    writer = StreamWriter(model, plan, recipe, tmp_path / "out")
    with pytest.raises(placement.PlacementError, match=f"{names[0]}].scale on meta"):
        writer.add([layer], qparams, {})


def test_offload_layer_puts_the_layer_and_its_results_on_the_cpu_and_leaves_other_layers_alone():
    layer = nn.Linear(4, 4)
    result = CalibrationResult()
    mine, other = quantize_weight(torch.randn(8, 64), _spec()), quantize_weight(torch.randn(8, 64), _spec())
    result.qweights.update({"m.layers.1.up": mine, "m.layers.10.up": other})
    result.input_scales["m.layers.1.up"] = torch.ones(1)
    placement.offload_layer(layer, "m.layers.1", result)
    assert result.qweights["m.layers.10.up"] is other  # "m.layers.1." is not a prefix of layer 10's names
    assert result.qweights["m.layers.1.up"] is not mine and torch.equal(result.qweights["m.layers.1.up"].scale, mine.scale)
    placement.check_on_host("test", layer=layer, qweights=result.qweights, input_scales=result.input_scales)


def test_compute_device_is_the_ranks_own_gpu_under_torchrun(monkeypatch):
    from quantkit.runtime.distributed import Context

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert placement.compute_device("cuda") == torch.device("cuda", 0)  # what a tensor there reports: comparable

    ctx = Context(rank=1, world_size=2, local_rank=1, device=torch.device("cuda", 1))
    assert placement.compute_device("cuda", ctx) == torch.device("cuda", 1)
    assert placement.compute_device("cpu", ctx) == torch.device("cpu")
    assert placement.compute_device("cuda:0", None) == torch.device("cuda", 0)
    one = Context(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0), grouped=True)
    assert placement.compute_device("cuda", one) == torch.device("cuda", 0)


def test_layers_are_written_in_the_background_on_a_gpu_only(monkeypatch):
    from quantkit.runtime.placement import holds_stage_inputs, overlaps_io

    monkeypatch.delenv("QUANTKIT_OVERLAP_IO", raising=False)
    assert overlaps_io(torch.device("cuda", 0)) and not overlaps_io(torch.device("cpu"))
    monkeypatch.setenv("QUANTKIT_OVERLAP_IO", "0")
    assert not overlaps_io(torch.device("cuda", 0))
    assert holds_stage_inputs(torch.device("cpu")) and not holds_stage_inputs(torch.device("cuda", 0))


def test_stage_inputs_are_held_on_the_cpu_where_they_take_at_most_a_share_of_its_memory(monkeypatch):
    from quantkit.runtime import memory, placement

    monkeypatch.setattr(memory, "physical_bytes", lambda: 24 << 30)
    cpu = torch.device("cpu")
    assert placement.holds_stage_inputs(cpu, 7 << 30)  # Llama-3.1-8B's down_proj inputs, 128 x 2048 tokens
    assert placement.holds_stage_inputs(cpu, 8 << 30) and not placement.holds_stage_inputs(cpu, 9 << 30)  # a third
    monkeypatch.setattr(memory, "physical_bytes", lambda: 16 << 30)
    assert not placement.holds_stage_inputs(cpu, 7 << 30)
    monkeypatch.setattr(memory, "physical_bytes", lambda: None)  # unknown: held, as before
    assert placement.holds_stage_inputs(cpu, 9 << 30)
