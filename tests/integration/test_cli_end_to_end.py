"""The installed `quantkit` command, run as a user runs it: real subprocesses, real exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.integration

QUANTKIT = [sys.executable, "-m", "quantkit.cli.main"]


def run(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("QUANTKIT_DEBUG", None)
    return subprocess.run([*QUANTKIT, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


def test_help_and_recipes_start_fast_without_torch():
    start = time.perf_counter()
    result = run("recipes", "list")
    assert result.returncode == 0 and "int4-weight-only" in result.stdout
    assert time.perf_counter() - start < 20  # generous: the real target (<1.5 s) is measured in the README
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, quantkit.cli.main; print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    assert probe.stdout.strip() == "False"


def test_finalize_then_eval_then_gate(tiny_model_dir, text_file, tmp_path):
    dst = tmp_path / "tiny-int4"
    done = run("finalize", tiny_model_dir, dst, "--quantize", "int4-weight-only")
    assert done.returncode == 0, done.stderr
    assert "14 of 15 Linear" in done.stdout and (dst / "quantkit.json").is_file()

    again = run("finalize", tiny_model_dir, dst, "--quantize", "int4-weight-only")
    assert again.returncode == 2 and "--overwrite" in again.stderr and "Traceback" not in again.stderr

    report = tmp_path / "r.json"
    ok = run("eval", tiny_model_dir, dst, "--data", text_file, "--seq-len", "64", "--json", report,
             "--baseline", tiny_model_dir, "--max-ppl-increase", "1000")
    assert ok.returncode == 0, ok.stderr
    results = json.loads(report.read_text())["results"]
    assert [r["recipe"] for r in results] == [None, "int4-weight-only"]
    assert results[1]["size_bytes"] < results[0]["size_bytes"]

    strict = run("eval", tiny_model_dir, dst, "--data", text_file, "--seq-len", "64",
                 "--baseline", tiny_model_dir, "--max-ppl-increase", "0")
    assert strict.returncode == 3 and "perplexity" in strict.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["finalize", "{missing}", "{tmp}/out", "-q", "int4-weight-only"], "does not exist"),
        (["finalize", "{text}", "{tmp}/out", "-q", "int4-weight-only"], "is a file"),
        (["finalize", "{model}", "{tmp}/out", "-q", "int4-weight-onyl"], "did you mean"),
        (["finalize", "{model}", "{tmp}/out", "-q", "float8-dynamic-act-float8-weight", "--format", "torchao"],
         "use --format compressed-tensors"),
        (["eval", "{model}", "--data", "{tmp}/nope.txt"], "does not exist"),
        (["eval", "{model}", "--data", "{empty}"], "has no text"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(tiny_model_dir, text_file, tmp_path, args, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    values = dict(missing=tmp_path / "missing", tmp=tmp_path, text=text_file, model=tiny_model_dir, empty=empty)
    result = run(*[a.format(**values) for a in args])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]
    assert not (tmp_path / "out").exists()


def test_interrupted_finalize_leaves_no_output(tiny_model_dir, tmp_path):
    """Ctrl-C (SIGINT) during a run: no DST, no temporary directory left behind."""
    import signal

    dst = tmp_path / "out"
    slow_write = (  # the weights are written; copying the tokenizer stalls, so the signal lands mid-write
        "import sys, time, quantkit.models.loading as m; copy = m.copy_tokenizer; "
        "m.copy_tokenizer = lambda *a: (time.sleep(60), copy(*a))[1]; "
        "from quantkit.cli.main import main; sys.argv = ['quantkit', *sys.argv[1:]]; main()"
    )
    args = ["finalize", str(tiny_model_dir), str(dst), "-q", "int8-weight-only", "--quiet"]
    proc = subprocess.Popen([sys.executable, "-c", slow_write, *args], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not any(".tmp-" in p.name for p in tmp_path.iterdir()):
        time.sleep(0.2)
    time.sleep(2.0)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert list(tmp_path.iterdir()) == []
    shutil.rmtree(dst, ignore_errors=True)


def test_learned_rotations_are_estimated_then_reported(tiny_model_dir, text_file, tmp_path):
    """The preflight counts learning's memory and time; the summary says what learning did."""
    recipe = tmp_path / "learned.yaml"
    recipe.write_text("scheme:\n  weights: {dtype: int4, granularity: group, group_size: 32}\n"
                      "  activations: {dtype: int8, granularity: token, dynamic: true, symmetric: false}\n"
                      "transforms: [{type: random-hadamard, rotations: [R1, R2], learn: {steps: 4}}]\n"
                      "format: compressed-tensors\nignore: [lm_head]\n")
    common = ["-q", recipe, "--calib-data", text_file, "--num-samples", "4", "--seq-len", "32"]
    dry = run("finalize", tiny_model_dir, tmp_path / "out", *common, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "learning the rotations" in dry.stdout and "s of rotations" in dry.stdout
    done = run("finalize", tiny_model_dir, tmp_path / "out", *common)
    assert done.returncode == 0, done.stderr
    assert "rotations learned" in done.stdout and "4 Cayley SGD steps of 4 samples" in done.stdout
    assert "each calibration sample was seen 4 times" in " ".join(done.stdout.split())  # 4 samples, 4 steps of 4
    assert "the rotations are learned on the whole model" in done.stdout


def test_qat_on_a_gguf_mixture_then_its_file(text_file, tmp_path):
    """`quantkit train cfg.yaml --qat-recipe gguf-q4-k-m && quantkit finalize runs/qat/final qat.gguf -q gguf-q4-k-m`:
    the convert step of a QAT model rounds on the K grids it trained on, so it needs no --calib-data (a plain
    model's gguf-q4-k-m is GPTQ, which does); another recipe is refused in one line."""
    import yaml

    from conftest import make_text
    from quantkit.models.tiny import train_tokenizer

    train_tokenizer(make_text(2000), 384).save_pretrained(tmp_path / "tok")
    model = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384, "max_position_embeddings": 128}
    config = {"model": {"config": model, "tokenizer": str(tmp_path / "tok")},
              "data": {"train": str(text_file), "seq_len": 32}, "output_dir": str(tmp_path / "runs" / "qat"),
              "train": {"micro_batch_size": 4, "global_batch_size": 4, "max_steps": 2, "warmup_steps": 1}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    trained = run("train", tmp_path / "cfg.yaml", "--qat-recipe", "gguf-q4-k-m", "--threads", "1", timeout=600)
    assert trained.returncode == 0, trained.stderr

    final = tmp_path / "runs" / "qat" / "final"
    other = run("finalize", final, tmp_path / "other.gguf", "-q", "gguf-q4-0")
    assert other.returncode == 2 and "--quantize gguf-q4-k-m" in other.stderr and "Traceback" not in other.stderr
    done = run("finalize", final, tmp_path / "qat.gguf", "-q", "gguf-q4-k-m", "--threads", "1", timeout=600)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "qat.gguf").is_file() and "calibration" not in done.stdout
