"""A model streamed from its safetensors files: the same model as `from_pretrained`, one layer in memory at a time."""

from __future__ import annotations

import pytest
import torch

from conftest import make_text
from quantkit.models import loading as models
from quantkit.models.streaming import NotStreamable, StreamedModel, layout_mismatch, stored_keys


@pytest.fixture(scope="module", params=[("llama", {"tie_word_embeddings": True}), ("gemma2", {"head_dim": 16})],
                ids=["llama-tied", "gemma2"])
def model_dir(request, tmp_path_factory):
    from quantkit.models.tiny import build_tiny_model

    model_type, extra = request.param
    return build_tiny_model(tmp_path_factory.mktemp("m") / model_type, make_text(1500), model_type, dtype="bfloat16",
                            max_shard_size="40KB", **extra)


def test_a_streamed_model_computes_as_the_loaded_one(model_dir):
    streamed = StreamedModel.open(model_dir)
    assert all(p.device.type == "meta" for p in streamed.model.parameters())  # nothing is read until asked for
    streamed.load_rest()
    assert all(p.device.type == "cpu" for m in streamed.rest() for p in m.parameters())
    for layer in streamed.layers:
        streamed.load(layer)
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        expected = models.load_model(model_dir)(input_ids=ids).logits
        got = streamed.model(input_ids=ids).logits
    assert got.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_a_released_layer_holds_no_memory(model_dir):
    streamed = StreamedModel.open(model_dir)
    layer = streamed.layers[0]
    streamed.load(layer)
    assert all(p.device.type == "cpu" for p in layer.parameters())
    streamed.release(layer)
    assert all(p.device.type == "meta" for p in layer.parameters())
    streamed.load_rest()
    if streamed.model.config.tie_word_embeddings:
        assert streamed.model.lm_head.weight is streamed.model.get_input_embeddings().weight


def test_the_modules_outside_the_layers_are_read_and_released_together(model_dir):
    streamed = StreamedModel.open(model_dir)
    embeddings = streamed.model.get_input_embeddings()
    for _ in range(2):  # read again after a release: tied weights stay tied, nothing stays behind
        streamed.load_rest()
        assert all(p.device.type == "cpu" for m in streamed.rest() for p in m.parameters())
        assert torch.equal(embeddings.weight, models.load_model(model_dir).get_input_embeddings().weight)
        if streamed.model.config.tie_word_embeddings:
            assert streamed.model.lm_head.weight is embeddings.weight
        streamed.release_rest()
        assert all(p.device.type == "meta" for p in streamed.model.parameters())


def test_a_checkpoint_in_another_layout_is_not_streamable(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for file in model_dir.iterdir():
        if file.suffix == ".safetensors":
            save_file({k.replace("input_layernorm", "ln_1"): v for k, v in load_file(file).items()}, str(renamed / file.name))
        elif file.name != "model.safetensors.index.json":
            (renamed / file.name).write_bytes(file.read_bytes())
    with pytest.raises(NotStreamable, match=r"input_layernorm.weight is not in it"):
        StreamedModel.open(renamed)
    skeleton = models.meta_model(models.load_config(model_dir))
    assert layout_mismatch(skeleton, {key: model_dir for key in stored_keys(skeleton)}) is None


def test_reading_the_rest_does_not_look_into_the_layers(model_dir, monkeypatch):
    """The writer's thread may be packing the last layer (adding the format's tensors to its modules) while the rest
    is read: load_rest leaves the layers alone (here, their state dicts fail if asked)."""
    streamed = StreamedModel.open(model_dir)

    def refuse(*args, **kwargs):
        raise AssertionError("load_rest looked into a decoder layer")

    for layer in streamed.layers:
        for module in layer.modules():
            monkeypatch.setattr(module, "_save_to_state_dict", refuse)
    streamed.load_rest()
    assert all(p.device.type == "cpu" for m in streamed.rest() for p in m.parameters())
    assert all(p.device.type == "meta" for p in streamed.layers.parameters())
