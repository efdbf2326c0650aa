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

from quantkit.export import ct_compat, exporter
from quantkit.export.compressed_tensors import loading_caveat
from quantkit.export.torchao import torchao_config
from quantkit.finalization.finalize import finalize, prepare, quantize_model
from quantkit.models import loading as models
from quantkit.models.architectures import kernel_fused_groups
from quantkit.quant import registry
from quantkit.grids import fake_quantize_weight
from quantkit.grids.qparams import fused_global_scales
from quantkit.quant.registry import Format
from quantkit.grids.schemes import Granularity
from quantkit.finalization import checks

from same_threads import environment, pinned

pytestmark = pytest.mark.integration

CASES = [
    (name, fmt)
    for name in registry.recipe_names()
    for fmt in Format
    if fmt is not Format.GGUF  # one file for llama.cpp, not reloaded by transformers: tests/unit/export/test_gguf_export.py
    and fmt is not Format.MLX  # mlx-lm's, not transformers': tests/unit/export/test_mlx.py, tests/engines/test_mlx_lm.py
    and checks.missing_requirement(registry.resolve(name), fmt) is None
    and exporter(fmt).unsupported(registry.resolve(name)) is None
    and not registry.resolve(name).needs_calibration
]
IDS = [f"{name}-{fmt.value}" for name, fmt in CASES]
# written for vLLM, not loadable by plain transformers (asymmetric pack-quantized: packed zero points; with compressed-tensors
# 0.17, FP8 blocks one block wide); quantkit loads them
PLAIN_FAILS = {case for case in CASES if case[1] is Format.COMPRESSED_TENSORS and loading_caveat(registry.resolve(case[0]))}


def _source(name: str, tiny: Path, wide: Path) -> Path:
    """FP8 blocks of 128x128 fit none of the tiny model's Linears: those recipes take the wide one."""
    return wide if registry.resolve(name).scheme.weights.granularity is Granularity.BLOCK else tiny


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def artifacts(tiny_model_dir, wide_model_dir, tmp_path_factory, input_ids):
    """Finalize every case once; keep the in-memory logits; reload all in one plain-transformers process (the
    artifacts plain transformers cannot load: with quantkit's loader, in this process)."""
    root = tmp_path_factory.mktemp("artifacts")
    in_memory = {}
    for name, fmt in CASES:
        recipe, src = registry.resolve(name), _source(name, tiny_model_dir, wide_model_dir)
        model = quantize_model(prepare(src, recipe, fmt), recipe)
        with torch.no_grad(), pinned():  # the logits compared bit for bit with the reloading process's
            in_memory[(name, fmt)] = model(input_ids).logits.float()
        finalize(src, root / f"{name}-{fmt.value}", recipe, fmt)
    save_file({"input_ids": input_ids}, root / "ids.safetensors")
    script = Path(__file__).with_name("reload_plain.py")
    dirs = [str(root / f"{name}-{fmt.value}") for name, fmt in CASES]
    subprocess.run([sys.executable, str(script), str(root / "ids.safetensors"), str(root), *dirs], check=True, env=environment())
    for name, fmt in PLAIN_FAILS:
        model = models.load_model(root / f"{name}-{fmt.value}")
        with torch.no_grad(), pinned():
            tensors = {"logits": model(input_ids).logits.float()}
        tensors.update({n: m.weight.data.float() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        save_file(tensors, root / f"{name}-{fmt.value}.safetensors")
    return root, in_memory


@pytest.mark.parametrize("case", sorted(PLAIN_FAILS), ids=lambda case: case[0])
def test_asymmetric_packed_artifacts_need_quantkits_loader(artifacts, case):
    """Plain transformers (5.23, compressed-tensors 0.20) cannot load them: when it can, this fails, so that the
    caveat and the loader's fix get dropped."""
    root, _ = artifacts
    error = root / f"{case[0]}-{case[1].value}.error.txt"
    # the packed zero points' shapes; compressed-tensors 0.17's FP8 blocks taken for channels
    expected = "must match the size" if registry.resolve(case[0]).scheme.weights.granularity is Granularity.BLOCK else "ignore_mismatched_sizes"
    assert error.is_file() and expected in error.read_text()


def test_every_round_to_nearest_recipe_has_a_cpu_format():
    """Every round-to-nearest recipe has a CPU case, except those the installed compressed-tensors release cannot
    pack (3-bit weights under 0.17, `make test-lowest`), which say so."""
    rtn = {name for name in registry.recipe_names()
           if not registry.resolve(name).needs_calibration and registry.resolve(name).format not in (Format.GGUF, Format.MLX)}
    too_old = {name for name in rtn if ct_compat.cannot_pack(registry.resolve(name).scheme.weights.dtype.bits)}
    assert {name for name, _ in CASES} == rtn - too_old
    for name in too_old:
        assert "compressed-tensors >= 0.18" in exporter(Format.COMPRESSED_TENSORS).unsupported(registry.resolve(name))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reloaded_logits_equal_in_memory(artifacts, case):
    root, in_memory = artifacts
    name, fmt = case
    reloaded = load_file(root / f"{name}-{fmt.value}.safetensors")
    torch.testing.assert_close(reloaded["logits"], in_memory[case], atol=0, rtol=0)


def _torchao_float_grid(weight: torch.Tensor, scheme) -> torch.Tensor:
    """What torchao's config for the scheme makes of `weight`, dequantized: its float grids divide in float32 where
    the scheme (compressed-tensors) divides in the weight's dtype (tests/unit/test_qparams.py bounds the difference)."""
    from torchao.quantization import quantize_

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data = weight.clone()
    quantize_(linear, torchao_config(scheme))
    return linear.weight.dequantize(weight.dtype)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reloaded_weights_equal_scheme_fake_quant(artifacts, tiny_model_dir, wide_model_dir, case):
    """NVFP4: with one global scale per kernel-fused group (q/k/v, gate/up), as vLLM needs; in the torchao format,
    each Linear's own, on torchao's float32 arithmetic."""
    root, _ = artifacts
    name, fmt = case
    recipe, src = registry.resolve(name), _source(name, tiny_model_dir, wide_model_dir)
    reloaded = load_file(root / f"{name}-{fmt.value}.safetensors")
    source = load_file(src / "model.safetensors")
    if recipe.fused_rotations:  # the grid of the rotated model, rotated here whole (finalize rotates as it streams)
        from quantkit.models.loading import load_model
        from quantkit.quant.rotations import Rotator

        model = load_model(src)
        Rotator.of(recipe, model.config).rotate_model(model)
        source = {key: value.detach() for key, value in model.state_dict().items()}
    plan = prepare(src, recipe, fmt).plan
    assert any(entry.quantized for entry in plan)
    dtype = getattr(torch, json.loads((root / f"{name}-{fmt.value}" / "config.json").read_text())["dtype"])
    source = {key: value.to(dtype) for key, value in source.items()}  # FP4 / MX artifacts of a float32 model: bf16
    nvfp4 = {e.name: source[f"{e.name}.weight"] for e in plan if e.quantized and e.scheme.weights.global_scale}
    global_scales = fused_global_scales(nvfp4, kernel_fused_groups(list(nvfp4)))
    for entry in plan:
        original = source[f"{entry.name}.weight"]
        if not entry.quantized:
            expected = original
        elif fmt is Format.TORCHAO and entry.scheme.weights.dtype.is_float:
            expected = _torchao_float_grid(original, entry.scheme)
        else:  # the recipe's data-free quantizer (round to nearest: the scheme's fake quantization; HQQ: its own)
            quantizer, args = recipe.quantizer.algorithm, recipe.quantizer.arguments
            expected = quantizer.quantize_weight(original, entry.scheme.weights, args, global_scales.get(entry.name))
            expected = expected.dequantize(original.dtype)
            if quantizer.qat_ready:  # and that is the fake quantization QAT trains through
                torch.testing.assert_close(expected, fake_quantize_weight(original, entry.scheme.weights,
                                                                          global_scales.get(entry.name)), atol=0, rtol=0)
        torch.testing.assert_close(reloaded[entry.name], expected.float(), atol=0, rtol=0, msg=entry.name)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_artifact_files_and_metadata(artifacts, case):
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


@pytest.mark.parametrize("name", ["nvfp4-a16", "mxfp8"])
def test_float32_fp4_and_mx_artifacts_run_with_quantkits_loader(artifacts, tmp_path, input_ids, name):
    """LLM Compressor keeps a float32 model float32; compressed-tensors 0.20 decompresses FP4 / MX weights to
    bfloat16 whatever the model's dtype, and plain transformers then fails its first forward. quantkit's loader
    gives the decompressed weights the model's dtype: the logits equal the bfloat16 artifact's up to the float32
    activations."""
    root, in_memory = artifacts
    src, out = root / f"{name}-compressed-tensors", tmp_path / "float32"
    out.mkdir()
    for path in src.iterdir():
        if path.suffix == ".safetensors":
            tensors = load_file(path)
            save_file({k: t.float() if t.dtype == torch.bfloat16 and k.endswith(("weight", "bias")) else t for k, t in tensors.items()}, out / path.name)
        elif path.name == "config.json":
            config = json.loads(path.read_text())
            config["dtype"] = "float32"
            (out / path.name).write_text(json.dumps(config))
        elif path.is_file():
            (out / path.name).write_bytes(path.read_bytes())
    from transformers import AutoModelForCausalLM

    with pytest.raises(RuntimeError, match="same dtype"), torch.no_grad():
        AutoModelForCausalLM.from_pretrained(out)(input_ids)  # when this passes, the loader's cast can go
    model = models.load_model(out)
    assert model.dtype == torch.float32
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, in_memory[(name, Format.COMPRESSED_TENSORS)], atol=0.05, rtol=0.05)


@pytest.mark.parametrize("case", [case for case in CASES if case[1] is Format.COMPRESSED_TENSORS], ids=lambda case: case[0])
def test_the_written_quantization_config_validates_in_compressed_tensors(artifacts, case):
    """The `quantization_config` in config.json, read back by compressed-tensors' own model, says what was written."""
    from compressed_tensors.quantization import QuantizationConfig

    root, _ = artifacts
    name, fmt = case
    written = json.loads((root / f"{name}-{fmt.value}" / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(written)
    assert config.format == written["format"] and config.quant_method == "compressed-tensors"
    assert set(config.config_groups) == set(written["config_groups"]) and config.ignore == written["ignore"]
    for group, scheme in config.config_groups.items():
        assert scheme.targets == written["config_groups"][group]["targets"]
        dumped = scheme.weights.model_dump(mode="json")
        assert dumped == {**dumped, **written["config_groups"][group]["weights"]}
