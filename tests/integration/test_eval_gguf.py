"""`quantkit eval` of a GGUF file in llama.cpp, beside the Hugging Face model it was written from: the same windows,
and a Q8_0 copy's perplexity within 1% of the float model's. Needs llama-cpp-python (the `gguf` extra) and quantkit's
GGUF writer (`quantkit finalize SRC OUT.gguf -q gguf-q8-0`); skipped, saying which is missing, without them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

pytest.importorskip("llama_cpp", reason="needs llama-cpp-python: pip install 'quantkit-llm[gguf]'")


def run_quantkit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit.cli.main", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def q8_gguf(tiny_model_dir, tmp_path_factory):
    """The tiny Llama written as Q8_0 GGUF by quantkit's own writer."""
    try:
        import quantkit.export.gguf  # noqa: F401
    except ImportError:
        pytest.skip("quantkit's GGUF writer (quantkit.export.gguf) is not in this checkout")
    from quantkit.quant.registry import recipe_names

    if "gguf-q8-0" not in recipe_names():
        pytest.skip("no gguf-q8-0 recipe in this checkout (`quantkit recipes list`)")
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
