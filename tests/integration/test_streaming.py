"""Streamed finalize: the same files as loading the model whole, and a peak memory that does not grow with the
number of layers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_text
from quantkit.finalization.finalize import STREAMED, CalibrationOptions, finalize
from quantkit.quant.registry import resolve

pytestmark = pytest.mark.integration


def tensors(folder) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        found.update(load_file(file))
    return found


@pytest.mark.parametrize("recipe", ["int4-weight-only", "gptq-w4a16", "fp8-static", "quarot-w4a8-fp8", "spinquant-gptq-w4a16"])
def test_a_streamed_artifact_equals_the_in_memory_one(tiny_model_dir, text_file, tmp_path, recipe):
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    runs = {}
    for in_memory in (False, True):
        dst = tmp_path / ("whole" if in_memory else "streamed")
        runs[in_memory] = finalize(tiny_model_dir, dst, resolve(recipe), calibration=options, max_shard_size="60KB",
                                   in_memory=in_memory)
    assert runs[False].loading == STREAMED and runs[True].loading.startswith("whole model in memory")
    streamed, whole = tmp_path / "streamed", tmp_path / "whole"
    assert len(list(streamed.glob("*.safetensors"))) > 1 and (streamed / "model.safetensors.index.json").is_file()
    a, b = tensors(streamed), tensors(whole)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert json.loads((streamed / "config.json").read_text()) == json.loads((whole / "config.json").read_text())
    index = json.loads((streamed / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(a)


@pytest.mark.parametrize("recipe", ["gptq-w4a16", "awq-w4a16", "smoothquant-w8a8"])
def test_layers_written_in_the_background_give_the_same_artifact(tiny_model_dir, text_file, tmp_path, recipe, monkeypatch):
    """On a GPU each finished layer is packed and written in a worker thread while the next one calibrates
    (`placement.overlaps_io`, forced here on the CPU): the files are the ones written in line."""
    from quantkit.runtime import placement

    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    for background in (False, True):
        monkeypatch.setattr(placement, "overlaps_io", lambda device, background=background: background)
        finalize(tiny_model_dir, tmp_path / str(background), resolve(recipe), calibration=options, max_shard_size="60KB")
    a, b = tensors(tmp_path / "False"), tensors(tmp_path / "True")
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    for name in ("config.json", "model.safetensors.index.json"):
        assert (tmp_path / "False" / name).read_text() == (tmp_path / "True" / name).read_text()


def test_a_background_write_that_fails_stops_the_run_and_leaves_no_output(tiny_model_dir, text_file, tmp_path, monkeypatch):
    from quantkit.errors import ExportError
    from quantkit.export import compressed_tensors
    from quantkit.runtime import placement

    monkeypatch.setattr(placement, "overlaps_io", lambda device: True)
    calls = []
    original = compressed_tensors.StreamWriter.add

    def failing_add(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ExportError("disk full (a test)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(compressed_tensors.StreamWriter, "add", failing_add)
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    with pytest.raises(ExportError, match="disk full"):
        finalize(tiny_model_dir, tmp_path / "out", resolve("gptq-w4a16"), calibration=options)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # no output, no temporary directory, no resume state


def test_the_next_layer_is_read_ahead_while_one_calibrates(tiny_model_dir, text_file, tmp_path, monkeypatch):
    """With overlapped disk work (`placement.overlaps_io`, forced here on the CPU), every decoder layer after the
    first is read by the reader thread, started before the previous layer's turn ends."""
    import threading

    from quantkit.models.streaming import StreamedModel
    from quantkit.runtime import placement

    monkeypatch.setattr(placement, "overlaps_io", lambda device: True)
    readers, original = {}, StreamedModel.load

    def load(self, module):
        readers[self.names[module]] = threading.current_thread().name
        return original(self, module)

    monkeypatch.setattr(StreamedModel, "load", load)
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    finalize(tiny_model_dir, tmp_path / "out", resolve("gptq-w4a16"), calibration=options)
    layers = sorted(readers)
    assert len(layers) >= 2 and readers[layers[0]] == "MainThread"
    assert all(readers[name].startswith("quantkit-reader") for name in layers[1:])


def test_a_read_ahead_that_fails_stops_the_run_and_leaves_no_output(tiny_model_dir, text_file, tmp_path, monkeypatch):
    from quantkit.models.streaming import StreamedModel
    from quantkit.runtime import placement

    monkeypatch.setattr(placement, "overlaps_io", lambda device: True)
    original = StreamedModel.load

    def load(self, module):
        if self.names[module].endswith(".1"):
            raise OSError("read error (a test)")
        return original(self, module)

    monkeypatch.setattr(StreamedModel, "load", load)
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    with pytest.raises(OSError, match="read error"):
        finalize(tiny_model_dir, tmp_path / "out", resolve("gptq-w4a16"), calibration=options)
    assert [p.name for p in tmp_path.iterdir()] == ["out.partial"]  # no output; the first layer kept for --resume


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def moe_model_dir(request, tmp_path_factory):
    """A tiny MoE model: Mixtral's checkpoint names its block `block_sparse_moe` (the model's `mlp`); Qwen2-MoE
    has a shared expert and its gate."""
    from quantkit.models.tiny import build_tiny_model

    extra = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
             "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                               shared_expert_intermediate_size=64)}[request.param]
    return build_tiny_model(tmp_path_factory.mktemp("moe") / request.param, make_text(1500), request.param,
                            num_hidden_layers=2, max_shard_size="200KB", **extra)


@pytest.mark.parametrize("recipe", ["int4-weight-only", "gptq-w4a16"])
def test_a_streamed_moe_artifact_equals_the_in_memory_one(moe_model_dir, text_file, tmp_path, recipe):
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    runs = {in_memory: finalize(moe_model_dir, tmp_path / str(in_memory), resolve(recipe), calibration=options,
                                in_memory=in_memory) for in_memory in (False, True)}
    assert runs[False].loading == STREAMED
    a, b = tensors(tmp_path / "False"), tensors(tmp_path / "True")
    assert a.keys() == b.keys() and any(".experts.3." in key for key in a)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert json.loads((tmp_path / "False" / "config.json").read_text()) == json.loads((tmp_path / "True" / "config.json").read_text())


@pytest.fixture(scope="module")
def layered(tmp_path_factory):
    """The same Llama shape (hidden 512, float32: 13 MB a layer) with 4 and with 16 layers."""
    from quantkit.models.tiny import build_tiny_llama

    root = tmp_path_factory.mktemp("layered")
    text = make_text(2000)
    shape = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=8)
    return {n: build_tiny_llama(root / f"L{n}", text, num_hidden_layers=n, **shape) for n in (4, 16)}


def peak_ram(src, dst) -> int:
    """The peak resident size a `quantkit finalize` process reports (its VmHWM), in bytes."""
    cmd = [sys.executable, "-m", "quantkit.cli.main", "finalize", str(src), str(dst), "-q", "int4-weight-only", "--json", "-"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["loading"] == STREAMED
    return report["peak_ram_bytes"]


def test_peak_memory_does_not_grow_with_the_number_of_layers(layered, tmp_path):
    """Twelve more layers (161 MB of float32 weights) may cost less than three layers more peak memory: loading the
    model whole would cost all twelve. The peak is the highest of several runs: one run's peak falls up to 45 MiB below
    its steady value on a 2-core machine (an allocator's timing; measured 443 against 478-486 MiB, one run in four,
    for the 4-layer model), so the 4-layer model runs four times and the 16-layer one twice. The 16-layer peak is
    above the 4-layer one by 8-26 MiB (measured 480-500 against 472-485 MiB here, and 508 against 482 MiB in the
    lowest-versions CI run, which failed a two-layer margin of 26.0 MiB): less than two of its 13 MB layers, so
    no layer is held, but too close to a two-layer margin to gate on."""
    layer_bytes = (sum(f.stat().st_size for f in layered[16].glob("*.safetensors"))
                   - sum(f.stat().st_size for f in layered[4].glob("*.safetensors"))) / 12
    four, sixteen = (max(peak_ram(layered[n], tmp_path / f"{n}-{run}") for run in range(runs))
                     for n, runs in ((4, 4), (16, 2)))
    assert sixteen - four < 3 * layer_bytes, f"16 layers: {sixteen >> 20} MiB, 4 layers: {four >> 20} MiB"
