"""llama.cpp's own command-line tools run quantkit's GGUF files (`make test-gguf`; marked `llama_cpp`, left out of
`make test`). The other GGUF tests run the files through llama-cpp-python; these run the binaries a user runs,
built by scripts/build_llama_cpp.sh into its cache (or the folder QUANTKIT_LLAMA_CPP_BIN names), and skip, saying
how to build them, where they are absent.

Two small models, trained here for 40 steps so that their perplexity means something (on a random model a broken
file scores about as well as a correct one): a Llama with a SentencePiece tokenizer (BOS on every window), whose
Linears take K super-blocks (256, 512), written in every type family quantkit writes; a Qwen3-MoE with a byte-level
BPE tokenizer, in Q8_0, Q4_K_M and MXFP4_MOE. `llama-perplexity` scores each file, held to the float model's
perplexity on the same windows (transformers, here); and it measures each Llama file's KL divergence from the Q8_0
file's logits.

Measured (2 cores), perplexity against the float model's 37.109 (Llama) and 22.933 (MoE): Q8_0 +0.03%, Q4_0
+0.05%, Q4_1 +0.01%, Q4_K_M -0.08%, Q5_K_M -0.06%, Q3_K_M +0.00%, Q2_K -0.43%; MoE Q8_0 -0.00%, Q4_K_M -0.03%. Mean
KL divergence from Q8_0: Q4_0 6.8e-5, Q4_1 3.4e-5, Q5_K_M 5.7e-5, Q4_K_M 6.2e-5, Q3_K_M 8.8e-5, Q2_K 3.1e-3 (the
K mixtures' lm_head is Q6_K in each, so the 4- and 5-bit ones are close). Later, with llama-perplexity --no-repack:
Q3_K_L +0.01%, MXFP4 (every Linear; lm_head and token_embd Q8_0) -0.00%, IQ3_M +0.08%, IQ2_M -0.14%, MoE
MXFP4_MOE -0.01%; mean KL divergence from Q8_0: Q3_K_L 1.3e-4, MXFP4 1.0e-4, IQ3_M 3.4e-4, IQ2_M 5.2e-4 (Q3_K_M
1.3e-4, Q2_K 7.0e-3 in that run). Broken on purpose, the Q8_0 and Q4_K_M
files: attn_q's rows reversed in one layer, perplexity +324% (KL divergence 1.35); one attn_norm doubled +9.8%
(0.071); the RoPE base x10 -2.3% (0.032); ffn_gate and ffn_up swapped -0.4% (0.012). The bounds below catch each:
the first three by the perplexity, the last by the KL divergence (of any type but Q8_0, the reference)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.llama_cpp]

# Where scripts/build_llama_cpp.sh puts the tools: $LLAMA_CPP_CACHE/$LLAMA_CPP_VERSION/bin, with the script's
# defaults (its version is llama-cpp-python's release whose sdist holds the llama.cpp source; scripts/bench_gguf.py
# reads the same two variables).
LLAMA_CPP_VERSION = os.environ.get("LLAMA_CPP_VERSION", "0.3.36")
LLAMA_CPP_CACHE = Path(os.environ.get("LLAMA_CPP_CACHE", Path.home() / ".cache" / "quantkit" / "llama.cpp"))
TOOLS = ("llama-perplexity", "llama-bench")

CTX, CHUNKS, THREADS = 128, 8, 2  # llama-perplexity -c 128 --chunks 8 -t 2: 8 x 63 scored tokens
LLAMA_RECIPES = ("gguf-q8-0", "gguf-q4-0", "gguf-q4-1", "gguf-q4-k-m", "gguf-q5-k-m", "gguf-q3-k-m", "gguf-q2-k",
                 "gguf-q3-k-l", "gguf-mxfp4", "gguf-iq3-m", "gguf-iq2-m")
CASES = [("llama", recipe) for recipe in LLAMA_RECIPES] + [("qwen3-moe", "gguf-q8-0"), ("qwen3-moe", "gguf-q4-k-m"),
                                                           ("qwen3-moe", "gguf-mxfp4")]

# |perplexity of the file / the float model's - 1| at most: 4x to 15x what was measured (the module docstring).
BOUNDS = {"gguf-q8-0": 0.005, "gguf-q4-0": 0.01, "gguf-q4-1": 0.01, "gguf-q4-k-m": 0.01, "gguf-q5-k-m": 0.01,
          "gguf-q3-k-m": 0.015, "gguf-q2-k": 0.02, "gguf-q3-k-l": 0.015, "gguf-mxfp4": 0.01,
          "gguf-iq3-m": 0.01, "gguf-iq2-m": 0.02}
# The Llama files' mean KL divergence from the Q8_0 file's logits at most: 2.6x (Q2_K) to 15x what was measured,
# each under the 0.012 of the subtlest breakage measured (the module docstring).
KLD_BOUNDS = {"gguf-q4-0": 5e-4, "gguf-q4-1": 5e-4, "gguf-q5-k-m": 5e-4, "gguf-q4-k-m": 5e-4, "gguf-q3-k-m": 1e-3,
              "gguf-q2-k": 8e-3, "gguf-q3-k-l": 1e-3, "gguf-mxfp4": 1e-3, "gguf-iq3-m": 2e-3, "gguf-iq2-m": 3e-3}

SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, max_position_embeddings=512)
MODELS = {  # name: (model config, tokenizer kind, vocabulary size)
    "llama": (dict(SHAPES, model_type="llama"), "sentencepiece", 512),
    "qwen3-moe": (dict(SHAPES, model_type="qwen3_moe", num_hidden_layers=1, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=256, norm_topk_prob=True), "byte-level", 512),  # head_dim: 256 / 4
}


def llama_cpp_bin() -> Path:
    """The folder holding llama.cpp's tools: QUANTKIT_LLAMA_CPP_BIN, or where scripts/build_llama_cpp.sh builds them."""
    named = os.environ.get("QUANTKIT_LLAMA_CPP_BIN")
    return Path(named) if named else LLAMA_CPP_CACHE / LLAMA_CPP_VERSION / "bin"


@pytest.fixture(scope="module")
def tools() -> Path:
    folder = llama_cpp_bin()
    missing = [tool for tool in TOOLS if not os.access(folder / tool, os.X_OK)]
    if missing:
        pytest.skip(f"needs llama.cpp's tools ({', '.join(missing)} not in {folder}): `make test-gguf` builds them "
                    "(scripts/build_llama_cpp.sh, about 7 minutes once), or set QUANTKIT_LLAMA_CPP_BIN to their folder")
    return folder


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, Path]:
    from conftest import make_text

    root = tmp_path_factory.mktemp("texts")
    found = {"train": make_text(12000, seed=5), "calib": make_text(1500, seed=2), "eval": make_text(1500, seed=1)}
    for name, text in found.items():
        (root / f"{name}.txt").write_text(text)
    return {name: root / f"{name}.txt" for name in found}


@pytest.fixture(scope="module")
def models(tools, texts, tmp_path_factory):
    """name -> a model of MODELS trained 40 steps on `texts["train"]` (built on first use)."""
    from conftest import make_text
    from quantkit.models.tiny import TOKENIZERS
    from quantkit.training import config as train_config
    from quantkit.training.loop import train

    built = {}

    def model(name: str) -> Path:
        if name not in built:
            root = tmp_path_factory.mktemp(name)
            config, kind, vocab_size = MODELS[name]
            tokenizer = TOKENIZERS[kind](make_text(3000), vocab_size)
            tokenizer.save_pretrained(root / "tokenizer")
            cfg = {"model": {"config": {**config, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                                        "eos_token_id": tokenizer.eos_token_id},
                             "tokenizer": str(root / "tokenizer")},
                   "data": {"train": str(texts["train"]), "seq_len": 64},
                   "train": {"micro_batch_size": 8, "global_batch_size": 8, "max_steps": 40, "lr": 3e-3,
                             "warmup_steps": 5, "log_interval": 20},
                   "output_dir": str(root / "run")}
            built[name] = train(train_config.from_dict(cfg), threads=THREADS).final_dir
        return built[name]
    return model


@pytest.fixture(scope="module")
def gguf_files(models, texts, tmp_path_factory):
    """(model, recipe) -> the GGUF file `quantkit finalize` writes (GPTQ on 8 x 64 tokens where the recipe
    calibrates; the round-to-nearest ones ignore the data)."""
    import quantkit

    root, written = tmp_path_factory.mktemp("gguf"), {}

    def gguf_file(model: str, recipe: str) -> Path:
        if (model, recipe) not in written:
            out = root / f"{model}-{recipe}.gguf"
            quantkit.finalize(models(model), out, recipe, calib_data=str(texts["calib"]), num_samples=8, seq_len=64,
                              threads=THREADS)
            written[model, recipe] = out
        return written[model, recipe]
    return gguf_file


def run_tool(args: list, pattern: str) -> float:
    """Run a llama.cpp tool and return the number `pattern` captures in its output; the tool must exit 0. Its
    logger is a thread the process does not wait for at exit (common_log_main: "logs may be lost"): measured, 2 to
    4 runs of llama-perplexity in 20 lose their last lines, the result among them. Such a run is run again, up to
    5 times."""
    for _ in range(5):
        done = subprocess.run([str(arg) for arg in args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr[-3000:]}"
        found = re.search(pattern, done.stdout + done.stderr)
        if found:
            return float(found.group(1))
    pytest.fail(f"{' '.join(map(str, args))} printed no {pattern!r} in 5 runs:\n{done.stdout[-1500:]}\n"
                f"{done.stderr[-1500:]}")


def perplexity_args(tools: Path, gguf_file: Path, text: Path) -> list:
    # --no-repack: llama.cpp's AMX repacked kernels crash on some x86 VMs; the plain CPU kernels compute the same
    return [tools / "llama-perplexity", "-m", gguf_file, "-f", text, "-c", CTX, "--chunks", CHUNKS, "-t", THREADS,
            "--no-repack"]


@pytest.fixture(scope="module")
def kld_base(tmp_path_factory) -> Path:
    """Where the Llama's Q8_0 run of llama-perplexity saves its logits (--kl-divergence-base)."""
    return tmp_path_factory.mktemp("kld") / "llama-q8-0.kld"


@pytest.fixture(scope="module")
def perplexities(tools, gguf_files, texts, kld_base):
    """(model, recipe) -> llama-perplexity's final estimate on the file (the Llama's Q8_0 run saves its logits)."""
    found = {}

    def perplexity(model: str, recipe: str) -> float:
        if (model, recipe) not in found:
            args = perplexity_args(tools, gguf_files(model, recipe), texts["eval"])
            if (model, recipe) == ("llama", "gguf-q8-0"):
                args += ["--kl-divergence-base", kld_base]
            found[model, recipe] = run_tool(args, r"Final estimate: PPL = (\S+) \+/-")
        return found[model, recipe]
    return perplexity


@pytest.fixture(scope="module")
def float_perplexities(models, gguf_files, texts):
    """model -> the float model's perplexity in transformers on llama-perplexity's windows: the text's tokens cut
    into CTX-token chunks, each chunk's first token BOS where the file's tokenizer adds BOS, the second half of each
    chunk scored."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    found = {}

    def float_perplexity(name: str) -> float:
        if name not in found:
            src = models(name)
            field = gguf.GGUFReader(gguf_files(name, "gguf-q8-0")).fields.get("tokenizer.ggml.add_bos_token")
            tokenizer, model = AutoTokenizer.from_pretrained(src), AutoModelForCausalLM.from_pretrained(src)
            ids = tokenizer(texts["eval"].read_text())["input_ids"]
            assert len(ids) >= CHUNKS * CTX, "the text is too short for CHUNKS windows"
            chunks = torch.tensor(ids[:CHUNKS * CTX]).reshape(CHUNKS, CTX)
            if field is not None and field.contents():
                chunks[:, 0] = tokenizer.bos_token_id
            with torch.no_grad():
                logprobs = torch.log_softmax(model(chunks).logits.float(), dim=-1)
            first = CTX // 2
            scored = logprobs[:, first:-1].gather(-1, chunks[:, first + 1:, None])
            found[name] = math.exp(-scored.mean().item())
        return found[name]
    return float_perplexity


@pytest.mark.parametrize("model, recipe", CASES)
def test_llama_perplexity_runs_the_file_near_the_float_model(perplexities, float_perplexities, model, recipe):
    ppl, reference = perplexities(model, recipe), float_perplexities(model)
    print(f"{model} {recipe}: llama-perplexity {ppl:.4f}, float model {reference:.4f} ({ppl / reference - 1:+.2%})")
    assert math.isfinite(ppl), ppl
    assert abs(ppl / reference - 1) <= BOUNDS[recipe], (ppl, reference)


def test_llama_perplexity_finds_each_file_close_to_the_q8_0_files_logits(tools, perplexities, gguf_files, texts,
                                                                          kld_base):
    """llama-perplexity --kl-divergence against the Q8_0 file's logits: each type's mean KL divergence within its
    bound (a file that decodes wrongly is far from Q8_0: see the module docstring), and among the K mixtures, the
    2-bit one the farthest and the 5-bit one nearer than the 3-bit one."""
    perplexities("llama", "gguf-q8-0")  # saves the reference logits to kld_base
    kld = {recipe: run_tool(perplexity_args(tools, gguf_files("llama", recipe), texts["eval"])
                            + ["--kl-divergence-base", kld_base, "--kl-divergence"], r"Mean\s+KLD:\s+(\S+)")
           for recipe in KLD_BOUNDS}
    print("mean KL divergence from Q8_0:", kld)
    assert all(kld[recipe] <= bound for recipe, bound in KLD_BOUNDS.items()), kld
    assert max(kld, key=kld.get) == "gguf-q2-k" and kld["gguf-q5-k-m"] < kld["gguf-q3-k-m"], kld


def test_llama_bench_runs_prompt_and_generation(tools, gguf_files):
    """llama-bench on the Q4_K_M file: a 32-token prompt and 16 generated tokens, once each (`--repack 0`: as
    llama-perplexity's --no-repack above, the AMX repacked kernels crash on some x86 VMs, rc -11)."""
    done = subprocess.run([str(tools / "llama-bench"), "-m", str(gguf_files("llama", "gguf-q4-k-m")), "-p", "32",
                           "-n", "16", "-r", "1", "-t", str(THREADS), "-o", "json", "--repack", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout)
    assert sorted((run["n_prompt"], run["n_gen"]) for run in runs) == [(0, 16), (32, 0)], runs
    assert all(run["avg_ts"] > 0 for run in runs), runs
