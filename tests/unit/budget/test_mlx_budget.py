"""`finalize --format mlx --target-bpw / --target-size`: MLX recipes' bit widths per tensor (mlx-lm's mixed bits,
per-layer entries of config.json's `quantization`), meeting the average bits per weight the written files then hold."""

import json

import pytest

from quantkit.budget import planner
from quantkit.errors import UsageError
from quantkit.finalization.finalize import CalibrationOptions, finalize
from quantkit.quant import registry
from quantkit.quant.registry import Format

CANDIDATES = ("mlx-3bit-g64", "mlx-4bit-g64", "mlx-8bit-g64")


@pytest.fixture(scope="module")
def options(text_file):
    return CalibrationOptions(data=str(text_file), num_samples=8, seq_len=64)


@pytest.fixture(scope="module")
def plan(wide_model_dir, options):
    return planner.plan(wide_model_dir, registry.resolve("mlx-4bit-g64"), 5.0, options, CANDIDATES)


def stored_bytes(out) -> int:
    from safetensors import safe_open

    total = 0
    for path in out.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    return total


def source_parameters(src) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(src).parameters())


def test_an_mlx_plan_is_a_mixture_the_files_hold_exactly(wide_model_dir, options, plan, tmp_path):
    """The plan meets 5 bits per weight with a mixture of MLX bit widths; the directory's safetensors bytes of every
    tensor x 8 over the model's parameters are the plan's bits per weight exactly, and config.json names each layer
    whose bits differ from the recipe's with the bits the plan gave it."""
    assert plan.bits_per_weight <= 5.0 and 5.0 - plan.bits_per_weight < 0.1
    assert len(set(plan.types.values())) > 1 and set(plan.types.values()) <= set(CANDIDATES)
    assert plan.parameters == source_parameters(wide_model_dir)
    out = tmp_path / "mixed"
    finalize(wide_model_dir, out, plan.recipe, Format.MLX, calibration=options)
    assert stored_bytes(out) == plan.tensor_bytes
    assert stored_bytes(out) * 8 / plan.parameters == pytest.approx(plan.bits_per_weight, abs=1e-9)
    config = json.loads((out / "config.json").read_text())["quantization"]
    bits = {"mlx-3bit-g64": 3, "mlx-4bit-g64": 4, "mlx-8bit-g64": 8}
    assert "token_embd" in plan.types  # mlx-lm quantizes the embedding: a tensor of the plan, as in GGUF
    for name, kind in plan.types.items():
        name = "model.embed_tokens" if name == "token_embd" else name
        assert config.get(name, {"bits": 4, "group_size": 64, "mode": "affine"}) == {
            "bits": bits[kind], "group_size": 64, "mode": "affine"}, name


def test_a_tied_lm_head_typed_is_counted_as_the_file_holds_it(tmp_path, options):
    """Tied embeddings: MLX stores the embedding on lm_head's grid (`--tensor-type lm_head=...` included), and the
    plan counts it so."""
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / "tied", make_text(3000), "qwen3", hidden_size=128, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    recipe = registry.with_tensor_types(registry.resolve("mlx-4bit-g64"), ["lm_head=mlx-8bit-g64"])
    chosen = planner.plan(src, recipe, 6.0, options, CANDIDATES)
    assert "lm_head" not in chosen.types and "token_embd" not in chosen.types
    out = tmp_path / "out"
    finalize(src, out, chosen.recipe, Format.MLX, calibration=options)
    assert stored_bytes(out) == chosen.tensor_bytes
    assert json.loads((out / "config.json").read_text())["quantization"]["model.embed_tokens"]["bits"] == 8


def test_an_mlx_target_size_is_the_files_tensors(wide_model_dir, options, tmp_path):
    size = 260_000
    chosen = planner.plan(wide_model_dir, registry.resolve("mlx-4bit-g64"), None, options, CANDIDATES, target_bytes=size)
    assert size * 0.97 < chosen.tensor_bytes <= size
    out = tmp_path / "sized"
    finalize(wide_model_dir, out, chosen.recipe, Format.MLX, calibration=options)
    assert stored_bytes(out) == chosen.tensor_bytes


def test_the_cli_plans_mlx_without_a_recipe(wide_model_dir, options, tmp_path):
    """`finalize --format mlx --target-bpw B` without -q: MLX's GPTQ (mlx-gptq-4bit-g64) over the default MLX
    candidates; the plan saved as a recipe; the directory mixed."""
    import yaml
    from typer.testing import CliRunner

    from quantkit.cli.main import app

    out = tmp_path / "cli"
    result = CliRunner().invoke(app, ["finalize", str(wide_model_dir), str(out), "--format", "mlx", "--target-bpw", "6",
                                      "--calib-data", options.data, "--num-samples", "8", "--seq-len", "64",
                                      "--save-plan", str(tmp_path / "plan.yaml"), "--quiet"])
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert saved["format"] == "mlx" and saved["algorithm"]["name"] == "gptq" and saved["tensor_types"]
    config = json.loads((out / "config.json").read_text())["quantization"]
    assert len({entry["bits"] for entry in config.values() if isinstance(entry, dict)} | {config["bits"]}) > 1


@pytest.mark.parametrize("args, message", [
    (["--candidates", "q4_k,q6_k"], "Q4_K is not a candidate for mlx, which takes recipes whose schemes it takes (mlx-3bit-g64"),
    (["--candidates", "mlx-4bit-g64,int4-asym"], "--candidates: int4-asym: an integer zero point's bias"),
    (["--candidates", "mlx-4bit-g64,nvfp4-a16"], "--candidates: nvfp4-a16: mlx's nvfp4 mode holds FP8 group scales alone"),
    (["--candidates", "mlx-4bit-g64,int8-dynamic-act-int8-weight"], "MLX's files are weight-only"),
])
def test_bad_mlx_candidates_are_one_line(wide_model_dir, tmp_path, args, message):
    from typer.testing import CliRunner

    from quantkit.cli.main import app

    result = CliRunner().invoke(app, ["finalize", str(wide_model_dir), str(tmp_path / "x"), "--format", "mlx",
                                      "--target-bpw", "5", "--calib-data", "x.txt", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()) and "Traceback" not in result.output
    assert not (tmp_path / "x").exists()


def test_default_candidates_are_mlx_recipes_it_holds():
    from quantkit.export import check_supported

    assert planner.parse_candidates(None, Format.MLX) == (
        "mlx-3bit-g64", "mlx-4bit-g64", "mlx-5bit-g64", "mlx-6bit-g64", "mlx-8bit-g64")
    for name in planner.parse_candidates(None, Format.MLX):
        check_supported(registry.resolve(name), Format.MLX)
    with pytest.raises(UsageError, match="not a candidate for mlx"):
        planner.parse_candidates("q4_k", Format.MLX)
