"""`finalize --kv-cache`: the written key / value scales are the largest |key| (after RoPE) and |value| that
transformers' own cache holds when the weight-quantized model runs the calibration samples, over 448; the artifact
loads in plain transformers, and reloads through quantkit's loader computing with the quantized cache as the
in-memory model does; bad uses are one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache

from conftest import make_text
from quantkit.finalization.finalize import CalibrationOptions, calibration_samples, finalize, prepare, quantize_model
from quantkit.models.loading import load_model
from quantkit.quant import registry

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv") / "calib.txt"
    path.write_text(make_text(2000, seed=4))
    return path


def _options(calib) -> CalibrationOptions:
    return CalibrationOptions(data=str(calib), num_samples=6, seq_len=24, batch_size=4)


@pytest.mark.parametrize("choice", ["fp8", "fp8-head"])
def test_scales_are_the_cached_keys_and_values_absmax_over_448(tiny_model_dir, calib, tmp_path, choice):
    plain = registry.resolve("int4-weight-only")
    recipe = registry.with_kv_cache(plain, choice)
    result = finalize(tiny_model_dir, tmp_path / "out", recipe, calibration=_options(calib))
    written = load_file(tmp_path / "out" / "model.safetensors")

    model = quantize_model(prepare(tiny_model_dir, plain), plain)  # the same weights, no quantized cache
    samples = calibration_samples(tiny_model_dir, recipe, _options(calib))
    absmax: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for batch in samples.split(4):
            cache = DynamicCache(config=model.config)
            model(batch, past_key_values=cache, use_cache=True)
            for i, layer in enumerate(cache.layers):
                for which, states in (("k", layer.keys), ("v", layer.values)):
                    seen = states.abs().amax(dim=(0, 2, 3)) if choice == "fp8-head" else states.abs().amax()
                    key = f"model.layers.{i}.self_attn.{which}_scale"
                    absmax[key] = torch.maximum(absmax[key], seen) if key in absmax else seen
    assert len(absmax) == 4
    for key, value in absmax.items():
        expected = (value / 448).reshape(-1, 1, 1) if choice == "fp8-head" else (value / 448).reshape(1)
        torch.testing.assert_close(written[key], expected, rtol=1e-6, atol=0)
    kv = result.calibration["kv_cache"]
    assert kv["attention_modules"] == 2 and kv["max_abs_key"] == pytest.approx(max(absmax[k].max().item() for k in absmax if ".k_" in k))


def test_the_reloaded_artifact_computes_with_the_quantized_cache(tiny_model_dir, calib, tmp_path):
    recipe = registry.with_kv_cache(registry.resolve("int4-weight-only"), "fp8")
    finalize(tiny_model_dir, tmp_path / "kv", recipe, calibration=_options(calib))
    finalize(tiny_model_dir, tmp_path / "plain", registry.resolve("int4-weight-only"))
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    in_memory = quantize_model(prepare(tiny_model_dir, recipe), recipe, calibration=_options(calib))
    with torch.no_grad():
        expected = in_memory(ids).logits
        kv = load_model(tmp_path / "kv")(ids).logits  # what `quantkit eval` computes
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")(ids).logits
        assert AutoModelForCausalLM.from_pretrained(tmp_path / "kv")(ids).logits.isfinite().all()
    torch.testing.assert_close(kv, expected, atol=0, rtol=0)
    assert 0 < (kv - plain).abs().max() < 0.05 * plain.abs().max()  # FP8 keys and values: a small change
    config = json.loads((tmp_path / "kv" / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["strategy"] == "tensor"
    info = json.loads((tmp_path / "kv" / "quantkit.json").read_text())
    assert info["recipe"]["kv_cache"] == {"dtype": "float8_e4m3fn", "granularity": "tensor", "observer": "static_minmax"}


@pytest.mark.parametrize("extra,message", [
    ((), "error: the KV cache's scales are measured on data: pass --calib-data FILE"),
    (("--calib-data", "CALIB", "--format", "torchao"), "torchao artifacts carry no KV cache scales"),
    (("--kv-cache", "int8"), "error: --kv-cache 'int8' is not allowed; use fp8, fp8-head or none"),
])
def test_bad_kv_cache_uses_are_one_line(tiny_model_dir, calib, tmp_path, extra, message):
    args = [str(calib) if a == "CALIB" else a for a in extra]
    if "--kv-cache" not in args:
        args += ["--kv-cache", "fp8"]
    done = subprocess.run([sys.executable, "-m", "quantkit.cli.main", "finalize", str(tiny_model_dir), str(tmp_path / "out"),
                           "-q", "int4-weight-only", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not list(tmp_path.iterdir())
