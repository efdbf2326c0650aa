"""`quantkit eval --tp 2` through the real CLI on CPU (gloo): transformers' tensor parallelism shards a full-precision
Llama, a Qwen2-MoE (its experts split from transformers 5.21) and a compressed-tensors artifact with per-head FP8 KV cache scales, and each
gives the perplexity of one process; rank 0 alone prints and writes, and a failed gate is one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

from conftest import make_text

pytestmark = pytest.mark.integration

QUANTKIT = [sys.executable, "-m", "quantkit.cli.main"]
# transformers 5.17 to 5.20 keep MoE experts in the expert-parallel plan alone: `--tp` splits the rest of an MoE
# model and leaves every rank all the experts; 5.21 and later split them too
EXPERTS_SPLIT = Version(transformers.__version__).release >= (5, 21)
EVAL = ["--seq-len", "64", "--max-samples", "8", "--threads", "1"]


def run(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120"}
    env.pop("QUANTKIT_DEBUG", None)
    return subprocess.run([*QUANTKIT, *map(str, args)], capture_output=True, text=True, timeout=600, env=env)


def shardable(model_dir: Path, copies: Path) -> Path:
    """The model as it is where transformers splits an lm_head over ranks that do not divide its rows (5.21 and
    later); for older releases, which `check` refuses it for, a copy whose vocabulary 2 ranks divide (the tiny
    tokenizers' 425 words and a row that no token reaches)."""
    from transformers import AutoModelForCausalLM

    from quantkit.models import compat
    if compat.shards_rows_unevenly():
        return model_dir
    copy = shutil.copytree(model_dir, copies / model_dir.name)
    model = AutoModelForCausalLM.from_pretrained(copy)
    model.resize_token_embeddings(model.config.vocab_size + model.config.vocab_size % 2)
    model.save_pretrained(copy)
    return copy


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    from quantkit.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-moe", make_text(3000), "qwen2_moe", num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=96)


def test_two_ranks_measure_the_perplexity_of_one_process(tiny_model_dir, wide_model_dir, moe_model_dir, text_file, tmp_path):
    tiny_model_dir, wide_model_dir, moe_model_dir = (shardable(d, tmp_path) for d in (tiny_model_dir, wide_model_dir, moe_model_dir))
    artifact = tmp_path / "int4-kv-head"
    made = run("finalize", wide_model_dir, artifact, "-q", "int4-weight-only", "--kv-cache", "fp8-head",
               "--calib-data", text_file, "--num-samples", "4", "--seq-len", "64", "--quiet")
    assert made.returncode == 0, made.stderr
    models = [tiny_model_dir, moe_model_dir, artifact]
    gate = ["--baseline", tiny_model_dir, "--max-ppl-increase", "0.001"]  # the int4 artifact fails it
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    alone = run("eval", *models, "--data", text_file, *EVAL, *gate, "--json", one)
    sharded = run("eval", *models, "--data", text_file, *EVAL, *gate, "--json", two, "--tp", "2")
    assert alone.returncode == sharded.returncode == 3, sharded.stderr
    single, split = json.loads(one.read_text())["results"], json.loads(two.read_text())["results"]
    for model, a, b in zip(models, single, split, strict=True):
        assert b["perplexity"]["perplexity"] == pytest.approx(a["perplexity"]["perplexity"], rel=1e-4), b["path"]
        assert (a["tensor_parallel"], b["tensor_parallel"]) == (1, 2)
        assert len(b["peak_rss_per_rank"]) == 2 and min(b["peak_rss_per_rank"]) > 0
        (whole,), shares = a["weight_bytes_per_rank"], b["weight_bytes_per_rank"]
        held = 0.6 if model != moe_model_dir or EXPERTS_SPLIT else 0.95  # about half; the experts whole, where they stay
        assert len(shares) == 2 and max(shares) < held * whole <= held * sum(shares)
    assert sharded.stdout.count("quantkit eval") == 1 and "weights / rank" in sharded.stdout  # rank 0's table alone
    assert "sharded over 2 processes" in sharded.stdout
    assert sharded.stderr.strip().splitlines() == alone.stderr.strip().splitlines()  # the gate's line, no launcher line
    assert "perplexity" in sharded.stderr and "rank 0 of 2" not in sharded.stderr


def test_a_family_without_a_plan_is_refused_before_launching(tmp_path, text_file):
    from quantkit.models.tiny import build_tiny_model

    gpt2 = build_tiny_model(tmp_path / "gpt2", make_text(500), "gpt2", n_embd=64, n_layer=1, n_head=4)
    refused = run("eval", gpt2, "--data", text_file, "--tp", "2")
    assert refused.returncode == 2 and refused.stdout == ""
    (line,) = refused.stderr.strip().splitlines()
    assert "no tensor-parallel plan for 'gpt2' models" in line and " llama," in line
