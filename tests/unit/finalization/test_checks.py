"""finalize's checks before any work: what a user gets wrong is refused at once, with what to do."""

import shutil
import subprocess
import sys

import pytest
import torch

from conftest import make_text
from quantkit.errors import FormatError, HardwareError, SourceModelError, UsageError
from quantkit.export import check_supported, for_format
from quantkit.finalization import checks
from quantkit.finalization.checks import prepare
from quantkit.finalization.finalize import quantize_without_data
from quantkit.models.loading import load_model
from quantkit.quant import registry
from quantkit.quant.registry import Format
from quantkit.runtime import hardware


def test_a_recipe_that_quantizes_nothing_is_refused(tmp_path):
    from quantkit.models.tiny import build_tiny_llama

    odd = build_tiny_llama(tmp_path / "odd", make_text(500), hidden_size=72, intermediate_size=200)
    with pytest.raises(UsageError, match="quantizes none of the 15 Linear modules .*group size 128 does not divide input size 72"):
        prepare(odd, registry.resolve("int4-weight-only"))


def test_non_finite_weights_are_refused_naming_the_tensor(tiny_model_dir):
    model = load_model(tiny_model_dir)
    model.model.layers[1].mlp.up_proj.weight.data[0, 0] = float("inf")
    plan = prepare(tiny_model_dir, registry.resolve("int8-weight-only")).plan
    with pytest.raises(SourceModelError, match=r"model.layers.1.mlp.up_proj.weight has 1 non-finite values"):
        quantize_without_data(model, plan)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("device, message", [("cuda", "no CUDA GPU"), ("cuda:1", "no CUDA GPU"), ("tpu", "not a device|cpu or cuda")])
def test_a_device_this_machine_lacks_is_refused(device, message):
    hardware.check_device("cpu")
    with pytest.raises(HardwareError, match=message):
        hardware.check_device(device)


def test_a_missing_source_is_reported_before_torch_is_imported(tmp_path):
    code = ("import sys; from quantkit.cli.main import main; "
            f"sys.argv = ['quantkit', 'finalize', '{tmp_path / 'nope'}', '{tmp_path / 'out'}', '-q', 'int4-weight-only']\n"
            "try:\n    main()\nexcept SystemExit as exit:\n    assert exit.code == 2, exit.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "does not exist" in run.stderr


def _qat_trained(tiny_model_dir, tmp_path, recipe):
    import json
    import shutil

    src = tmp_path / f"qat-{recipe.name}"
    shutil.copytree(tiny_model_dir, src)
    (src / "quantkit.json").write_text(json.dumps({"qat": {"recipe": recipe.to_dict()}}))  # as `quantkit train` records it
    return src


def test_a_qat_model_is_not_written_on_another_formats_grid_or_dtype_without_force(tiny_model_dir, tmp_path):
    """int4 g128 trained for compressed-tensors, written as GGUF (Q4_0's fp16 scales, groups of 32) or in
    bfloat16, would not hold the trained weights: refused unless --force-recipe; its own format and dtype pass."""
    recipe = registry.resolve("int4-weight-only")
    src = _qat_trained(tiny_model_dir, tmp_path, recipe)
    with pytest.raises(FormatError, match=r"trained with QAT on int4-weight-only's grid in format compressed-tensors, "
                                          r"and gguf writes another grid.*--format compressed-tensors"):
        prepare(src, for_format(recipe, Format.GGUF), Format.GGUF)
    prepare(src, for_format(recipe, Format.GGUF), Format.GGUF, force_recipe=True)
    with pytest.raises(UsageError, match="--dtype bfloat16 re-rounds the weights"):
        prepare(src, recipe, dtype="bfloat16")
    prepare(src, recipe, dtype="bfloat16", force_recipe=True)
    prepare(src, recipe, dtype="auto")
    prepare(src, recipe, dtype="float32")  # what auto gives for this float32 model


def test_an_ignore_entry_matching_nothing_is_noted(tiny_model_dir, tmp_path):
    path = tmp_path / "ign.yaml"
    path.write_text("scheme: {weights: {dtype: int4, granularity: group, group_size: 32}}\nformat: compressed-tensors\n"
                    "ignore: [lm_hed, lm_head]\n")
    notes = prepare(tiny_model_dir, registry.resolve(str(path))).coverage["notes"]
    assert [n for n in notes if n.startswith("ignore:")] == [
        "ignore: 'lm_hed' matches no Linear of this model, so it leaves nothing in full precision"]
    assert not [n for n in prepare(tiny_model_dir, registry.resolve("int4-weight-only")).coverage["notes"]
                if n.startswith("ignore:")]


def test_a_model_qat_trained_for_another_recipe_needs_force_recipe(tiny_model_dir, tmp_path):
    src = _qat_trained(tiny_model_dir, tmp_path, registry.resolve("int4-weight-only"))
    with pytest.raises(UsageError, match="trained with --qat-recipe int4-weight-only; finalize it with --quantize int4-weight-only"):
        prepare(src, registry.resolve("int8-weight-only"))
    prepare(src, registry.resolve("int8-weight-only"), force_recipe=True)


def test_a_model_qat_trained_for_a_gguf_recipe_with_model_dtype_scales_is_finalized_under_it(tiny_model_dir, tmp_path):
    """A user's GGUF recipe leaves its scales in the model's dtype; both training and finalize quantize on fp16 ones
    (GGUF's). The record holds the recipe as written, and finalize compares it as the format quantizes it."""
    from quantkit.export import for_format

    path = tmp_path / "my-q4.yaml"
    path.write_text("scheme: {weights: {dtype: int4, granularity: group, group_size: 32}}\nformat: gguf\n")
    recipe = registry.resolve(str(path))
    src = _qat_trained(tiny_model_dir, tmp_path, recipe)  # scale_dtype "model" in the record
    prepare(src, for_format(recipe, recipe.format))  # as finalize passes it
    with pytest.raises(UsageError, match=r"trained with --qat-recipe \S*my-q4\.yaml; finalize it with --quantize \S*my-q4\.yaml"):
        prepare(src, registry.resolve("int4-weight-only"))  # a recipe file: the advice names the file, not "my-q4"


@pytest.mark.parametrize("name, exact", [("nvfp4-a16", False), ("int4-weight-only", True)])
def test_qat_nvfp4_in_torchao_format_is_refused_for_its_other_grid(tiny_model_dir, tmp_path, name, exact):
    """QAT trains on the scheme's grid (NVFP4's global scale shared by q/k/v); torchao's NVFP4 has one per Linear,
    so the torchao artifact would not hold the trained weights: refused, naming the format that does."""
    from quantkit.errors import FormatError
    from quantkit.quant.registry import Format

    recipe = registry.resolve(name)
    src = _qat_trained(tiny_model_dir, tmp_path, recipe)
    if exact:
        prepare(src, recipe, Format.TORCHAO)
    else:
        with pytest.raises(FormatError, match="own global scale.*use --format compressed-tensors"):
            prepare(src, recipe, Format.TORCHAO)
    prepare(src, recipe, Format.COMPRESSED_TENSORS)


def test_a_torchao_fp8_artifact_is_bfloat16_whatever_the_source(tiny_model_dir):
    """torchao's FP8 tensors take bfloat16 weights only (its per-row config asserts it mid-load): a float32 source
    becomes a bfloat16 artifact, noted; an explicit float32 / float16 is refused in one line."""
    import pytest

    from quantkit.errors import UsageError
    from quantkit.finalization.checks import Prepared, artifact_dtype
    from quantkit.quant.registry import Format, resolve

    for name in ("float8-dynamic-act-float8-weight", "fp8-block"):
        recipe = resolve(name)
        prepared = Prepared(src=tiny_model_dir, format=Format.TORCHAO, plan=[], coverage={})
        assert artifact_dtype(prepared, recipe, "auto") == "bfloat16"
        assert "torchao's FP8 tensors take bfloat16 weights" in prepared.coverage["notes"][0]
        with pytest.raises(UsageError, match="pass --dtype bfloat16"):
            artifact_dtype(prepared, recipe, "float32")
        compressed = Prepared(src=tiny_model_dir, format=Format.COMPRESSED_TENSORS, plan=[], coverage={})
        assert artifact_dtype(compressed, recipe, "auto") == "auto"  # compressed-tensors' FP8 takes any dtype


# ---------------------------------------------------------------- the hardware a recipe's kernels need

FP8 = "float8-dynamic-act-float8-weight"


def test_fp8_torchao_without_gpu_names_the_working_format(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_capability", lambda: None)
    with pytest.raises(HardwareError, match="compute capability 8.9\\+ .*use --format compressed-tensors"):
        checks.check_hardware(registry.resolve(FP8), Format.TORCHAO)


def test_fp8_torchao_on_an_older_gpu(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_capability", lambda: (8, 0))
    assert "this one is 8.0" in checks.missing_requirement(registry.resolve(FP8), Format.TORCHAO)


def test_fp8_torchao_on_a_new_gpu(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_capability", lambda: (9, 0))
    checks.check_hardware(registry.resolve(FP8), Format.TORCHAO)


def test_compressed_tensors_fp8_needs_nothing():
    checks.check_hardware(registry.resolve(FP8), Format.COMPRESSED_TENSORS)


def test_missing_package_is_named(tmp_path):
    path = tmp_path / "needs.yaml"
    path.write_text(
        "scheme: {weights: {dtype: int8, granularity: channel}}\nformat: torchao\n"
        "requires: {torchao: {packages: [surely_not_installed_pkg]}}"
    )
    with pytest.raises(HardwareError, match="pip install surely_not_installed_pkg.*--format compressed-tensors"):
        checks.check_hardware(registry.resolve(str(path)), Format.TORCHAO)


@pytest.mark.parametrize("name, reason", [
    ("mxfp4-a16", "MX weight-only has no torchao config"),
    ("w4a8-fp8", "mslk's CUDA kernels"),
    ("nvfp4", "round-to-nearest recipes"),  # its activations' global scale is calibrated
])
def test_scheme_a_format_cannot_express_is_refused_with_the_alternative(name, reason):
    with pytest.raises(FormatError, match=f"{reason}.*use --format compressed-tensors"):
        check_supported(registry.resolve(name), Format.TORCHAO)


def test_nvfp4_weight_only_in_torchao_needs_no_gpu(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_capability", lambda: None)
    check_supported(registry.resolve("nvfp4-a16"), Format.TORCHAO)
    checks.check_hardware(registry.resolve("nvfp4-a16"), Format.TORCHAO)


@pytest.mark.parametrize("name, need", [("mxfp4", "10.0"), ("mxfp8", "10.0"), ("fp8-block", "8.9")])
def test_torchao_float_grids_need_their_kernels_gpu(monkeypatch, name, need):
    check_supported(registry.resolve(name), Format.TORCHAO)  # expressible
    monkeypatch.setattr(hardware, "cuda_capability", lambda: None)
    with pytest.raises(HardwareError, match=f"compute capability {need}\\+ .*use --format compressed-tensors"):
        checks.check_hardware(registry.resolve(name), Format.TORCHAO)
    monkeypatch.setattr(hardware, "cuda_capability", lambda: (9, 0))
    assert (checks.missing_requirement(registry.resolve(name), Format.TORCHAO) is None) == (need == "8.9")
    monkeypatch.setattr(hardware, "cuda_capability", lambda: (10, 0))
    checks.check_hardware(registry.resolve(name), Format.TORCHAO)


def test_a_user_recipe_without_requires_is_gated_by_its_torchao_config(tmp_path, monkeypatch):
    """The capability comes from the scheme's torchao config, not only from a recipe's `requires`."""
    path = tmp_path / "my-mx.yaml"
    path.write_text(
        "scheme:\n  weights: {dtype: float8_e4m3fn, granularity: group, group_size: 32, scale_dtype: float8_e8m0fnu}\n"
        "  activations: {dtype: float8_e4m3fn, granularity: group, group_size: 32, scale_dtype: float8_e8m0fnu, dynamic: true}\n"
        "format: torchao\non_indivisible: skip\n"
    )
    recipe = registry.resolve(str(path))
    assert recipe.requirement(Format.TORCHAO).cuda_capability is None
    monkeypatch.setattr(hardware, "cuda_capability", lambda: (9, 0))
    assert "compute capability 10.0+ (this one is 9.0)" in checks.missing_requirement(recipe, Format.TORCHAO)


# ---------------------------------------------------------------- calibration data: checked with the tokenizer alone


def _calibration(tmp_path, **options):
    from quantkit.finalization.checks import CalibrationOptions

    path = tmp_path / "calib.txt"
    path.write_text(make_text(2000, seed=5))
    return CalibrationOptions(data=str(path), **options)


def test_a_seq_len_beyond_the_models_positions_is_refused_saying_what_to_pass(tiny_model_dir, tmp_path):
    with pytest.raises(UsageError, match=r"^--seq-len 100000 is longer than the 512 positions of .*tiny-llama "
                                         r"\(max_position_embeddings in config.json\); pass --seq-len 512 or less$"):
        prepare(tiny_model_dir, registry.resolve("gptq-w4a16"), calibration=_calibration(tmp_path, seq_len=100_000))


def test_a_recipes_seq_len_beyond_the_models_positions_names_the_recipe(tiny_model_dir, tmp_path):
    import json
    import shutil

    short = shutil.copytree(tiny_model_dir, tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    with pytest.raises(UsageError, match=r"^recipe 'gptq-w4a16' calibrates on 512-token samples, longer than the 256 "
                                         r"positions of .*; pass --seq-len 256 or less$"):
        prepare(short, registry.resolve("gptq-w4a16"), calibration=_calibration(tmp_path))
    prepare(short, registry.resolve("gptq-w4a16"), calibration=_calibration(tmp_path, seq_len=256, num_samples=4))


def test_the_checked_calibration_blocks_are_the_ones_the_run_uses(tiny_model_dir, tmp_path):
    from quantkit.finalization.finalize import calibration_samples, prepared_samples

    recipe, options = registry.resolve("gptq-w4a16"), _calibration(tmp_path, num_samples=4, seq_len=32)
    prepared = prepare(tiny_model_dir, recipe, calibration=options)
    assert prepared.samples.shape == (4, 32)
    assert prepared_samples(prepared, recipe, options) is prepared.samples
    other = _calibration(tmp_path, num_samples=4, seq_len=32, seed=1)
    assert prepared.samples_for(other) is None
    assert torch.equal(prepared_samples(prepared, recipe, other), calibration_samples(tiny_model_dir, recipe, other))


@pytest.mark.parametrize("content, seq_len, message", [
    (None, 100_000, "--seq-len 100000 is longer than the 512 positions"),
    (bytes(range(256)) * 100, 32, "calib.txt is not text"),
    (b"a few words only\n", 32, "tokens; --num-samples 4 x --seq-len 32 needs at least 129"),
])
def test_calibration_data_is_refused_before_any_weight_is_read(tiny_model_dir, tmp_path, monkeypatch, content, seq_len,
                                                               message):
    from pathlib import Path

    from quantkit.finalization.finalize import finalize
    from quantkit.models import loading
    from quantkit.models.streaming import StreamedModel

    def read_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(loading, "load_model", read_weights)
    monkeypatch.setattr(StreamedModel, "open", read_weights)
    options = _calibration(tmp_path, num_samples=4, seq_len=seq_len)
    if content is not None:
        Path(options.data).write_bytes(content)
    with pytest.raises(UsageError, match=message):
        finalize(tiny_model_dir, tmp_path / "out", registry.resolve("gptq-w4a16"), calibration=options)
    assert not (tmp_path / "out").exists()


def test_calibration_without_a_tokenizer_says_what_to_copy(tiny_model_dir, tmp_path):
    from quantkit.errors import SourceModelError
    from quantkit.finalization.checks import CalibrationOptions, calibration_samples

    src = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir, src, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*", "vocab*", "merges*"))
    (tmp_path / "calib.txt").write_text("some calibration text " * 200)
    options = CalibrationOptions(data=str(tmp_path / "calib.txt"), num_samples=2, seq_len=16)
    with pytest.raises(SourceModelError, match="has no tokenizer files; calibration tokenizes its data with the model's "
                                               "own tokenizer: copy its tokenizer files"):
        calibration_samples(src, registry.resolve("gptq-w4a16"), options)


@pytest.mark.parametrize("options, message", [({"num_samples": 0}, "--num-samples 0: pass 1 or more"),
                                              ({"num_samples": -1}, "--num-samples -1"),
                                              ({"seq_len": 1}, "--seq-len 1: pass 2 or more")])
def test_calibration_options_refuse_what_the_command_refuses(options, message):
    with pytest.raises(UsageError, match=message):
        checks.CalibrationOptions(**options)


def test_calibration_sizes_given_or_the_recipes():
    recipe = registry.resolve("gptq-w4a16")
    defaults = (recipe.calibration.num_samples, recipe.calibration.seq_len)
    assert checks.CalibrationOptions().sizes(recipe) == defaults
    assert checks.CalibrationOptions(num_samples=3, seq_len=2).sizes(recipe) == (3, 2)


@pytest.mark.parametrize("recipe, dst, options, message", [
    ("int4-weight-only", "out", {"dtype": "int7"}, "--dtype int7: use one of auto, float32"),
    ("int4-weight-only", "out", {"calibration": checks.CalibrationOptions(device="tpu")}, "--device tpu: not a device"),
    ("gguf-q8-0", "out.gguf", {"max_shard_size": "500KB"}, "--max-shard-size applies to safetensors formats"),
])
def test_a_round_to_nearest_finalize_checks_its_options_too(tiny_model_dir, tmp_path, recipe, dst, options, message):
    with pytest.raises(UsageError, match=message):
        prepare(tiny_model_dir, registry.resolve(recipe), dst=tmp_path / dst, **options)


def test_calibration_options_a_round_to_nearest_recipe_ignores_are_noted(tiny_model_dir):
    recipe = registry.resolve("int4-weight-only")
    given = checks.CalibrationOptions(data="calib.txt", num_samples=5)
    notes = prepare(tiny_model_dir, recipe, calibration=given).coverage["notes"]
    assert "int4-weight-only rounds to nearest: --calib-data, --num-samples are not used" in notes
    assert not checks.unused_calibration(recipe, checks.CalibrationOptions())
    assert not checks.unused_calibration(registry.resolve("gptq-w4a16"), given)
