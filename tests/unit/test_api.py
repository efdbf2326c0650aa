"""The Python API (`quantkit.finalize`, `quantkit.evaluate`, `quantkit.recipes`): the commands' work without the
shell, computing what the commands compute."""

import json
import subprocess
import sys

import pytest

import quantkit
from quantkit.errors import FormatError, HardwareError, RecipeNotFoundError, UsageError
from quantkit.quant import registry


def test_importing_quantkit_and_its_recipes_imports_no_torch():
    code = "import sys, quantkit; quantkit.recipes.get('gptq-w4a16'); sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_recipes_are_the_registrys():
    assert quantkit.recipes.names() == registry.recipe_names()
    assert quantkit.recipes.get("gptq-w4a16") == registry.resolve("gptq-w4a16")
    with pytest.raises(RecipeNotFoundError, match="gptq-w4a16"):
        quantkit.recipes.get("gptq-w4a61")


def test_a_recipe_file_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("scheme: {weights: {dtype: int8, granularity: channel}}\nformat: compressed-tensors\n")
    assert quantkit.recipes.get(path).name == "mine"


def test_finalize_then_evaluate_from_python_as_the_commands_do(tiny_model_dir, text_file, tmp_path):
    dst = tmp_path / "int8"
    result = quantkit.finalize(tiny_model_dir, dst, "int8-weight-only")
    assert result.dst == dst and result.recipe.name == "int8-weight-only" and result.format.value == "compressed-tensors"
    assert json.loads((dst / "quantkit.json").read_text())["recipe"]["name"] == "int8-weight-only"

    reports = quantkit.evaluate([tiny_model_dir, dst], data=str(text_file), seq_len=32, max_samples=4,
                                quantize=["int8-weight-only"])
    assert [r.label for r in reports] == [str(tiny_model_dir), f"{tiny_model_dir}+int8-weight-only", str(dst)]
    preview, artifact = reports[1].perplexity.perplexity, reports[2].perplexity.perplexity
    assert artifact == pytest.approx(preview, rel=1e-6)  # the in-memory preview computes as the artifact does
    assert reports[0].perplexity.perplexity != artifact


def test_a_wrong_format_is_a_quantkit_error(tiny_model_dir, tmp_path):
    with pytest.raises(FormatError, match="compressed-tensors or torchao or gguf"):
        quantkit.finalize(tiny_model_dir, tmp_path / "out", "int8-weight-only", format="safetensors")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("recipe, options, error, message", [
    ("gptq-w4a16", {"num_samples": 0}, UsageError, "--num-samples 0: pass 1 or more"),
    ("gptq-w4a16", {"num_samples": 4, "seq_len": 1}, UsageError, "--seq-len 1: pass 2 or more"),
    ("int4-weight-only", {"threads": 0}, UsageError, "--threads 0: pass 1 or more"),
    ("int4-weight-only", {"dtype": "int7"}, UsageError, "--dtype int7: use one of auto, float32, bfloat16, float16"),
    ("int4-weight-only", {"device": "tpu"}, HardwareError, "--device tpu: not a device"),
])
def test_finalize_makes_the_commands_checks(tiny_model_dir, text_file, tmp_path, recipe, options, error, message):
    with pytest.raises(error, match=message):
        quantkit.finalize(tiny_model_dir, tmp_path / "out", recipe, calib_data=str(text_file), **options)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("options, error, message", [
    ({"seq_len": 1}, UsageError, "--seq-len 1: pass 2 or more"),
    ({"batch_size": 0}, UsageError, "--batch-size 0: pass 1 or more"),
    ({"threads": 0}, UsageError, "--threads 0: pass 1 or more"),
    ({"device": "tpu"}, HardwareError, "--device tpu: not a device"),
])
def test_evaluate_makes_the_commands_checks(tiny_model_dir, text_file, options, error, message):
    with pytest.raises(error, match=message):
        quantkit.evaluate([tiny_model_dir], data=str(text_file), **options)


def test_evaluate_takes_one_model_and_runs_where_the_command_does(monkeypatch):
    import torch

    import quantkit.evaluation.evaluate

    calls = []
    monkeypatch.setattr(quantkit.evaluation.evaluate, "compare", lambda models, data, *args, **kwargs: calls.append((models, kwargs)))
    quantkit.evaluate("./my-model", data="test.txt")
    models, kwargs = calls[0]
    assert models == ["./my-model"]  # one model, not its path's characters
    assert kwargs["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # eval --device auto


def test_evaluate_passes_kl_divergence_on(monkeypatch):
    import quantkit.evaluation.evaluate

    calls = []
    monkeypatch.setattr(quantkit.evaluation.evaluate, "compare", lambda models, data, *args, **kwargs: calls.append(kwargs))
    quantkit.evaluate(["./a", "./b"], data="test.txt", kl_divergence=True)
    quantkit.evaluate(["./a", "./b"], data="test.txt")
    assert [kwargs["kl_divergence"] for kwargs in calls] == [True, False]


def test_evaluate_takes_one_recipe_as_it_takes_one_model(monkeypatch):
    import quantkit.evaluation.evaluate

    calls = []
    monkeypatch.setattr(quantkit.evaluation.evaluate, "compare", lambda models, data, quantize, **kwargs: calls.append(quantize))
    quantkit.evaluate("./my-model", data="test.txt", quantize="int8-weight-only")
    quantkit.evaluate("./my-model", data="test.txt", quantize=["int8-weight-only", "gptq-w4a16"])
    assert calls == [["int8-weight-only"], ["int8-weight-only", "gptq-w4a16"]]  # not the name's characters
    with pytest.raises(UsageError, match="at least one model"):
        quantkit.evaluate([], data="test.txt")
