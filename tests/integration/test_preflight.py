"""The preflight (`finalize --dry-run`, and the first line of a real run) against what the run then measured:
peak RAM within 20% and output size within 25% on a 136 MB bf16 Llama, for round-to-nearest (both formats) and GPTQ."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_text

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    return _bf16_llama(tmp_path_factory.mktemp("preflight") / "llama136m", tiny_model_dir, hidden_size=768,
                       intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12, vocab_size=16384)


def _bf16_llama(out: Path, tokenizer_from: Path, **shape) -> Path:
    """A bf16 Llama of random weights (seed 0) of this shape, with the tokenizer of `tokenizer_from`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_key_value_heads=shape["num_attention_heads"], max_position_embeddings=512, **shape)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("preflight-data") / "calib.txt"
    path.write_text(make_text(6000, seed=3))
    return path


def finalize(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit.cli.main", "finalize", *args, "--threads", "2"],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("recipe", ["int4-weight-only", "int8-dynamic-act-int4-weight", "nvfp4-a16", "gptq-w4a16"])
def test_estimates_are_within_a_fifth_of_the_measured_run(model_dir, calib, tmp_path, recipe):
    done = finalize(str(model_dir), str(tmp_path / "out"), "-q", recipe, "--calib-data", str(calib),
                    "--num-samples", "8", "--seq-len", "128", "--json", str(tmp_path / "run.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("preflight: peak RAM about")  # the first line, before anything is loaded
    run = json.loads((tmp_path / "run.json").read_text())
    estimate = run["preflight"]
    written = sum(f.stat().st_size for f in (tmp_path / "out").iterdir() if f.name != "quantkit.json")
    assert abs(estimate["output_bytes"] / written - 1) <= 0.25, (estimate["output_bytes"], written)
    assert abs(estimate["peak_ram_bytes"] / run["peak_ram_bytes"] - 1) <= 0.2, (estimate["peak_ram_breakdown"], run["peak_ram_bytes"])


def test_dry_run_estimates_the_artifact_in_the_dtype_the_run_writes(model_dir, tmp_path):
    """FP4 artifacts of a float32 model are bfloat16 (in either format): the dry run's output estimate is the real
    run's."""
    fmt = "torchao"
    dry = finalize(str(model_dir), str(tmp_path / "out"), "-q", "nvfp4-a16", "--format", fmt, "--dry-run", "--json", str(tmp_path / "dry.json"))
    run = finalize(str(model_dir), str(tmp_path / "out"), "-q", "nvfp4-a16", "--format", fmt, "--json", str(tmp_path / "run.json"))
    assert dry.returncode == 0 and run.returncode == 0, (dry.stderr[-2000:], run.stderr[-2000:])
    estimate = json.loads((tmp_path / "dry.json").read_text())["preflight"]["output_bytes"]
    assert estimate == json.loads((tmp_path / "run.json").read_text())["preflight"]["output_bytes"]
    written = sum(f.stat().st_size for f in (tmp_path / "out").iterdir() if f.name != "quantkit.json")
    assert abs(estimate / written - 1) <= 0.25, (estimate, written)


def test_dry_run_reports_memory_disk_and_a_measured_time_without_loading(model_dir, calib, tmp_path):
    done = finalize(str(model_dir), str(tmp_path / "out"), "-q", "gptq-w4a16", "--calib-data", str(calib),
                    "--num-samples", "16", "--seq-len", "64", "--nproc-per-node", "2", "--dry-run", "--json", "-")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)["preflight"]
    assert report["ranks"] == 2 and report["samples_per_rank"] == [8, 8]
    assert report["work_dir_bytes"] > 0 and report["fits_on_disk"] is True and report["free_disk_bytes"] > 0
    assert report["time"]["layers"] == 6 and report["time"]["one_layer_seconds"] > 0
    assert report["peak_ram_bytes"] == sum(report["peak_ram_breakdown"].values())
    assert not (tmp_path / "out").exists()
    table = finalize(str(model_dir), str(tmp_path / "out"), "-q", "int4-weight-only", "--dry-run")
    assert table.returncode == 0 and "peak RAM" in table.stdout and "disk at DST" in table.stdout


def test_autoround_dry_run_counts_the_float_models_hidden_states_and_every_ranks_samples(model_dir, calib, tmp_path):
    """AutoRound holds the float model's hidden states beside the quantized ones (and saves both for --resume), and
    on several ranks every rank's samples of the layer being tuned."""
    reports = {}
    for recipe in ("gptq-w4a16", "autoround-w4a16"):
        done = finalize(str(model_dir), str(tmp_path / "out"), "-q", recipe, "--calib-data", str(calib),
                        "--num-samples", "16", "--seq-len", "64", "--nproc-per-node", "2", "--dry-run", "--json", "-")
        assert done.returncode == 0, done.stderr[-2000:]
        reports[recipe] = json.loads(done.stdout)["preflight"]
    config = json.loads((model_dir / "config.json").read_text())
    element = 4 if (config.get("dtype") or config.get("torch_dtype")) == "float32" else 2
    one_stream = 16 * 64 * config["hidden_size"] * element  # every rank's samples' hidden states
    autoround = reports["autoround-w4a16"]
    assert autoround["work_dir_bytes"] - reports["gptq-w4a16"]["work_dir_bytes"] == 2 * one_stream
    breakdown = autoround["peak_ram_breakdown"]
    assert breakdown["AutoRound every rank's samples of the layer (inputs and targets)"] == 2 * one_stream
    assert breakdown["AutoRound float model's hidden states (before and after the layer, this rank)"] == one_stream
    assert autoround["autoround_passes_per_step"] == 2 and "autoround_passes_per_step" not in reports["gptq-w4a16"]
    # GPTQ on the CPU holds down_proj's inputs for this rank's 8 samples (o_proj's are freed first); AutoRound none
    held = "GPTQ's stage inputs (the MLP down projection's), held for every batch on the CPU"
    widest = config["intermediate_size"]
    assert reports["gptq-w4a16"]["peak_ram_breakdown"][held] == 8 * 64 * widest * element and held not in breakdown
    done = finalize(str(model_dir), str(tmp_path / "out"), "-q", "autoround-w4a16", "--calib-data", str(calib),
                    "--num-samples", "16", "--seq-len", "64", "--nproc-per-node", "3", "--dry-run", "--json", "-")
    three = json.loads(done.stdout)["preflight"]
    assert (three["ranks"], three["autoround_passes_per_step"]) == (3, 2)


def test_gptqs_staged_pass_counts_one_copy_of_the_hidden_states_unless_kv_scales_read_them(model_dir, calib, tmp_path):
    """GPTQ's staged pass builds the residual stream in the layer's inputs; KV cache scales, computed after it on
    those inputs, keep them, and the outputs beside them."""
    counted = {}
    for extra in ((), ("--kv-cache", "fp8")):
        done = finalize(str(model_dir), str(tmp_path / "out"), "-q", "gptq-w4a16", "--calib-data", str(calib),
                        "--num-samples", "16", "--seq-len", "64", "--dry-run", "--json", "-", *extra)
        assert done.returncode == 0, done.stderr[-2000:]
        counted[bool(extra)] = json.loads(done.stdout)["preflight"]["peak_ram_breakdown"]["calibration hidden states (this rank)"]
    config = json.loads((model_dir / "config.json").read_text())
    element = 4 if (config.get("dtype") or config.get("torch_dtype")) == "float32" else 2
    copy = 16 * 64 * config["hidden_size"] * element
    assert counted == {False: copy, True: 2 * copy}


def test_the_time_estimate_counts_the_rotations(model_dir, calib, tmp_path):
    """A rotated recipe's dry run times the rotation of one layer (with R4's hooks then in place for the timed
    calibration) and adds it for every layer, the embeddings and lm_head."""
    done = finalize(str(model_dir), str(tmp_path / "out"), "-q", "quarot-w4a8", "--dry-run", "--json", "-")
    assert done.returncode == 0, done.stderr[-2000:]
    timing = json.loads(done.stdout)["preflight"]["time"]
    assert 0 < timing["rotations_seconds"] <= timing["seconds"]
    plain = finalize(str(model_dir), str(tmp_path / "out"), "-q", "int8-dynamic-act-int4-weight", "--format",
                     "compressed-tensors", "--dry-run", "--json", "-")
    assert "rotations_seconds" not in json.loads(plain.stdout)["preflight"]["time"]


def test_streamed_round_to_nearest_holds_the_embeddings_and_lm_head_once(tmp_path, tiny_model_dir):
    """Where the embeddings and lm_head outweigh a decoder layer (a large vocabulary, as at 8B: 2.1 GB of 16), the
    streamed peak is the fixed cost plus them, once: safetensors maps them (no copy), and they are read at the end
    and written as they are. The estimate is within 15% of the measured peak."""
    src = _bf16_llama(tmp_path / "wide-vocab", tiny_model_dir, hidden_size=384, intermediate_size=1024,
                      num_hidden_layers=2, num_attention_heads=6, vocab_size=196608)
    done = finalize(str(src), str(tmp_path / "out"), "-q", "int4-weight-only", "--json", str(tmp_path / "run.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads((tmp_path / "run.json").read_text())
    estimate = run["preflight"]
    outside = "embeddings, final norm and lm_head (read at the start and at the end, held once)"
    assert estimate["peak_ram_breakdown"][outside] == 2 * 196608 * 384 * 2 + 384 * 2
    assert abs(estimate["peak_ram_bytes"] / run["peak_ram_bytes"] - 1) <= 0.15, (estimate["peak_ram_breakdown"], run["peak_ram_bytes"])
