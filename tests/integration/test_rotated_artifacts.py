"""Rotation recipes end to end: the artifact is a plain model (transformers loads it, computing what `eval -q`
computes), a tied model is untied, and what a rotation cannot take is refused before any weight is read."""

import json
from pathlib import Path
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_text
from quantkit.errors import FormatError, UnsupportedModelError
from quantkit.finalization.checks import prepare
from quantkit.finalization.finalize import finalize, quantize_model
from quantkit.models.tiny import build_tiny_model
from quantkit.quant.registry import Format, resolve


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tied") / "llama", make_text(1500), "llama", tie_word_embeddings=True)


def test_a_rotated_artifact_loads_in_plain_transformers_as_eval_q_computes(tied_model_dir, tmp_path):
    recipe = resolve("quarot-w4a8-fp8")
    prepared = prepare(tied_model_dir, recipe)
    assert prepared.loading == "whole model in memory: the rotations untie the tied embeddings and lm_head"
    preview = quantize_model(prepared, recipe)
    dst = finalize(tied_model_dir, tmp_path / "out", recipe).dst
    config = json.loads((dst / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(load_file(dst / "model.safetensors"))
    info = json.loads((dst / "quantkit.json").read_text())["transforms"]
    assert (info["R1"], info["R2"]) == (64, 16) and info["applied"][0]["rotations"] == ["R1", "R2"]

    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); ids = torch.tensor({ids.tolist()}); "
            "torch.save(m(ids).logits, sys.argv[2])")  # a process that never imports quantkit
    out = tmp_path / "logits.pt"
    subprocess.run([sys.executable, "-c", code, str(dst), str(out)], check=True, capture_output=True)
    with torch.no_grad():
        expected = preview(ids).logits
    torch.testing.assert_close(torch.load(out, weights_only=True), expected, rtol=1e-4, atol=1e-4)


def test_rotations_are_refused_in_the_torchao_format(tiny_model_dir):
    with pytest.raises(FormatError, match="use --format compressed-tensors"):
        prepare(tiny_model_dir, resolve("quarot-w4a8"), Format.TORCHAO)


def test_a_post_norm_architecture_is_refused_before_any_weight_is_read(tmp_path):
    src = build_tiny_model(tmp_path / "gemma2", make_text(800), "gemma2", head_dim=16)
    with pytest.raises(UnsupportedModelError, match="rotations need pre-norm decoder layers"):
        prepare(src, resolve("quarot-nvfp4"))


# llm-compressor 0.14's SpinQuantModifier(rotations=["R1", "R2"], transform_type="hadamard") on a Llama with
# head_dim 16: its config.json's quantization_config.transform_config (R1 and R2 groups, as it writes them)
LLMC_SPINQUANT = {"config_groups": {
    "R1": {"apply": [
        {"ignore": [], "inverse": False, "location": "weight_output",
         "targets": ["re:.*embed_tokens$", "re:.*o_proj$", "re:.*down_proj$"]},
        {"ignore": [], "inverse": True, "location": "weight_input",
         "targets": ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$", "re:.*up_proj$", "re:.*gate_proj$", "lm_head"]}],
        "head_dim": None, "precision": "torch.float64", "randomize": False, "requires_grad": False, "type": "hadamard"},
    "R2": {"apply": [
        {"ignore": [], "inverse": False, "location": "weight_output", "targets": ["re:.*v_proj$"]},
        {"ignore": [], "inverse": True, "location": "weight_input", "targets": ["re:.*o_proj$"]}],
        "head_dim": 16, "precision": "torch.float64", "randomize": False, "requires_grad": False, "type": "hadamard"}}}


def _sorted_targets(config):
    for group in config["config_groups"].values():
        for apply in group["apply"]:
            apply["targets"] = sorted(apply["targets"])
    return config


def test_the_transform_config_validates_and_is_llm_compressors_layout(tiny_model_dir, text_file, tmp_path):
    from compressed_tensors.transform import TransformConfig

    from quantkit.finalization.checks import CalibrationOptions

    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    for in_memory in (False, True):  # the streamed writer and the whole-model one
        dst = finalize(tiny_model_dir, tmp_path / str(in_memory), resolve("spinquant-gptq-w4a16"), calibration=options,
                       in_memory=in_memory).dst
        written = json.loads((dst / "config.json").read_text())["quantization_config"]["transform_config"]
        TransformConfig.model_validate(written)
        assert _sorted_targets(written) == _sorted_targets(json.loads(json.dumps(LLMC_SPINQUANT)))


# The same with rotations=["R1", "R2", "R4"]: R4's group as llm-compressor 0.14 writes it, and the matrix it stores
# once, as `model.layers.0.mlp.down_proj.R4_input.weight` (float64, ±1: Sylvester's for type hadamard)
LLMC_R4 = {"apply": [
    {"ignore": [], "inverse": False, "location": "input", "targets": ["re:.*down_proj$"]},
    {"ignore": [], "inverse": True, "location": "weight_input", "targets": ["re:.*down_proj$"]}],
    "head_dim": None, "precision": "torch.float64", "randomize": False, "requires_grad": False, "type": "hadamard"}
R4_KEY = "model.layers.0.mlp.down_proj.R4_input.weight"


def _r4_recipe(tmp_path, kind: str = "hadamard"):
    path = tmp_path / "r4.yaml"
    path.write_text("scheme: {weights: {dtype: int4, granularity: group, group_size: 32, symmetric: true}}\n"
                    f"transforms: [{{type: hadamard, rotations: [R1, R2]}}, {{type: {kind}, rotations: [R4], online: true}}]\n"
                    "algorithm: {name: gptq}\nformat: compressed-tensors\nignore: [lm_head]\n")
    return resolve(str(path))


@pytest.fixture(scope="module")
def wide_mlp_dir(tmp_path_factory):
    """A tiny Llama whose MLP is 128 wide: a power of two, which R4 of type hadamard needs."""
    return build_tiny_model(tmp_path_factory.mktemp("wide") / "llama", make_text(1500), "llama", intermediate_size=128)


def _logits_in_plain_transformers(dst, ids, tmp_path, online_by_compressed_tensors: bool = False):
    """Logits of DST in a process that never imports quantkit: transformers alone, or with compressed-tensors
    applying the transform_config's online transforms (its own HadamardTransform, built from the config)."""
    code = ("import sys, json, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); ids = torch.tensor({ids.tolist()})\n"
            "if sys.argv[3] == '1':\n"
            "    from compressed_tensors.transform import TransformConfig, apply_transform_config\n"
            "    c = json.load(open(sys.argv[1] + '/config.json'))['quantization_config']['transform_config']\n"
            "    groups = {k: {**g, 'apply': [a for a in g['apply'] if a['location'] == 'input']} for k, g in c['config_groups'].items()}\n"
            "    apply_transform_config(m, TransformConfig.model_validate({'config_groups': {k: g for k, g in groups.items() if g['apply']}}))\n"
            "torch.save(m(ids).logits, sys.argv[2])")
    out = tmp_path / f"logits-{int(online_by_compressed_tensors)}.pt"
    subprocess.run([sys.executable, "-c", code, str(dst), str(out), str(int(online_by_compressed_tensors))], check=True,
                   capture_output=True)
    return torch.load(out, weights_only=True)


def test_an_online_r4_artifact_is_llm_compressors_layout_and_evaluates_as_eval_q_computes(wide_mlp_dir, text_file, tmp_path):
    """R4 is written as llm-compressor writes it (streamed and whole: the same files); quantkit's loader and
    compressed-tensors' own transform both apply it and compute what `eval -q` computes; plain transformers
    ignores it, which is why `finalize` and `recipes show` say which runtimes apply it."""
    from compressed_tensors.transform import TransformConfig

    from quantkit.algorithms import hadamard
    from quantkit.finalization.checks import CalibrationOptions
    from quantkit.models.loading import load_model

    recipe = _r4_recipe(tmp_path)
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    dsts = [finalize(wide_mlp_dir, tmp_path / str(in_memory), recipe, calibration=options, in_memory=in_memory).dst
            for in_memory in (False, True)]
    streamed, whole = (load_file(d / "model.safetensors") for d in dsts)
    assert streamed.keys() == whole.keys() and all(torch.equal(streamed[k], whole[k]) for k in streamed)
    assert [k for k in streamed if "R4" in k] == [R4_KEY]
    assert torch.equal(streamed[R4_KEY], hadamard.hadamard_matrix(128, normalize=False))
    written = json.loads((dsts[0] / "config.json").read_text())["quantization_config"]["transform_config"]
    TransformConfig.model_validate(written)
    assert _sorted_targets(written) == _sorted_targets(json.loads(json.dumps(
        {"config_groups": {**LLMC_SPINQUANT["config_groups"], "R4": LLMC_R4}})))
    info = json.loads((dsts[0] / "quantkit.json").read_text())["transforms"]
    assert info["R4"] == "online" and "plain transformers ignores it" in info["runtimes"]

    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = quantize_model(prepare(wide_mlp_dir, recipe), recipe, calibration=options)(ids).logits
        loaded = load_model(dsts[0])(ids).logits
    torch.testing.assert_close(loaded, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_logits_in_plain_transformers(dsts[0], ids, tmp_path, True), expected, rtol=1e-4, atol=1e-4)
    plain = _logits_in_plain_transformers(dsts[0], ids, tmp_path)
    assert (plain - expected).abs().max() > 100 * 1e-4  # what a runtime without the transform computes: not this


def test_a_random_hadamard_r4_of_a_width_that_is_not_a_power_of_two(tiny_model_dir, text_file, tmp_path):
    from quantkit.algorithms import hadamard
    from quantkit.finalization.checks import CalibrationOptions
    from quantkit.models.loading import load_model

    recipe = _r4_recipe(tmp_path, "random-hadamard")
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    dst = finalize(tiny_model_dir, tmp_path / "out", recipe, calibration=options).dst
    group = json.loads((dst / "config.json").read_text())["quantization_config"]["transform_config"]["config_groups"]["R4"]
    assert group["type"] == "random-hadamard"
    stored = load_file(dst / "model.safetensors")[R4_KEY]
    assert torch.equal(stored, hadamard.random_hadamard_matrix(176, 0, normalize=False))
    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = quantize_model(prepare(tiny_model_dir, recipe), recipe, calibration=options)(ids).logits
        torch.testing.assert_close(load_model(dst)(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_online_rotations_are_refused_where_they_would_be_lost(tiny_model_dir, text_file, tmp_path):
    """QAT's checkpoint would not carry R4; a tensor-parallel rank's shard of down_proj sees part of its input;
    type hadamard at a width that is not a power of two has no matrix in compressed-tensors or vLLM."""
    from quantkit.errors import UsageError
    from quantkit.evaluation import tensor_parallel
    from quantkit.finalization.checks import CalibrationOptions
    from quantkit.training import qat

    with pytest.raises(UsageError, match="online rotation \\(R4\\) would be lost"):
        qat.check_recipe(_r4_recipe(tmp_path, "random-hadamard"))
    with pytest.raises(UnsupportedModelError, match="input is 176 wide: use type: random-hadamard"):
        prepare(tiny_model_dir, _r4_recipe(tmp_path))
    options = CalibrationOptions(data=str(text_file), num_samples=2, seq_len=16)
    dst = finalize(tiny_model_dir, tmp_path / "out", _r4_recipe(tmp_path, "random-hadamard"), calibration=options).dst
    with pytest.raises(UnsupportedModelError, match="online transforms \\(R4\\).*evaluate it without --tp"):
        tensor_parallel.check(dst, 2)


def test_awq_leaves_the_down_projections_alone_under_r4_and_says_why(tiny_model_dir, text_file, tmp_path):
    """AWQ's scale cannot pass the online rotation between up_proj and down_proj: that group is left alone (the
    float function kept), the others are smoothed."""
    from quantkit.finalization.checks import CalibrationOptions

    path = tmp_path / "awq-r4.yaml"
    path.write_text("scheme: {weights: {dtype: int4, granularity: group, group_size: 32, symmetric: false}}\n"
                    "transforms: [{type: random-hadamard, rotations: [R4], online: true}]\n"
                    "algorithm: [{name: awq}, {name: rtn}]\nformat: compressed-tensors\nignore: [lm_head]\n")
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32)
    dst = finalize(tiny_model_dir, tmp_path / "out", resolve(str(path)), calibration=options).dst
    skipped = json.loads((dst / "quantkit.json").read_text())["calibration"]["skipped"]
    assert "the online rotation R4" in skipped["awq: mlp.down_proj"]


def _learned_recipe(tmp_path, base: str = "quarot-w4a8", steps: int = 3):
    """`base`'s recipe file with its rotations learned."""
    path = tmp_path / f"{base}-learned.yaml"
    text = Path(resolve(base).source).read_text()
    lines = [line for line in text.splitlines() if not line.startswith("transforms:")]
    path.write_text("\n".join(lines) + f"\ntransforms: [{{type: random-hadamard, rotations: [R1, R2], learn: {{steps: {steps}}}}}]\n")
    return resolve(str(path))


def test_a_learned_rotation_artifact_loads_in_plain_transformers_as_eval_q_computes(tiny_model_dir, text_file, tmp_path):
    """Learned on the calibration data, fused, and a plain model: transformers computes what `eval -q` does;
    quantkit.json records the learning, the transform_config states nothing it cannot describe."""
    from quantkit.finalization.checks import CalibrationOptions

    recipe = _learned_recipe(tmp_path)
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32, batch_size=2)
    prepared = prepare(tiny_model_dir, recipe, calibration=options)
    assert prepared.loading == "whole model in memory: the rotations are learned on the whole model"
    preview = quantize_model(prepared, recipe, calibration=options)
    result = finalize(tiny_model_dir, tmp_path / "out", recipe, calibration=options)
    info = json.loads((result.dst / "quantkit.json").read_text())["transforms"]
    assert info["learned"]["steps"] == 3 and info["learned"]["samples_per_step"] == 2
    assert info["applied"][0]["learn"] == {"steps": 3, "learning_rate": 1.5}
    assert not json.loads((result.dst / "config.json").read_text())["quantization_config"].get("transform_config")

    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); ids = torch.tensor({ids.tolist()}); "
            "torch.save(m(ids).logits, sys.argv[2])")
    out = tmp_path / "logits.pt"
    subprocess.run([sys.executable, "-c", code, str(result.dst), str(out)], check=True, capture_output=True)
    with torch.no_grad():
        expected = preview(ids).logits
    torch.testing.assert_close(torch.load(out, weights_only=True), expected, rtol=1e-4, atol=1e-4)


def test_learned_rotations_are_refused_where_they_cannot_train(tiny_model_dir, text_file, tmp_path):
    """Static activation scales have no value before calibration; QAT trains the weights, not the rotations;
    learning needs data."""
    from quantkit.errors import UsageError
    from quantkit.training import qat

    with pytest.raises(UsageError, match="learned rotations train against dynamic activations"):
        prepare(tiny_model_dir, _learned_recipe(tmp_path, "fp8-static"))
    with pytest.raises(UsageError, match="its rotations are learned by `finalize`"):
        qat.check_recipe(_learned_recipe(tmp_path))
    with pytest.raises(UsageError, match="pass --calib-data"):
        finalize(tiny_model_dir, tmp_path / "out", _learned_recipe(tmp_path))
    assert not (tmp_path / "out").exists()
