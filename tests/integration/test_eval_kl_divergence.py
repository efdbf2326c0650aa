"""`quantkit eval --kl-divergence` as a user runs it: the float model against itself (divergence 0, agreement 1) and
against its quantized artifacts (compressed-tensors int4, torchao int8: above 0), the table's columns, --json's
fields, and --max-kld's gate on either side of the measured mean. The GGUF rows: tests/integration/test_eval_gguf.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def run(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("QUANTKIT_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "quantkit.cli.main", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def artifacts(tiny_model_dir, tmp_path_factory):
    """The tiny Llama finalized as compressed-tensors int4 and as torchao int8."""
    out = tmp_path_factory.mktemp("kld")
    made = {}
    for name, args in (("int4", ["-q", "int4-weight-only"]), ("int8-torchao", ["-q", "int8-weight-only", "--format", "torchao"])):
        done = run("finalize", tiny_model_dir, out / name, *args, "--quiet")
        assert done.returncode == 0, done.stderr
        made[name] = out / name
    return made


def test_the_model_against_itself_and_its_quantized_artifacts(tiny_model_dir, artifacts, text_file, tmp_path):
    report = tmp_path / "r.json"
    done = run("eval", tiny_model_dir, tiny_model_dir, artifacts["int4"], artifacts["int8-torchao"], "--data", text_file,
               "--seq-len", "64", "--kl-divergence", "--json", report)
    assert done.returncode == 0, done.stderr
    base, again, int4, int8 = json.loads(report.read_text())["results"]
    assert base["kl_divergence"] is None
    assert again["kl_divergence"] == {"reference": str(tiny_model_dir), "mean": 0.0, "median": 0.0, "p99": 0.0,
                                      "top1_agreement": 1.0, "perplexity_ratio": 1.0, "tokens": base["perplexity"]["tokens"]}
    for row in (int4, int8):
        found = row["kl_divergence"]
        assert found["mean"] > 0 and found["p99"] >= found["median"] > 0 and 0 < found["top1_agreement"] < 1
        assert found["perplexity_ratio"] == pytest.approx(row["perplexity"]["perplexity"] / base["perplexity"]["perplexity"])
        assert found["tokens"] == base["perplexity"]["tokens"]
    assert int4["kl_divergence"]["mean"] > int8["kl_divergence"]["mean"]  # 4 bits move the distributions more than 8
    header = next(line for line in done.stdout.splitlines() if "perplexity" in line and "model" in line)
    assert all(column in header for column in ("KLD mean", "KLD median", "KLD p99", "top-1", "ppl ratio"))
    first_row = next(line for line in done.stdout.splitlines() if line.startswith("│"))
    assert "reference" in first_row


def test_max_kld_fails_below_the_measured_mean_and_passes_above_it(tiny_model_dir, artifacts, text_file, tmp_path):
    report = tmp_path / "r.json"
    measured = run("eval", tiny_model_dir, artifacts["int4"], "--data", text_file, "--seq-len", "64", "--kl-divergence",
                   "--json", report, "--quiet")
    assert measured.returncode == 0, measured.stderr
    mean = json.loads(report.read_text())["results"][1]["kl_divergence"]["mean"]
    strict = run("eval", tiny_model_dir, artifacts["int4"], "--data", text_file, "--seq-len", "64", "--kl-divergence",
                 "--max-kld", f"{mean / 2:.6g}", "--quiet")
    assert strict.returncode == 3
    assert strict.stderr.strip().startswith(f"error: {artifacts['int4']}: mean KL divergence ") and "the limit is" in strict.stderr
    assert len(strict.stderr.strip().splitlines()) == 1 and "Traceback" not in strict.stderr
    lenient = run("eval", tiny_model_dir, artifacts["int4"], "--data", text_file, "--seq-len", "64", "--kl-divergence",
                  "--max-kld", f"{mean * 2:.6g}", "--quiet")
    assert lenient.returncode == 0, lenient.stderr


def test_one_model_alone_is_one_line_and_exit_2(tiny_model_dir, text_file):
    done = run("eval", tiny_model_dir, "--data", text_file, "--kl-divergence")
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: --kl-divergence compares each model with the first MODEL (the reference): pass at "
                                   "least one more MODEL, or -q RECIPE")
