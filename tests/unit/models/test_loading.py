"""Model directories: checks, the tokenizer, decoder layers, fingerprints."""

from pathlib import Path

import pytest
import torch

from quantkit.errors import SourceModelError, UnsupportedModelError
from quantkit.models import loading as models


def test_load_tokenizer_ends_its_error_with_what_to_do(tmp_path, tiny_model_dir):
    with pytest.raises(SourceModelError, match="has no tokenizer files; set model.tokenizer"):
        models.load_tokenizer(tmp_path, fix="set model.tokenizer")
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(SourceModelError, match="cannot load the tokenizer .*; pass --tokenizer DIR"):
        models.load_tokenizer(tmp_path)
    assert models.load_tokenizer(tiny_model_dir)("the model").input_ids


def test_decoder_layers_and_their_name(tiny_model_dir):
    model = models.load_model(tiny_model_dir)
    layers = models.decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    assert models.module_name(model, layers) == "model.layers"


def test_a_model_without_decoder_layers_is_refused():
    class Odd(torch.nn.Module):
        base_model_prefix = "transformer"

    with pytest.raises(UnsupportedModelError, match="decoder layers at model.transformer.layers"):
        models.decoder_layers(Odd())


def test_fingerprint_follows_the_weights(tiny_model_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    assert models.fingerprint(copy) == models.fingerprint(tiny_model_dir)
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert models.fingerprint(copy) != models.fingerprint(tiny_model_dir)
    assert models.weights_size(copy) == weights.stat().st_size


def test_copy_tokenizer_copies_only_tokenizer_files(tiny_model_dir, tmp_path):
    copied = models.copy_tokenizer(tiny_model_dir, tmp_path)
    assert "tokenizer.json" in copied and not list(tmp_path.glob("*.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(copied)


def test_an_already_quantized_source_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "compressed-tensors"}}')
    assert models.quantization_method(tmp_path) == "compressed-tensors"
    with pytest.raises(SourceModelError, match="already quantized"):
        models.check_full_precision(tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_finite_names_every_kind_of_non_finite_value(bad, dtype):
    from quantkit.errors import SourceModelError
    from quantkit.models.loading import check_finite

    weight = torch.randn(64, 32).to(dtype)
    check_finite("m", weight)
    weight[3, 7] = bad
    weight[9, 1] = bad
    with pytest.raises(SourceModelError, match="m.weight has 2 non-finite values"):
        check_finite("m", weight)


def test_the_background_fingerprint_is_the_fingerprint(tiny_model_dir):
    assert models.fingerprint_in_background(tiny_model_dir).result(timeout=60) == models.fingerprint(tiny_model_dir)


def test_a_checkpoint_lacking_a_tensor_is_refused_not_loaded_random(tiny_model_dir, tmp_path):
    """transformers loads a checkpoint without some of the model's tensors, those left random: refused, naming one."""
    import shutil

    from safetensors.torch import load_file, save_file

    copy = Path(shutil.copytree(tiny_model_dir, tmp_path / "copy"))
    tensors = load_file(copy / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SourceModelError, match=r"lacks 1 of the model's tensors \(model.norm.weight\): they would be "
                                               "random; pass the model directory its config belongs to"):
        models.load_model(copy)
