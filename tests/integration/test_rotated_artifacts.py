"""Rotation recipes end to end: the artifact is a plain model (transformers loads it, computing what `eval -q`
computes), a tied model is untied, and what a rotation cannot take is refused before any weight is read."""

import json
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
