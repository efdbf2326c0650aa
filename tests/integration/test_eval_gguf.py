"""`quantkit eval` of a GGUF file in llama.cpp, beside the Hugging Face model it was written from: the same windows,
and a Q8_0 copy's perplexity within 1% of the float model's. Needs llama-cpp-python (the `gguf` extra) and quantkit's
GGUF writer (`quantkit finalize SRC OUT.gguf -q gguf-q8-0`); skipped, saying what to install, without the first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

pytest.importorskip("llama_cpp", reason="needs llama-cpp-python: pip install 'quantkit-llm[gguf]'")


def run_quantkit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit.cli.main", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def q8_gguf(tiny_model_dir, tmp_path_factory):
    """The tiny Llama written as Q8_0 GGUF by quantkit's own writer."""
    out = tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf"
    made = run_quantkit("finalize", str(tiny_model_dir), str(out), "-q", "gguf-q8-0", "--quiet")
    assert made.returncode == 0, made.stderr
    return out


def test_a_q8_0_gguf_scores_the_same_windows_within_1_percent_of_the_float_model(tiny_model_dir, q8_gguf, text_file, tmp_path):
    out = tmp_path / "eval.json"
    run = run_quantkit("eval", str(tiny_model_dir), str(q8_gguf), "--data", str(text_file), "--seq-len", "128", "--stride", "96",
                   "--threads", "2", "--json", str(out), "--baseline", str(tiny_model_dir), "--max-ppl-increase", "1")
    assert run.returncode == 0, run.stdout + run.stderr
    hf, gguf_row = json.loads(out.read_text())["results"]
    assert (hf["runtime"], gguf_row["runtime"].split()[0]) == ("transformers", "llama.cpp")
    assert gguf_row["tokens_note"] is None  # llama.cpp's tokenizer splits the text as the Hugging Face one does
    assert gguf_row["perplexity"]["windows_digest"] == hf["perplexity"]["windows_digest"]
    assert gguf_row["perplexity"]["tokens"] == hf["perplexity"]["tokens"]
    assert gguf_row["perplexity"]["perplexity"] == pytest.approx(hf["perplexity"]["perplexity"], rel=0.01)
    assert (gguf_row["size_bytes"], gguf_row["format"], gguf_row["recipe"]) == (q8_gguf.stat().st_size, "gguf Q8_0", "gguf-q8-0")
    rows = [line for line in run.stdout.splitlines() if line.startswith("│")]
    assert [row.split()[1] for row in rows] == ["tiny-llama", "tiny-Q8_0.gguf"], run.stdout


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    """A tiny Llama whose widths take K super-blocks (256, 512), with grouped KV heads (q/k row reordering differs
    between them), its Linear weights scaled x6 so that its logits are far from flat: a wrong row order, a wrong
    block or a wrong metadata key moves its perplexity a lot."""
    from safetensors.torch import load_file, save_file

    from conftest import make_text
    from quantkit.models.tiny import build_tiny_llama

    src = build_tiny_llama(tmp_path_factory.mktemp("sharp") / "sharp-llama", make_text(3000), hidden_size=256,
                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    weights = load_file(src / "model.safetensors")
    save_file({k: v * 6 if k.endswith("proj.weight") else v for k, v in weights.items()}, src / "model.safetensors",
              metadata={"format": "pt"})
    return src


def test_llama_cpp_computes_the_quantized_model_quantkit_wrote(sharp_model, text_file, tmp_path, shipped="gguf-q2-k"):
    """llama.cpp's perplexity of the file is the in-memory quantized model's (eval -q: the same grid in transformers)
    within 1%, and both are off the float model's: the K blocks, the mixture's types, the row order and the
    metadata are what llama.cpp reads them as. (llama.cpp quantizes activations for its dot products: not equal.)
    Q2_K covers the most: K blocks of four types, GPTQ on K grids, the mixture, a quantized token embedding (Q4_K_M,
    since GPTQ weights its K grids by the inputs' importance, moves this model's perplexity by 0.03% only).
    Measured: float 439.81, in memory 440.49, llama.cpp 440.37."""
    import yaml

    from quantkit.quant.registry import resolve

    recipe = tmp_path / "small.yaml"  # the shipped recipe in GGUF, on 8 x 64 calibration tokens
    recipe.write_text(yaml.safe_dump({**resolve(shipped).to_file(), "format": "gguf",
                                      "calibration": {"num_samples": 8, "seq_len": 64}}))
    out = tmp_path / "model.gguf"
    made = run_quantkit("finalize", str(sharp_model), str(out), "-q", str(recipe), "--calib-data", str(text_file), "--quiet")
    assert made.returncode == 0, made.stderr
    report = tmp_path / "eval.json"
    run = run_quantkit("eval", str(sharp_model), str(out), "-q", str(recipe), "--calib-data", str(text_file),
                       "--data", str(text_file), "--seq-len", "128", "--threads", "2", "--json", str(report))
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {Path(row["label"]).name: row["perplexity"]["perplexity"] for row in json.loads(report.read_text())["results"]}
    float_ppl, file_ppl, in_memory = rows["sharp-llama"], rows["model.gguf"], rows["sharp-llama+small"]
    assert file_ppl == pytest.approx(in_memory, rel=0.01), rows
    quantized = abs(in_memory / float_ppl - 1)
    assert quantized > 0.001, rows  # the quantization shows, and the file is far closer to it than to the float model
    assert abs(file_ppl / in_memory - 1) < 0.5 * quantized, rows
