"""The calibration pipeline on tiny Llama, Qwen2, Mistral, Qwen3, Gemma2, Gemma3, OLMo2, Phi-3, Granite and
Starcoder2 models, and the Mixtral, Qwen2-MoE and Qwen3-MoE mixtures of experts, built from configs: every
calibrated recipe (and, on MoE models, round-to-nearest) finalizes, reloads in plain transformers with logits equal
to the in-memory model, and keeps about one layer on the compute device."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from safetensors.torch import load_file, save_file

from conftest import make_text
from same_threads import environment, pinned
from quantkit.calibration import calibrate
from quantkit.errors import UnsupportedModelError
from quantkit.export.compressed_tensors import experts_problem, compression_format, loading_caveat
from quantkit.finalization.finalize import CalibrationOptions, calibration_samples, finalize, prepare, quantize_model
from quantkit.models.loading import decoder_layers, load_model
from quantkit.quant import registry

pytestmark = pytest.mark.integration


def _resolve(name: str) -> registry.Recipe:
    """A recipe name, or KV: int4-weight-only with `--kv-cache fp8-head`."""
    base, _, kv = name.partition("+kv-")
    return registry.with_kv_cache(registry.resolve(base), kv or None)


ARCHITECTURES = {"llama": {}, "qwen2": {}, "mistral": {}, "qwen3": {"head_dim": 16}, "gemma2": {"head_dim": 16},
                 "olmo2": {"pad_token_id": 0}, "phi3": {"pad_token_id": 0}, "gemma3_text": {"head_dim": 16},
                 "granite": {"residual_multiplier": 0.5},  # a scaled residual: the staged pass must notice
                 "starcoder2": {}}  # a non-gated MLP, LayerNorms and Linears with biases
MOE = {  # one layer each (the layer loop is the dense models' to test); Mixtral's experts are 64 -> 176 -> 64 wide: one
    # group size of 16 for all of them, a fallback compressed-tensors names by pattern
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
                  "shared_expert_intermediate_size": 64, "num_hidden_layers": 1},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 96, "head_dim": 16,
                  "num_hidden_layers": 1},
}
ARCHITECTURES.update(MOE)
STAGED = ["llama", "qwen2", "mistral", "qwen3", "phi3", "starcoder2"]  # GPTQ's staged pass reproduces these layers, not Gemma's
# extra norms, OLMo2's post-norms or Granite's scaled residual
RECIPES = [name for name in registry.recipe_names()  # GGUF files: tests/unit/export/test_gguf_export.py; MLX: tests/engines
           if registry.resolve(name).needs_calibration
           and registry.resolve(name).format not in (registry.Format.GGUF, registry.Format.MLX)]
# calibrated recipes whose algorithm another recipe already runs on every architecture, on another grid: their grid
# is tested on these architectures (a staged dense one, an unstaged one, an MoE one)
GRID_VARIANTS = {"nvfp4", "gptq-nvfp4-a16", "awq-nvfp4-a16", "gptq-w4a16-asym", "awq-w4a16-asym"}
GRID_ARCHITECTURES = {"llama", "gemma2", "qwen3_moe"}
AUTOROUND_STEPS = 4  # the shipped 200 steps a layer would make this sweep take minutes per architecture; 4 run the same code
# rotation recipes: on a dense, a fused-projection and an MoE architecture (the rest: tests/unit/quant/test_rotations.py)
ROTATED = {name for name in RECIPES if registry.resolve(name).transforms}
ROTATED_ARCHITECTURES = {"llama", "phi3", "qwen3_moe"}
CASES = [(arch, name) for arch in ARCHITECTURES for name in RECIPES
         if (name not in GRID_VARIANTS or arch in GRID_ARCHITECTURES) and (name not in ROTATED or arch in ROTATED_ARCHITECTURES)]
CASES += [(arch, "int4-weight-only") for arch in MOE]
# the KV cache's scales on the architectures whose attention differs (q/k norms, sliding windows, fused qkv_proj,
# biases, MoE), with a weight-only recipe
KV = "int4-weight-only+kv-fp8-head"
CASES += [(arch, KV) for arch in ("llama", "qwen3", "gemma2", "gemma3_text", "olmo2", "phi3", "starcoder2", "qwen3_moe")]
DENSE_CASES = [case for case in CASES if case[0] not in MOE]
# written for vLLM, not loadable by plain transformers (asymmetric pack-quantized: packed zero points); quantkit loads them
PLAIN_FAILS = {case for case in DENSE_CASES if loading_caveat(_resolve(case[1]))}
# plain transformers 5.24 with compressed-tensors 0.20 loads these but ignores the KV cache's scales (16-bit cache);
# quantkit's loader computes with the FP8 cache, as the in-memory model does
RELOADED_BY_QUANTKIT = PLAIN_FAILS | {case for case in CASES if case[1] == KV}


# transformers 5.17 to 5.20 dequantize compressed-tensors FP8 MoE experts into bfloat16 parameters whatever the model's
# dtype (their `DecompressExperts`), so the experts compute in bfloat16; 5.21 and later keep the model's dtype
FP8_EXPERTS_IN_BF16 = Version(transformers.__version__).release < (5, 21)


def _experts_mark(name: str):
    """transformers 5.23 dequantizes MoE experts while loading, right only for packed symmetric, FP8 and MXFP4 ones
    (`experts_caveat`): the others are xfails, strict, so that a transformers that loads them is noticed."""
    recipe = _resolve(name)
    problem = experts_problem(compression_format(recipe.scheme), recipe.scheme.weights.symmetric)
    return pytest.mark.xfail(strict=True, reason=f"transformers 5.23: {problem}") if problem else ()


MOE_CASES = [pytest.param(case, marks=_experts_mark(case[1]), id="-".join(case)) for case in CASES if case[0] in MOE]


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(make_text(4000, seed=9))
    return path


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from quantkit.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("arch")
    models = {arch: build_tiny_model(root / arch, make_text(3000), arch, **extra) for arch, extra in ARCHITECTURES.items()}
    _layernorms_off_their_init(models["starcoder2"])
    return models


def _layernorms_off_their_init(path: Path) -> None:
    """LayerNorm weights away from 1 and biases away from 0, as in a trained model: folded scales then change the
    biases, and an artifact that kept the source's biases would compute something else than the in-memory model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    generator = torch.Generator().manual_seed(3)
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.weight.data = torch.rand(module.weight.shape, generator=generator) + 0.5
            module.bias.data = torch.rand(module.bias.shape, generator=generator) - 0.5
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def artifacts(tiny_models, calib_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrated")
    options = CalibrationOptions(data=str(calib_file), num_samples=8, seq_len=32)
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    in_memory = {}
    for arch, name in CASES:
        recipe = _fast(_resolve(name))
        calibration = options if recipe.needs_calibration else None
        model = quantize_model(prepare(tiny_models[arch], recipe), recipe, calibration=calibration)
        with torch.no_grad(), pinned():  # the logits compared bit for bit with the reloading process's
            in_memory[(arch, name)] = model(ids).logits.float()
            if arch in MOE:
                in_memory[(arch, name, "experts")] = _experts_as_transformers_runs_them(model, ids, recipe)
        finalize(tiny_models[arch], root / f"{arch}-{name}", recipe, calibration=calibration)
    save_file({"input_ids": ids}, root / "ids.safetensors")
    script = Path(__file__).with_name("reload_plain.py")
    subprocess.run([sys.executable, str(script), str(root / "ids.safetensors"), str(root),
                    *[str(root / f"{arch}-{name}") for arch, name in CASES]], check=True, env=environment())
    for arch, name in RELOADED_BY_QUANTKIT:
        with torch.no_grad(), pinned():
            logits = load_model(root / f"{arch}-{name}")(ids).logits.float()
        saved = root / f"{arch}-{name}.safetensors"  # plain transformers' weights, where it loaded the artifact
        save_file({**(load_file(saved) if saved.exists() else {}), "logits": logits}, saved)
    return root, in_memory


def _fast(recipe: registry.Recipe) -> registry.Recipe:
    """AutoRound recipes with AUTOROUND_STEPS steps a layer; the others as they are."""
    step = recipe.quantizer
    if step.name != "autoround":
        return recipe
    fast = registry.AlgorithmStep(step.name, {**step.args, "iters": AUTOROUND_STEPS})
    return dataclasses.replace(recipe, steps=(*recipe.before_quantizer, fast))


def _experts_as_transformers_runs_them(model, ids, recipe: registry.Recipe) -> dict[str, torch.Tensor]:
    """The logits of the in-memory model with its experts' activations left unquantized (transformers dequantizes
    MoE experts while loading and runs them on float activations; vLLM quantizes them, as the in-memory model
    does), and its dequantized experts stacked as transformers fuses them (FP8 ones rounded to bfloat16, where it
    does that)."""
    from quantkit.models import moe
    rounded = FP8_EXPERTS_IN_BF16 and compression_format(recipe.scheme) == "float-quantized"
    for name in moe.expert_linears(model):
        model.get_submodule(name).quantization_enabled = False
        if rounded:
            weight = model.get_submodule(name).weight
            weight.data = weight.data.bfloat16().to(weight.dtype)
    found = {"logits": model(ids).logits.float()}
    for name, experts in moe.experts_modules(model).items():
        projections = [experts.expert(e).projections() for e in range(experts.num_experts)]
        found[f"{name}.gate_up_proj"] = torch.stack([torch.cat([g.weight, u.weight]) for g, u, _ in projections]).float()
        found[f"{name}.down_proj"] = torch.stack([d.weight for _, _, d in projections]).float()
    return found


@pytest.mark.parametrize("case", DENSE_CASES, ids=[f"{a}-{n}" for a, n in DENSE_CASES])
def test_reloaded_logits_equal_in_memory(artifacts, case):
    root, in_memory = artifacts
    reloaded = load_file(root / f"{case[0]}-{case[1]}.safetensors")["logits"]
    torch.testing.assert_close(reloaded, in_memory[case], atol=0, rtol=0)


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_artifact_reloads_with_the_experts_quantkit_quantized(artifacts, case):
    """Plain transformers merges the per-expert quantized weights into its fused experts, dequantized: they are the
    in-memory model's, and its logits are the in-memory model's with the experts' activations unquantized. For
    weight-only recipes that is the in-memory model itself."""
    root, in_memory = artifacts
    error = root / f"{case[0]}-{case[1]}.error.txt"
    assert not error.exists(), error.read_text()[:300]
    reloaded = load_file(root / f"{case[0]}-{case[1]}.safetensors")
    expected = in_memory[(*case, "experts")]
    fused = [name for name in expected if name != "logits"]
    assert fused and all(torch.equal(reloaded[name], expected[name]) for name in fused)
    assert torch.isfinite(reloaded["logits"]).all()
    in_bf16 = FP8_EXPERTS_IN_BF16 and compression_format(_resolve(case[1]).scheme) == "float-quantized"
    close = dict(rtol=1.6e-2, atol=1e-3) if in_bf16 else dict(rtol=1e-5, atol=1e-6)  # the experts computing in bf16
    torch.testing.assert_close(reloaded["logits"], expected["logits"], **close)
    if _resolve(case[1]).scheme.activations is None:
        torch.testing.assert_close(reloaded["logits"], in_memory[case], **close)
    else:  # quantized activations in the experts: a small difference, and only there
        difference = (reloaded["logits"] - in_memory[case]).abs().max()
        assert 0 < difference < 0.1 * in_memory[case].abs().max()


@pytest.mark.parametrize("arch", MOE)
def test_moe_summary_counts_routed_tokens_and_quantizes_every_expert(artifacts, arch):
    import json

    root, _ = artifacts
    for recipe in ("gptq-w4a16", "awq-w4a16", "smoothquant-w8a8", "fp8-static"):
        info = json.loads((root / f"{arch}-{recipe}" / "quantkit.json").read_text())
        (counts,) = info["calibration"]["routed_tokens"].values()  # one MoE layer
        assert len(counts) == 4 and sum(counts) == 8 * 32 * 2  # samples x tokens x top-2
        assert info["calibration"]["skipped"] == {}  # AWQ and SmoothQuant fold into the norm the experts read
        kept = info["modules"]["coverage"]["full_precision"]
        notes = info["modules"]["coverage"]["notes"]  # says so where plain transformers cannot load the experts
        assert (notes and "cannot run this recipe's MoE experts" in notes[0]) if recipe == "smoothquant-w8a8" else notes == []
        assert not [k for k in kept if ".experts." in k["tensor"]]
        assert {k["reason"] for k in kept if k["tensor"].endswith("mlp.gate.weight")} == {"an MoE router or gate (kept in full precision; vLLM serves them unquantized)"}


def test_calibration_changes_the_rounding(artifacts, tiny_models):
    """GPTQ does not just round to nearest: some weights differ from RTN's on the same grid."""
    from quantkit.grids import fake_quantize_weight

    root, _ = artifacts
    gptq = load_file(root / "llama-gptq-w4a16.safetensors")["model.layers.0.mlp.up_proj"]
    source = load_file(tiny_models["llama"] / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    recipe = registry.resolve("gptq-w4a16")
    (entry,) = [e for e in prepare(tiny_models["llama"], recipe).plan if e.name == "model.layers.0.mlp.up_proj"]
    rtn = fake_quantize_weight(source, entry.scheme.weights)
    assert not torch.equal(gptq, rtn)
    assert (gptq - source).abs().max() < 8 * (rtn - source).abs().max()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_gptq_runs_true_sequential_where_the_stages_reproduce_the_layer(artifacts, arch):
    import json

    root, _ = artifacts
    info = json.loads((root / f"{arch}-gptq-w4a16" / "quantkit.json").read_text())["calibration"]
    if arch in STAGED:
        assert info["gptq_order"].startswith("true-sequential")
        assert "forward" in info["seconds"] and "propagate" not in info["seconds"]
    else:
        assert info["gptq_order"] == "layer-wise" and "propagate" in info["seconds"]


def test_the_time_split_counts_the_streamed_reads_and_writes_within_calibrations_wall(artifacts):
    """quantkit.json's calibration phases: beside the algorithm's, the waits for a streamed layer's read and the
    layer before it's write, and the hand-off of a finished layer; all within the calibration's own wall time."""
    import json

    root, _ = artifacts
    info = json.loads((root / "llama-gptq-w4a16" / "quantkit.json").read_text())["calibration"]
    seconds = info["seconds"]
    assert {"capture", "observe", "quantize", "read", "write", "hand-off"} <= set(seconds)
    assert all(value >= 0 for value in seconds.values())
    assert sum(seconds.values()) <= info["wall_seconds"] + 0.01  # rounded to the millisecond, each


def test_folding_is_skipped_and_reported_where_no_norm_feeds_the_linears(artifacts):
    """OLMo2 normalises after attention and MLP: q/k/v and gate/up read the residual stream, so AWQ keeps only its
    v -> o and up -> down mappings and SmoothQuant has nothing to fold into; both say so."""
    import json

    root, _ = artifacts
    for recipe, step in (("awq-w4a16", "awq"), ("smoothquant-w8a8", "smoothquant")):
        skipped = json.loads((root / f"olmo2-{recipe}" / "quantkit.json").read_text())["calibration"]["skipped"]
        assert set(skipped) == {f"{step}: self_attn.q_proj, self_attn.k_proj, self_attn.v_proj", f"{step}: mlp.gate_proj, mlp.up_proj"}
        llama = json.loads((root / f"llama-{recipe}" / "quantkit.json").read_text())["calibration"]["skipped"]
        assert llama == {}


def test_awq_skips_the_pair_a_non_linear_activation_separates(artifacts):
    """Starcoder2's MLP is c_proj(gelu(c_fc(x))): AWQ folds into both LayerNorms but not between c_fc and c_proj,
    and says so; SmoothQuant (norms only) skips nothing."""
    import json

    from quantkit.models.architectures import STARCODER2

    root, _ = artifacts
    awq = json.loads((root / "starcoder2-awq-w4a16" / "quantkit.json").read_text())["calibration"]["skipped"]
    assert list(awq) == [f"awq: {STARCODER2.down}"] and "non-linear" in awq[f"awq: {STARCODER2.down}"]
    assert json.loads((root / "starcoder2-smoothquant-w8a8" / "quantkit.json").read_text())["calibration"]["skipped"] == {}


def test_smoothquant_keeps_starcoder2_near_the_float_model(artifacts, tiny_models):
    """W8A8 after folding into LayerNorms with biases: logits within 5% of the float model's (measured 1.3%; with
    the biases left unfolded, 73%)."""
    from transformers import AutoModelForCausalLM

    root, _ = artifacts
    ids = load_file(root / "ids.safetensors")["input_ids"]
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(tiny_models["starcoder2"])(ids).logits.float()
    reloaded = load_file(root / "starcoder2-smoothquant-w8a8.safetensors")["logits"]
    assert (reloaded - reference).norm() < 0.05 * reference.norm()


def test_static_scales_are_written(artifacts):
    import json

    root, _ = artifacts
    config = json.loads((root / "llama-fp8-static" / "config.json").read_text())["quantization_config"]
    acts = config["config_groups"]["group_0"]["input_activations"]
    assert (acts["dynamic"], acts["strategy"]) == (False, "tensor")
    tensors = load_file(next((root / "llama-fp8-static").glob("*.safetensors")))
    scales = [v for k, v in tensors.items() if k.endswith("input_scale")]
    assert scales and all(float(s) > 0 for s in scales)


def test_device_memory_stays_near_one_layer(tiny_models, calib_file):
    """Bytes held on the compute device: one decoder layer plus the calibration activations, never the model."""
    from quantkit.models.loading import load_model
    from quantkit.quant.plan import plan_model

    recipe = registry.resolve("gptq-w4a16")
    src = tiny_models["llama"]
    model = load_model(src)
    samples = calibration_samples(src, recipe, CalibrationOptions(data=str(calib_file), num_samples=8, seq_len=32))
    result = calibrate(model, plan_model(model, recipe), recipe, samples, torch.device("cpu"))
    layer_bytes = sum(p.numel() * p.element_size() for p in decoder_layers(model)[0].parameters())
    activation_bytes = samples.numel() * model.config.hidden_size * 4
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert layer_bytes < result.peak_device_bytes <= layer_bytes + 3 * activation_bytes
    assert result.peak_device_bytes < model_bytes
    assert set(result.qweights) == {e.name for e in plan_model(model, recipe) if e.quantized}
    assert all(0 <= err < 1 for err in result.errors.values())


def test_missing_calibration_data_is_a_usage_error(tiny_models, tmp_path):
    from quantkit.errors import UsageError

    with pytest.raises(UsageError, match="--calib-data"):
        finalize(tiny_models["llama"], tmp_path / "out", registry.resolve("gptq-w4a16"))
    assert not (tmp_path / "out").exists()


def test_unknown_architecture_names_what_is_missing():
    class Odd(torch.nn.Module):
        base_model_prefix = "transformer"

    with pytest.raises(UnsupportedModelError, match="decoder layers at model.transformer.layers"):
        decoder_layers(Odd())


def test_awq_block_error_is_no_worse_than_rtn(tiny_models, calib_file):
    """On the tiny Llama's first MLP, the searched AWQ scales give a block output error <= plain RTN's."""
    from quantkit.algorithms.awq import search_scales
    from quantkit.calibration.hooks import capture_inputs
    from quantkit.calibration.steps.awq import block_error, capture_blocks
    from quantkit.models.loading import load_model
    from quantkit.quant.plan import plan_model

    recipe = registry.resolve("awq-w4a16")
    src = tiny_models["llama"]
    model = load_model(src)
    plan = {e.name: e for e in plan_model(model, recipe)}
    samples = calibration_samples(src, recipe, CalibrationOptions(data=str(calib_file), num_samples=8, seq_len=32))
    layers = decoder_layers(model)
    inputs = capture_inputs(model, layers, list(samples.split(4)), torch.device("cpu"))
    layer = layers[0]
    linears = [layer.mlp.gate_proj, layer.mlp.up_proj]
    specs = [plan[f"model.layers.0.mlp.{n}"].scheme.weights for n in ("gate_proj", "up_proj")]
    ((calls, act, _, _),) = capture_blocks(layer, [(layer.mlp, layer.mlp.gate_proj)], inputs)
    reference = [layer.mlp(*a, **k) for a, k in calls]
    error_of = lambda s: block_error(layer.mlp, calls, reference, linears, specs, s)  # noqa: E731
    _, awq_error = search_scales(act.mean(), error_of)
    rtn_error = error_of(torch.ones(layer.mlp.gate_proj.in_features))
    assert awq_error <= rtn_error


def test_kv_cache_scales_are_written_per_head_for_every_attention(artifacts, tiny_models):
    """Each attention module of each architecture carries its k_scale and v_scale, one per key/value head, in the
    model's dtype; the reload test above runs them in compressed-tensors' quantized cache."""
    import json

    from transformers import AutoConfig

    root, _ = artifacts
    for arch, name in CASES:
        if name != KV:
            continue
        config = AutoConfig.from_pretrained(tiny_models[arch])
        tensors = load_file(root / f"{arch}-{name}" / "model.safetensors")
        scales = {k: t for k, t in tensors.items() if k.endswith((".k_scale", ".v_scale"))}
        assert len(scales) == 2 * config.num_hidden_layers, arch
        assert all(t.shape == (config.num_key_value_heads, 1, 1) and t.dtype == torch.float32 and (t > 0).all()
                   for t in scales.values()), arch
        scheme = json.loads((root / f"{arch}-{name}" / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
        assert scheme["strategy"] == "attn_head" and scheme["type"] == "float" and scheme["num_bits"] == 8


def test_calibration_reads_the_text_field_asked_for(tiny_model_dir, tmp_path):
    """`finalize --text-field NAME`: the .jsonl field that holds the text; without it, the error says so."""
    from quantkit.errors import DataError

    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"content": make_text(300, seed=i)}) + "\n" for i in range(4)))
    recipe = registry.resolve("gptq-w4a16")
    options = CalibrationOptions(data=str(calib), num_samples=4, seq_len=32)
    with pytest.raises(DataError, match=r"has no field 'text' \(fields: content\); pass --text-field NAME"):
        calibration_samples(tiny_model_dir, recipe, options)
    samples = calibration_samples(tiny_model_dir, recipe, dataclasses.replace(options, text_field="content"))
    assert samples.shape == (4, 32)
