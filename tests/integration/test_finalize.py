"""finalize for every recipe x format that runs on CPU: the artifact reloads with plain transformers in a fresh
process, its logits equal the in-memory quantized model's, and its weights equal the scheme's fake-quantized
weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit import hardware, registry
from quantkit.export import exporter
from quantkit.finalize import finalize, prepare, quantize_model
from quantkit.qparams import fake_quantize_weight
from quantkit.registry import Format

pytestmark = pytest.mark.integration

CASES = [
    (name, fmt)
    for name in registry.recipe_names()
    for fmt in Format
    if hardware.missing_requirement(registry.resolve(name), fmt) is None
    and exporter(fmt).unsupported(registry.resolve(name)) is None
    and not registry.resolve(name).needs_calibration
]
IDS = [f"{name}-{fmt.value}" for name, fmt in CASES]


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def artifacts(tiny_model_dir, tmp_path_factory, input_ids):
    """Finalize every case once; keep the in-memory logits; reload all in one plain-transformers process."""
    root = tmp_path_factory.mktemp("artifacts")
    in_memory = {}
    for name, fmt in CASES:
        recipe = registry.resolve(name)
        model = quantize_model(prepare(tiny_model_dir, recipe, fmt), recipe)
        with torch.no_grad():
            in_memory[(name, fmt)] = model(input_ids).logits.float()
        finalize(tiny_model_dir, root / f"{name}-{fmt.value}", recipe, fmt)
    save_file({"input_ids": input_ids}, root / "ids.safetensors")
    script = Path(__file__).with_name("reload_plain.py")
    dirs = [str(root / f"{name}-{fmt.value}") for name, fmt in CASES]
    subprocess.run([sys.executable, str(script), str(root / "ids.safetensors"), str(root), *dirs], check=True)
    return root, in_memory


def test_every_round_to_nearest_recipe_has_a_cpu_format():
    rtn = {name for name in registry.recipe_names() if not registry.resolve(name).needs_calibration}
    assert {name for name, _ in CASES} == rtn


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reloaded_logits_equal_in_memory(artifacts, case):
    root, in_memory = artifacts
    name, fmt = case
    reloaded = load_file(root / f"{name}-{fmt.value}.safetensors")
    torch.testing.assert_close(reloaded["logits"], in_memory[case], atol=0, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reloaded_weights_equal_scheme_fake_quant(artifacts, tiny_model_dir, case):
    root, _ = artifacts
    name, fmt = case
    recipe = registry.resolve(name)
    reloaded = load_file(root / f"{name}-{fmt.value}.safetensors")
    source = load_file(tiny_model_dir / "model.safetensors")
    plan = prepare(tiny_model_dir, recipe, fmt).plan
    assert any(entry.quantized for entry in plan)
    for entry in plan:
        original = source[f"{entry.name}.weight"]
        expected = fake_quantize_weight(original, entry.scheme.weights) if entry.quantized else original
        torch.testing.assert_close(reloaded[entry.name], expected.float(), atol=0, rtol=0, msg=entry.name)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_artifact_files_and_metadata(artifacts, tiny_model_dir, case):
    root, _ = artifacts
    name, fmt = case
    out = root / f"{name}-{fmt.value}"
    assert list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == fmt.value
    info = json.loads((out / "quantkit.json").read_text())
    assert info["recipe"]["name"] == name and info["format"] == fmt.value
    assert set(info["versions"]) >= {"quantkit", "torch", "torchao", "transformers", "compressed-tensors"}
    assert info["source"]["fingerprint"].startswith("sha256:")
    assert "lm_head" in [item["module"] for item in info["modules"]["left_out"]]
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]


def test_indivisible_group_size_falls_back_and_is_reported(artifacts):
    """The tiny model's MLP width 176 is not divisible by 128 or 32: the group size halves until it divides."""
    root, _ = artifacts
    info = json.loads((root / "int4-weight-only-compressed-tensors" / "quantkit.json").read_text())
    changed = {item["module"]: item["note"] for item in info["modules"]["group_size_changed"]}
    assert changed["model.layers.0.mlp.down_proj"] == "group size 128 -> 16 (input size 176)"
    config = json.loads((root / "int4-weight-only-compressed-tensors" / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"].values()
    assert any("model.layers.0.mlp.down_proj" in g["targets"] and g["weights"]["group_size"] == 16 for g in groups)


def test_bfloat16_model_round_trips(tiny_model_dir, tmp_path, input_ids):
    recipe = registry.resolve("int8-dynamic-act-int8-weight")
    result = finalize(tiny_model_dir, tmp_path / "bf16", recipe, dtype="bfloat16")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(result.dst)
    source = load_file(tiny_model_dir / "model.safetensors")
    with torch.no_grad():
        model(input_ids)  # compressed-tensors decompresses on the first forward
    weight = model.get_submodule("model.layers.0.self_attn.q_proj").weight.data
    expected = fake_quantize_weight(source["model.layers.0.self_attn.q_proj.weight"].bfloat16(), recipe.scheme.weights)
    torch.testing.assert_close(weight, expected, atol=0, rtol=0)
