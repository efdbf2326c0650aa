"""Benchmark quantkit's calibrated recipes against llm-compressor: same model, same calibration tokens, same threads.

llm-compressor pins an older transformers, so it lives in its own virtualenv, outside the repository:

    python3 -m venv /tmp/llmc-venv
    /tmp/llmc-venv/bin/pip install torch==2.13.0      # first: the CPU wheel (a bare torch pulls GBs of CUDA)
    /tmp/llmc-venv/bin/pip install llmcompressor      # resolves transformers <= 5.17 in that venv only

Then, from the repository root with the project venv active:

    python scripts/bench_calibration.py --llmc-python /tmp/llmc-venv/bin/python --json calib.json
    python scripts/bench_calibration.py                # quantkit only (the llm-compressor side is skipped)

What it does (everything cached under `--workdir`, default /tmp/quantkit-bench-calib):

1. builds a Llama from a config (4 layers, hidden `--hidden` (512 by default; 1024 is the ~68M-parameter shape),
   intermediate 2.75x hidden (`--intermediate`), head_dim 64, vocab 8192, a byte-level BPE tokenizer trained on
   `--train-text`),
   then trains it with `quantkit train` for `--train-steps` steps (seq_len 256, global batch 16, micro batch 8,
   lr 1e-3, precision auto: fp32 on a CPU without bf16 support, where bf16 autocast ran 3-4x slower) so
   that the model has real structure; OUTPUT/final is the benchmark
   model (float32). Hidden 512, not 1024: on a shared 2-core machine 1024 trains at ~90 tokens/s. Even so,
   150 steps leave a weak model (test perplexity ~290) whose perplexity 4-bit RTN barely moves: see step 4;
2. takes the calibration blocks once, with `quantkit.finalization.finalize.calibration_samples` (`--num-samples` x
   `--seq-len` tokens of `--calib-data`, seed 0) and saves them to calib-NxL.safetensors; `quantkit finalize`
   draws the same blocks from the same options, and the llm-compressor runner feeds exactly these ids to
   `oneshot` as a `datasets.Dataset` of input_ids (no shuffling);
3. runs every job as its own subprocess with OMP_NUM_THREADS / MKL_NUM_THREADS = `--threads`:
   quantkit: `quantkit finalize SRC DST -q RECIPE [--calib-data ...] --threads T --quiet --overwrite`;
   llm-compressor: llmc_runner.py (scripts/harness.py's LLMC_RUNNER, written to the work dir) under
   `--llmc-python`: `torch.set_num_threads(T)`, `oneshot(...)`, then `save_pretrained(DST, save_compressed=True)`;
   it prints its load/oneshot/save times.
   Wall time is perf_counter around the subprocess (interpreter start, imports, load, calibration, save);
   peak RSS is ru_maxrss from os.wait4. On an oversubscribed machine (other jobs running) `--threads 2` on 2
   cores was 3-4x slower than `--threads 1` for both tools: GPTQ's per-column loop of small parallel ops
   stalls on thread barriers. Compare tools at the same `--threads`, and repeat (`--repeats`);
4. evaluates the float model and every artifact in ONE `quantkit eval` call (WikiText-2 test, seq_len 256,
   64 windows); if that call fails (an artifact that does not load), each model is evaluated alone so the
   failure is pinned on one artifact; then, in this process, the mean per-token KL(float || quantized) of
   the next-token distributions on the same windows (`--no-kl` skips it): on a model this small and this
   briefly trained, 4-bit RTN barely moves perplexity, while KL still separates RTN from GPTQ;
5. prints a markdown table, the quantkit / llm-compressor ratios per algorithm, and each tool's GPTQ
   perplexity rise (and KL) as a fraction of its RTN rise (KL).

Algorithms: RTN W4A16 (quantkit int4-weight-only; llm-compressor QuantizationModifier W4A16), GPTQ W4A16
(gptq-w4a16; GPTQModifier W4A16), SmoothQuant + GPTQ W8A8 (smoothquant-w8a8; SmoothQuantModifier(0.8) +
GPTQModifier W8A8), and AWQ W4A16 (awq-w4a16, run when this checkout has that recipe; llm-compressor's
AWQModifier + QuantizationModifier W4A16 only with `--awq`: its grid search takes ~15 min on 2 CPU cores,
and 0.14 needs the runner's no-op for pin_memory on a machine without an accelerator). llm-compressor's
GPTQModifier orders columns by activation (actorder "static") unless told otherwise; quantkit's recipes do
not; `--llmc-actorder none` makes the two run the same algorithm, and `--gptq-orders` runs GPTQ W4A16 in both
orders on both sides (quantkit's recipe with `actorder: true` beside the shipped one). AutoRound W4A16 (autoround-w4a16;
AutoRoundModifier W4A16, batch 8, lr 1 / iters, torch.compile off) and AutoRound W2A16 (autoround-w2a16; the
same modifier on symmetric int2 in groups of 32, beside RTN W2A16 on quantkit's int2 grid; both AutoRounds scale
with auto-round's full range, the larger side of each group on -2) run
`--autoround-iters` steps per layer on both sides (quantkit: a user recipe file made from the shipped one).
`--autoround-seeds 42 7 1` runs both tools' AutoRound at each seed (the seed picks each step's samples; the
runner hands llm-compressor's AutoRoundModifier's auto-round the seed it does not pass on) and reports each tool's
mean perplexity and KL over the seeds: on this small model one seed's perplexity differs from another's by more
than the tools differ at one seed, so a single pair of runs cannot say which tool tunes better.

`--quantkit-ranks N` runs quantkit's calibrated recipes data-parallel (`--nproc-per-node N`, each rank with
`--threads` / N threads) against llm-compressor's one process of `--threads` threads: both tools on the same cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import harness
from harness import WIKITEXT, fmt, median

# (algorithm, quantkit recipe, llm-compressor runner recipe): one row pair of the table each
ALGORITHMS = [
    ("RTN W4A16", "int4-weight-only", "rtn-w4a16"),
    ("GPTQ W4A16", "gptq-w4a16", "gptq-w4a16"),
    ("SmoothQuant+GPTQ W8A8", "smoothquant-w8a8", "smoothquant-gptq-w8a8"),
    ("AutoRound W4A16", "autoround-w4a16", "autoround-w4a16"),
    ("RTN W2A16", "int2-weight-only", "rtn-w2a16"),
    ("AutoRound W2A16", "autoround-w2a16", "autoround-w2a16"),
]
AWQ = ("AWQ W4A16", "awq-w4a16", "awq-w4a16")
DEFAULT_SEED = 42  # auto-round's, and quantkit's AutoRound recipes'


@dataclass
class Job:
    """One quantization run: a tool, an algorithm, and the subprocess that makes the artifact."""

    tool: str
    algorithm: str
    recipe: str
    dst: Path
    cmd: list[str]
    seconds: list[float] = field(default_factory=list)
    peak_rss_mib: list[float] = field(default_factory=list)
    calibration_s: list[float] = field(default_factory=list)  # llm-compressor: oneshot(), timed by the runner
    reported: dict = field(default_factory=dict)  # what the runner printed last (import/load/oneshot/save seconds)
    returncode: int = 0
    error: str = ""
    perplexity: float | None = None
    kl: float | None = None  # mean per-token KL(float || quantized) on the eval windows
    seed: int | None = None  # AutoRound's seed (its batches' draws), both tools


# ---------------------------------------------------------------- the benchmark model


def build_init(workdir: Path, text: Path, hidden: int, intermediate: int | None = None,
               moe: tuple[int, int, int] | None = None) -> Path:
    """The randomly initialised float32 Llama with its tokenizer, built once (MLP width `intermediate`, default
    2.75x hidden); with `moe` = (experts, experts per token, expert width), a Qwen3-MoE of the same attention,
    vocabulary and tokenizer, every layer's MLP those experts (head_dim 64, untied, top-k weights renormalised)."""
    shape = {**harness.llama_shape(hidden), **({"intermediate_size": intermediate} if intermediate else {})}
    name = f"llama-h{hidden}" + (f"-i{intermediate}" if intermediate else "")
    if moe is None:
        return harness.build_llama(workdir / f"{name}-init", text, "float32", **shape)
    experts, per_token, width = moe
    shape.update(num_experts=experts, num_experts_per_tok=per_token, moe_intermediate_size=width, head_dim=64,
                 norm_topk_prob=True, tie_word_embeddings=False)
    name = f"qwen3moe-h{hidden}-e{experts}k{per_token}-m{width}"
    return harness.build_llama(workdir / f"{name}-init", text, "float32", model_type="qwen3_moe", **shape)


def train_config(init: Path, text: Path, steps: int, output: Path, batch: int = 16) -> dict:
    return {
        "model": {"path": str(init)},
        "data": {"train": str(text), "seq_len": 256},
        "train": {"micro_batch_size": min(8, batch), "global_batch_size": batch, "max_steps": steps, "lr": 1.0e-3,
                  "warmup_steps": max(1, steps // 10), "schedule": "cosine", "precision": "auto", "seed": 0,
                  "log_interval": 10},
        "output_dir": str(output),
    }


def add_model_arguments(p) -> None:
    """The arguments `benchmark_model` reads, for the benchmarks that share this one's model (`--workdir`)."""
    p.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-calib"), help="shared with bench_calibration.py")
    p.add_argument("--model", type=Path, help="this model directory instead of bench_calibration.py's trained one")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--train-batch", type=int, default=16)
    p.add_argument("--train-text", type=Path, default=WIKITEXT / "valid.txt")
    p.add_argument("--arch", choices=["llama", "qwen3_moe"], default="llama", help="qwen3_moe: the same shape with "
                   "every MLP a mixture of experts (--experts, --experts-per-token, --moe-intermediate)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--experts-per-token", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=384, help="each expert's MLP width")


def add_run_arguments(p) -> None:
    """The calibration and evaluation data, threads and repeats, as this family of benchmarks takes them."""
    p.add_argument("--calib-data", type=Path, default=WIKITEXT / "valid.txt")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-data", type=Path, default=WIKITEXT / "test.txt")
    p.add_argument("--eval-samples", type=int, default=64, help="perplexity windows of 256 tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="timed runs of every job (the table shows medians)")


def benchmark_model(args) -> Path:
    """`--model`, or the trained benchmark model (built once in `--workdir`): what every benchmark of this family
    runs on."""
    if args.model:
        return args.model.resolve()
    moe = None
    if getattr(args, "arch", "llama") == "qwen3_moe":  # this script's own arguments have no --arch
        moe = (args.experts, args.experts_per_token, args.moe_intermediate)
    init = build_init(args.workdir, args.train_text, args.hidden, getattr(args, "intermediate", None), moe)
    return train_model(args.workdir, init, args.train_text, args.train_steps, args.threads, args.train_batch)


def train_model(workdir: Path, init: Path, text: Path, steps: int, threads: int, batch: int = 16) -> Path:
    """`quantkit train` on the built model, once; returns OUTPUT/final."""
    output = workdir / (f"{init.name.removesuffix('-init')}-trained{steps}" + (f"-b{batch}" if batch != 16 else ""))
    final = output / "final"
    if (final / "config.json").is_file():
        return final
    config = workdir / f"{output.name}.yaml"
    config.write_text(json.dumps(train_config(init, text, steps, output, batch), indent=2))  # JSON is YAML
    print(f"training {init} for {steps} steps -> {final} ...", file=sys.stderr)
    began = time.perf_counter()
    cmd = harness.quantkit_command("train", config, "--threads", threads, "--quiet", "--overwrite")
    subprocess.run(cmd, env=harness.thread_env(threads), check=True)
    (output / "train_seconds.txt").write_text(f"{time.perf_counter() - began:.1f}\n")
    return final


def training_facts(final: Path) -> dict | None:
    """Steps, final loss, first loss and training time, read back from the run's log (None: no log there)."""
    output = final.parent
    if not (output / "log.jsonl").is_file():
        return None
    log = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines() if line.strip()]
    losses = [r for r in log if "loss" in r]
    seconds = output / "train_seconds.txt"
    return {"steps": losses[-1]["step"], "first_loss": losses[0]["loss"], "final_loss": losses[-1]["loss"],
            "seconds": float(seconds.read_text()) if seconds.is_file() else None}


# ---------------------------------------------------------------- jobs


def quantkit_job(algorithm: str, recipe: str, src: Path, out: Path, args: argparse.Namespace,
                 seed: int | None = None, actorder: bool = False) -> Job:
    from quantkit.quant.registry import resolve

    dst = out / f"quantkit-{recipe}{seed_suffix(seed)}{'-actorder' if actorder else ''}"
    calibrated = resolve(recipe).needs_calibration
    calibration = harness.calibration_options(args.calib_data, args.num_samples, args.seq_len) if calibrated else []
    chosen = autoround_recipe(recipe, args.autoround_iters, out, seed) if recipe.startswith("autoround") else recipe
    if actorder:  # the shipped recipe with GPTQ's columns in order of decreasing Hessian diagonal
        chosen = str(out / f"{recipe}-actorder.yaml")
        Path(chosen).write_text(Path(resolve(recipe).source).read_text().replace("actorder: false", "actorder: true"))
    ranks = args.quantkit_ranks if calibrated else 1
    if ranks > 1:
        calibration += ["--nproc-per-node", str(ranks)]
    cmd = harness.finalize_command(src, dst, chosen, max(1, args.threads // ranks), *calibration)
    return Job("quantkit", algorithm, recipe, dst, cmd, seed=seed)


def seed_suffix(seed: int | None) -> str:
    """What an artifact's name gains from AutoRound's seed: nothing for auto-round's default, 42."""
    return "" if seed in (None, DEFAULT_SEED) else f"-seed{seed}"


def autoround_recipe(name: str, iters: int, folder: Path, seed: int | None = None) -> str:
    """The shipped AutoRound recipe `name`, or a user recipe file made from it with `iters` steps a layer (and
    `seed`)."""
    from quantkit.quant.registry import resolve

    recipe = resolve(name)
    shipped = recipe.quantizer.arguments
    seed = shipped.seed if seed is None else seed
    if iters == shipped.iters and seed == shipped.seed:
        return name
    path = folder / f"{name}-{iters}-steps{seed_suffix(seed)}.yaml"
    text = Path(recipe.source).read_text()
    path.write_text(text.replace(f"iters: {shipped.iters}", f"iters: {iters}").replace(f"seed: {shipped.seed}", f"seed: {seed}"))
    return str(path)


def llmc_job(algorithm: str, recipe: str, src: Path, out: Path, calib: Path, runner: Path,
             args: argparse.Namespace, seed: int | None = None, actorder: str | None = None) -> Job:
    actorder = actorder or args.llmc_actorder
    dst = out / f"llmc-{recipe}{seed_suffix(seed)}{'-actorder-' + actorder if actorder != args.llmc_actorder else ''}"
    cmd = harness.llmc_command(args.llmc_python, runner, src, dst, calib, recipe, actorder, args.threads,
                               iters=args.autoround_iters, seed=DEFAULT_SEED if seed is None else seed)
    return Job("llm-compressor", algorithm, recipe, dst, cmd, seed=seed)


def has_recipe(name: str) -> bool:
    from quantkit.quant.registry import recipe_names

    return name in recipe_names()


def make_jobs(src: Path, calib: Path, workdir: Path, args: argparse.Namespace) -> list[Job]:
    out = workdir / "out"
    out.mkdir(exist_ok=True)
    runner = harness.write_llmc_runner(workdir)
    jobs = []  # the two tools alternate, algorithm by algorithm, so that drift of a noisy machine hits both alike
    for algo, qk_recipe, llmc_recipe in ALGORITHMS + [AWQ]:
        if args.only and qk_recipe not in args.only:
            continue
        run_llmc = args.llmc_python and (algo != AWQ[0] or args.awq)
        if args.gptq_orders and qk_recipe == "gptq-w4a16":  # both tools in both column orders, like with like
            for label, qk_order, llmc_order in ((algo, False, "none"), (f"{algo}, actorder", True, "default")):
                jobs += [quantkit_job(label, qk_recipe, src, out, args, actorder=qk_order)]
                jobs += [llmc_job(label, llmc_recipe, src, out, calib, runner, args, actorder=llmc_order)] if run_llmc else []
            continue
        for seed in args.autoround_seeds if qk_recipe.startswith("autoround") else [None]:
            jobs += [quantkit_job(algo, qk_recipe, src, out, args, seed)] if has_recipe(qk_recipe) else []
            jobs += [llmc_job(algo, llmc_recipe, src, out, calib, runner, args, seed)] if run_llmc else []
    return jobs


# ---------------------------------------------------------------- measuring


def measure(job: Job, env: dict[str, str], logs: Path) -> None:
    """One run of `job`: wall time and peak RSS (os.wait4); stdout kept (the runner's JSON), stderr logged."""
    shutil.rmtree(job.dst, ignore_errors=True)  # llm-compressor's save_pretrained would mix old and new files
    run, printed = harness.measure_logged(job.cmd, env, logs / f"{job.dst.name}.log")
    job.returncode = run.returncode
    if run.returncode:
        job.error = run.stderr_tail
        return
    job.seconds.append(run.seconds)
    job.peak_rss_mib.append(run.peak_rss_mib)
    job.reported = harness.last_json_line(printed) or {}
    if "oneshot_s" in job.reported:
        job.calibration_s.append(job.reported["oneshot_s"])


def run_jobs(jobs: list[Job], repeats: int, threads: int, logs: Path) -> None:
    """`repeats` rounds over all jobs (interleaved, so slow drift of a noisy machine hits every job alike)."""
    env = harness.thread_env(threads)
    for round_no in range(1, repeats + 1):
        for job in jobs:
            if job.returncode:
                continue
            measure(job, env, logs)
            state = f"{job.seconds[-1]:.1f}s" if not job.returncode else f"FAILED (rc {job.returncode})"
            print(f"round {round_no}/{repeats} {job.tool} {job.recipe}: {state}", file=sys.stderr)


# ---------------------------------------------------------------- perplexity


def eval_cmd(models: list[Path], args: argparse.Namespace, json_path: Path) -> list[str]:
    return harness.quantkit_command("eval", *models, "--data", args.eval_data, "--seq-len", 256,
                                    "--max-samples", args.eval_samples, "--json", json_path, "--threads", args.threads,
                                    "--quiet")


def perplexities(models: list[Path], args: argparse.Namespace, workdir: Path) -> tuple[dict[str, float], dict[str, str]]:
    """{path: perplexity} from one `quantkit eval` call; when it fails, one call per model, and {path: error}."""
    ok, found = eval_once(models, args, workdir)
    if ok:
        return found, {}
    print("one `quantkit eval` over all models failed; evaluating each model alone", file=sys.stderr)
    results, errors = {}, {}
    for model in models:
        ok, found = eval_once([model], args, workdir)
        if ok:
            results.update(found)
        else:
            errors[str(model)] = found
    return results, errors


def eval_once(models: list[Path], args: argparse.Namespace, workdir: Path) -> tuple[bool, dict | str]:
    """(True, {path: perplexity}) or (False, the tail of the error output)."""
    json_path = workdir / "eval.json"
    json_path.unlink(missing_ok=True)
    env = harness.thread_env(args.threads)
    proc = subprocess.run(eval_cmd(models, args, json_path), env=env, capture_output=True, text=True)
    if proc.returncode:
        return False, (proc.stderr or proc.stdout).strip()[-1500:]
    reports = json.loads(json_path.read_text())["results"]
    return True, {r["path"]: r["perplexity"]["perplexity"] for r in reports}


def kl_to_float(src: Path, models: list[Path], args: argparse.Namespace) -> dict[str, float]:
    """{path: mean per-token KL(float || quantized)} of the next-token distributions on the first eval windows.

    Far more sensitive than perplexity: it sees every change of the output distribution, not only the net change
    of the target tokens' probability, so it separates algorithms on a small model that perplexity cannot.
    """
    import torch

    from quantkit.data import load_texts, tokenize
    from quantkit.evaluation.evaluate import load_eval_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_eval_model(src)
    ids = tokenize(tokenizer, load_texts(str(args.eval_data)))
    count = min(args.eval_samples, ids.numel() // 256)
    batches = ids[: count * 256].view(count, 256).split(8)
    reference = [_log_probs(model, batch) for batch in batches]
    result = {}
    for path in models:
        quantized, _ = load_eval_model(path)
        total = sum(_kl_sum(ref, _log_probs(quantized, batch)) for batch, ref in zip(batches, reference))
        result[str(path)] = total / (count * 256)
    return result


def _log_probs(model, batch):
    import torch

    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=batch).logits.float(), dim=-1)


def _kl_sum(log_p, log_q) -> float:
    return (log_p.exp() * (log_p - log_q)).sum().item()


# ---------------------------------------------------------------- reporting


TABLE_HEADER = ["tool", "algorithm", "recipe", "wall s", "llmc oneshot() s", "peak RSS MiB", "ppl", "ppl rise vs float",
                "KL vs float (1e-3 nats/token)"]


def table_row(job: Job, float_ppl: float | None) -> list[str]:
    rise = job.perplexity / float_ppl - 1 if job.perplexity and float_ppl else None
    wall = "FAILED" if job.returncode else fmt(median(job.seconds), ".1f")
    recipe = job.recipe + (f" (seed {job.seed})" if job.seed is not None else "")
    return [job.tool, job.algorithm, recipe, wall, fmt(median(job.calibration_s), ".1f"),
            fmt(median(job.peak_rss_mib), ".0f"), fmt(job.perplexity, ".3f"),
            "n/a" if rise is None else f"{100 * rise:+.2f}%", fmt(None if job.kl is None else 1e3 * job.kl, ".3f")]


def table(jobs: list[Job], float_ppl: float | None) -> str:
    float_row = ["-", "float (source)", "-", "-", "-", "-", fmt(float_ppl, ".3f"), "-", "-"]
    return harness.markdown_table(TABLE_HEADER, [float_row] + [table_row(job, float_ppl) for job in jobs])


def ratios(jobs: list[Job]) -> list[dict]:
    """quantkit / llm-compressor per algorithm (and AutoRound seed): wall time, peak RSS, perplexity."""
    by = {(j.tool, j.algorithm, j.seed): j for j in jobs if not j.returncode}
    rows = []
    for algorithm, seed in dict.fromkeys((j.algorithm, j.seed) for j in jobs):
        qk, lc = by.get(("quantkit", algorithm, seed)), by.get(("llm-compressor", algorithm, seed))
        if not (qk and lc):
            continue
        rows.append({
            "algorithm": algorithm, "seed": seed,
            "wall_ratio": median(qk.seconds) / median(lc.seconds),
            "rss_ratio": median(qk.peak_rss_mib) / median(lc.peak_rss_mib),
            "ppl_quantkit": qk.perplexity, "ppl_llmc": lc.perplexity,
            "ppl_ratio": qk.perplexity / lc.perplexity if qk.perplexity and lc.perplexity else None,
            "kl_quantkit": qk.kl, "kl_llmc": lc.kl,
        })
    return rows


def over_seeds(jobs: list[Job]) -> list[dict]:
    """Per algorithm run at several AutoRound seeds, per tool: the mean, lowest and highest perplexity and the mean
    KL over the seeds both tools ran; and at how many of them quantkit's perplexity is at most llm-compressor's.
    One seed's perplexity differs from another's by more than the tools differ at one: compare these."""
    out, rows = [], ratios(jobs)
    for algorithm in dict.fromkeys(j.algorithm for j in jobs if j.seed is not None):
        paired = [r for r in rows if r["algorithm"] == algorithm and r["ppl_ratio"] is not None]
        if len(paired) < 2:
            continue
        row = {"algorithm": algorithm, "seeds": [r["seed"] for r in paired],
               "quantkit_wins": sum(r["ppl_quantkit"] <= r["ppl_llmc"] for r in paired),
               "wall_ratio": statistics.mean(r["wall_ratio"] for r in paired)}
        for tool, key in (("quantkit", "quantkit"), ("llm-compressor", "llmc")):
            ppl = [r[f"ppl_{key}"] for r in paired]
            kl = [r[f"kl_{key}"] for r in paired if r[f"kl_{key}"] is not None]
            row[tool] = {"ppl_mean": statistics.mean(ppl), "ppl_min": min(ppl), "ppl_max": max(ppl),
                         "kl_mean": statistics.mean(kl) if len(kl) == len(ppl) else None}
        out.append(row)
    return out


def gptq_vs_rtn(jobs: list[Job], float_ppl: float | None) -> dict[str, dict[str, float | None]]:
    """Per tool: GPTQ W4A16's perplexity rise over float as a fraction of RTN W4A16's (target <= 0.6; None when
    RTN does not raise perplexity), and the same fraction of KL to the float model."""
    by = {(j.tool, j.algorithm): j for j in jobs}
    out = {}
    for tool in ("quantkit", "llm-compressor"):
        gptq, rtn = by.get((tool, "GPTQ W4A16")), by.get((tool, "RTN W4A16"))
        if not (gptq and rtn and gptq.perplexity and rtn.perplexity and float_ppl):
            continue
        ppl_share = (gptq.perplexity - float_ppl) / (rtn.perplexity - float_ppl) if rtn.perplexity > float_ppl else None
        out[tool] = {"ppl_rise_share": ppl_share, "kl_share": gptq.kl / rtn.kl if gptq.kl and rtn.kl else None}
    return out


def print_report(facts: dict, jobs: list[Job], float_ppl: float | None, eval_errors: dict[str, str]) -> None:
    m, t = facts["model"], facts["training"]
    ranks = facts.get("quantkit_ranks", 1)
    split = f" (quantkit's calibrated recipes: {ranks} ranks x {max(1, facts['threads'] // ranks)})" if ranks > 1 else ""
    print(f"- python {facts['python']}, {facts['cpus']} CPUs, threads {facts['threads']}{split}, repeats {facts['repeats']}; "
          f"quantkit side: torch {facts['torch']}, transformers {facts['transformers']}, "
          f"compressed-tensors {facts['compressed-tensors']}")
    print(f"- llm-compressor side: {facts['llmc'] or 'skipped (pass --llmc-python)'}")
    if t is None:
        print(f"- model: {m['path']} ({m['parameters'] / 1e6:.1f}M parameters, {m['dtype']}, given with --model)")
    else:
        took = f", {t['seconds']:.0f} s" if t["seconds"] else ""
        print(f"- model: {m['path']} ({m['parameters'] / 1e6:.1f}M parameters, {m['dtype']}, hidden {m['hidden']}), "
              f"trained {t['steps']} steps (loss {t['first_loss']:.3f} -> {t['final_loss']:.3f}{took})")
    print(f"- calibration: {facts['calibration']}; perplexity: {facts['eval']}")
    print()
    print(table(jobs, float_ppl))
    print()
    rows = ratios(jobs)
    for row in rows:
        seed = f" (seed {row['seed']})" if row["seed"] is not None else ""
        print(f"- {row['algorithm']}{seed}: quantkit / llm-compressor wall {row['wall_ratio']:.2f}x, peak RSS "
              f"{row['rss_ratio']:.2f}x, perplexity {fmt(row['ppl_quantkit'], '.3f')} vs {fmt(row['ppl_llmc'], '.3f')}")
    seeded = over_seeds(jobs)
    for row in seeded:
        qk, lc = row["quantkit"], row["llm-compressor"]
        print(f"- {row['algorithm']} over seeds {', '.join(map(str, row['seeds']))}: perplexity mean {qk['ppl_mean']:.3f} "
              f"({qk['ppl_min']:.3f}-{qk['ppl_max']:.3f}) vs {lc['ppl_mean']:.3f} ({lc['ppl_min']:.3f}-{lc['ppl_max']:.3f}), "
              f"KL mean {fmt(None if qk['kl_mean'] is None else 1e3 * qk['kl_mean'], '.3f')} vs "
              f"{fmt(None if lc['kl_mean'] is None else 1e3 * lc['kl_mean'], '.3f')}; quantkit's perplexity lower or "
              f"equal at {row['quantkit_wins']} of {len(row['seeds'])} seeds")
    targets = {r["algorithm"]: (r["wall_ratio"], r["quantkit"]["ppl_mean"] <= r["llm-compressor"]["ppl_mean"], "mean over seeds")
               for r in seeded}
    for row in rows:
        if row["algorithm"] in ("GPTQ W4A16", "AutoRound W4A16", "AutoRound W2A16") and row["ppl_ratio"] is not None:
            targets.setdefault(row["algorithm"], (row["wall_ratio"], row["ppl_ratio"] <= 1.0, "one run"))
    for algorithm, (wall_ratio, ppl_ok, basis) in targets.items():
        met = wall_ratio <= 0.5 and ppl_ok
        print(f"- target ({algorithm.split()[0]} wall <= 0.5x llm-compressor's, perplexity equal or better; {basis}): "
              f"{'met' if met else 'NOT met'}")
    for tool, share in gptq_vs_rtn(jobs, float_ppl).items():
        ppl_share = "n/a (RTN does not raise perplexity)" if share["ppl_rise_share"] is None else f"{100 * share['ppl_rise_share']:.0f}%"
        print(f"- {tool}: GPTQ W4A16 perplexity rise = {ppl_share} of RTN W4A16's (target <= 60%); "
              f"KL to float = {fmt(None if share['kl_share'] is None else 100 * share['kl_share'], '.0f')}% of RTN's")
    for job in jobs:
        if job.returncode:
            print(f"- FAILED {job.tool} {job.recipe} (rc {job.returncode}):\n```\n{job.error.strip()[-1500:]}\n```")
    for path, error in eval_errors.items():
        print(f"- `quantkit eval` could not evaluate {path}:\n```\n{error}\n```")


def config_dtype(src: Path) -> str:
    config = json.loads((src / "config.json").read_text())
    return config.get("dtype") or config.get("torch_dtype", "?")


def machine_facts(src: Path, hidden: int, args: argparse.Namespace) -> dict:
    return {
        **harness.host_facts(), **harness.versions("torch", "transformers", "compressed-tensors"),
        "threads": args.threads, "repeats": args.repeats, "quantkit_ranks": args.quantkit_ranks,
        "llmc": harness.llmc_versions(args.llmc_python), "llmc_actorder": args.llmc_actorder,
        "model": {"path": str(src), "hidden": hidden, "parameters": harness.parameter_count(src),
                  "dtype": config_dtype(src)},
        "training": training_facts(src),
        "calibration": f"{args.num_samples} x {args.seq_len} tokens of {args.calib_data} (seed 0)",
        "eval": f"{args.eval_data}, seq_len 256, {args.eval_samples} windows",
    }


def write_json(path: Path, facts: dict, jobs: list[Job], float_ppl: float | None, eval_errors: dict) -> None:
    payload = {
        "machine": facts, "float_perplexity": float_ppl, "jobs": [{**asdict(j), "dst": str(j.dst)} for j in jobs],
        "ratios": ratios(jobs), "over_seeds": over_seeds(jobs), "gptq_rise_over_rtn_rise": gptq_vs_rtn(jobs, float_ppl),
        "eval_errors": eval_errors,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llmc-python", type=Path, help="python of a venv with llmcompressor; without it only quantkit runs")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-calib"))
    p.add_argument("--model", type=Path, help="benchmark this model directory instead of building and training one "
                   "(e.g. scripts/bench_finalize.py's 68M bf16 Llama)")
    p.add_argument("--only", nargs="+", metavar="RECIPE", help="only these quantkit recipes (and their llm-compressor "
                   "counterparts): int4-weight-only gptq-w4a16 smoothquant-w8a8 awq-w4a16 autoround-w4a16 int2-weight-only "
                   "autoround-w2a16")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (1024: the ~68M-parameter shape)")
    p.add_argument("--intermediate", type=int, help="MLP width (default 2.75x hidden; a multiple of 128 lets "
                   "llm-compressor quantize down_proj in groups of 128, e.g. 768 with --hidden 256)")
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--train-batch", type=int, default=16, help="sequences of 256 tokens a training step")
    p.add_argument("--train-text", type=Path, default=WIKITEXT / "valid.txt", help="tokenizer and training text")
    add_run_arguments(p)
    p.add_argument("--quantkit-ranks", type=int, default=1, help="quantkit's calibrated recipes on this many ranks "
                   "(--nproc-per-node), each with --threads / ranks threads: the same cores as llm-compressor's one process")
    p.add_argument("--awq", action="store_true", help="also run llm-compressor's AWQ W4A16 (slow on CPU)")
    p.add_argument("--gptq-orders", action="store_true", help="GPTQ W4A16 in both column orders on both sides: "
                   "quantkit's recipe as shipped and with actorder: true, llm-compressor's with actorder None and its "
                   "default (static)")
    p.add_argument("--llmc-actorder", choices=["default", "none"], default="default",
                   help="llm-compressor GPTQ column order: its default (static) or none (as quantkit's recipes)")
    p.add_argument("--autoround-iters", type=int, default=200, help="AutoRound's steps per layer, both tools (200: "
                   "auto-round's default; on 2 CPU cores each step is a forward and backward pass of 8 samples)")
    p.add_argument("--autoround-seeds", type=int, nargs="+", default=[DEFAULT_SEED], metavar="SEED",
                   help="run both tools' AutoRound at each of these seeds (which samples each step draws); with two "
                   "or more, the report compares the tools' mean perplexity and KL over the seeds")
    p.add_argument("--no-kl", action="store_true", help="skip the KL-to-float measure (one more pass over every model)")
    p.add_argument("--prepare-only", action="store_true", help="build, train and write the calibration tokens, then stop")
    p.add_argument("--json", type=Path, help="also write every measurement here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not args.llmc_python:
        print("note: no --llmc-python given; skipping the llm-compressor side (see this script's docstring)", file=sys.stderr)
    src = benchmark_model(args)
    if args.model:
        args.hidden = json.loads((src / "config.json").read_text())["hidden_size"]
    calib = harness.write_calibration(src, args.calib_data, args.num_samples, args.seq_len, args.workdir)
    if args.prepare_only:
        return print(f"model {src}, calibration tokens {calib}")
    jobs = make_jobs(src, calib, args.workdir, args)
    logs = args.workdir / "logs"
    logs.mkdir(exist_ok=True)
    run_jobs(jobs, args.repeats, args.threads, logs)
    done = [job for job in jobs if not job.returncode]
    ppl, eval_errors = perplexities([src] + [job.dst for job in done], args, args.workdir)
    kl = kl_to_float(src, [job.dst for job in done if str(job.dst) in ppl], args) if not args.no_kl else {}
    for job in done:
        job.perplexity, job.kl = ppl.get(str(job.dst)), kl.get(str(job.dst))
    facts = machine_facts(src, args.hidden, args)
    print_report(facts, jobs, ppl.get(str(src)), eval_errors)
    if args.json:
        write_json(args.json, facts, jobs, ppl.get(str(src)), eval_errors)


if __name__ == "__main__":
    main()
