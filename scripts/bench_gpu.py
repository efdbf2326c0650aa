"""Benchmark quantkit's calibration on one CUDA GPU against llm-compressor's, both tools in the same run.

Two models, built here (cached under `--workdir`):
* speed: a ~0.84B Llama of random weights in bf16 (hidden 2048, 16 layers, MLP 5632, vocab 8192), calibrated on
  `--big-samples` x `--big-seq-len` (64 x 2048) tokens: GPTQ W4A16 and AWQ W4A16;
* quality: a small Llama (hidden `--hidden`, 4 layers) trained here with `quantkit train` (on the GPU), calibrated on
  64 x 256 tokens: GPTQ W4A16, AWQ W4A16 and AutoRound W4A16 (`--autoround-iters` 200 steps a layer), each
  artifact's WikiText-2 test perplexity from one `quantkit eval` call on the GPU.

Every job is one subprocess: `quantkit finalize ... --device cuda`, or scripts/harness.py's llm-compressor runner
under `--llmc-python` (llm-compressor loads the model on the CPU and its sequential pipeline moves each layer to the
GPU, as quantkit does). Measured per job: wall time (the whole process), the calibration call's own time
(llm-compressor's `oneshot`; quantkit's calibration phases from quantkit.json), and the GPU's memory in use and its
utilisation sampled through NVML every 50 ms (peak memory in use minus what was in use before the job; mean
utilisation over the job). quantkit's time split (capture / forward / observe / quantize / propagate) says what bounds
it.

    python scripts/bench_gpu.py --llmc-python /tmp/llmc-python --json gpu.json
    python scripts/bench_gpu.py --only gptq-w4a16 --no-big     # quantkit alone, the small model only

On a GPU machine without a registry, scripts/gpu_check.sh installs the carried wheels and runs this.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import harness
from harness import WIKITEXT, fmt

import bench_calibration

JOBS = [  # (algorithm, quantkit recipe, llm-compressor runner recipe, model: big | small), in the order they run
    ("GPTQ W4A16", "gptq-w4a16", "gptq-w4a16", "small"),
    ("AWQ W4A16", "awq-w4a16", "awq-w4a16", "small"),
    ("AutoRound W4A16", "autoround-w4a16", "autoround-w4a16", "small"),
    ("GPTQ W4A16", "gptq-w4a16", "gptq-w4a16", "big"),
    ("AWQ W4A16", "awq-w4a16", "awq-w4a16", "big"),
]


@dataclass
class Job:
    tool: str
    algorithm: str
    recipe: str
    model: str  # big | small
    dst: Path
    cmd: list[str]
    seconds: float | None = None
    calibration_s: float | None = None
    split: dict = field(default_factory=dict)  # quantkit: seconds per calibration phase
    gpu_peak_mib: float | None = None
    gpu_util_pct: float | None = None
    returncode: int = 0
    error: str = ""
    perplexity: float | None = None


class GpuSampler:
    """GPU 0's memory in use and utilisation, sampled every `period` seconds in a thread (NVML)."""

    def __init__(self, period: float = 0.05):
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle, self.period = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0), period

    def used_mib(self) -> float:
        return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / harness.MIB

    def __enter__(self):
        self.base, self.peak, self.utils, self.stop = self.used_mib(), 0.0, [], threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.used_mib())
            self.utils.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            time.sleep(self.period)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    @property
    def peak_mib(self) -> float:
        return max(0.0, self.peak - self.base)

    @property
    def mean_util(self) -> float | None:
        return sum(self.utils) / len(self.utils) if self.utils else None


# ---------------------------------------------------------------- models and data


def big_model(workdir: Path, text: Path, layers: int) -> Path:
    shape = {**harness.llama_shape(2048), "num_hidden_layers": layers}
    return harness.build_llama(workdir / f"llama-h2048-l{layers}-bf16", text, "bfloat16", **shape)


def small_model(workdir: Path, args: argparse.Namespace) -> Path:
    init = bench_calibration.build_init(workdir, args.train_text, args.hidden)
    return bench_calibration.train_model(workdir, init, args.train_text, args.train_steps, args.threads)


# ---------------------------------------------------------------- jobs


def make_jobs(models: dict[str, Path], calib: dict[str, Path], workdir: Path, args: argparse.Namespace) -> list[Job]:
    out = workdir / "out"
    out.mkdir(parents=True, exist_ok=True)
    runner = harness.write_llmc_runner(workdir)
    jobs = []
    for algorithm, recipe, llmc_recipe, which in JOBS:
        if which not in models or (args.only and recipe not in args.only):
            continue
        samples, seq_len = (args.big_samples, args.big_seq_len) if which == "big" else (args.num_samples, args.seq_len)
        chosen = bench_calibration.autoround_recipe(recipe, args.autoround_iters, out) if recipe.startswith("autoround") else recipe
        options = harness.calibration_options(args.calib_data, samples, seq_len) + ["--device", args.device]
        dst = out / f"quantkit-{recipe}-{which}"
        jobs.append(Job("quantkit", algorithm, recipe, which, dst,
                        harness.finalize_command(models[which], dst, chosen, args.threads, *options)))
        if args.llmc_python:
            dst = out / f"llmc-{llmc_recipe}-{which}"
            cmd = harness.llmc_command(args.llmc_python, runner, models[which], dst, calib[which], llmc_recipe, "default",
                                       args.threads, iters=args.autoround_iters)
            jobs.append(Job("llm-compressor", algorithm, llmc_recipe, which, dst, cmd))
    return jobs


def run(job: Job, sampler: GpuSampler | None, logs: Path, threads: int) -> None:
    import shutil

    shutil.rmtree(job.dst, ignore_errors=True)
    env = harness.thread_env(threads)
    with sampler if sampler is not None else contextlib.nullcontext() as sampled:
        measured, printed = harness.measure_logged(job.cmd, env, logs / f"{job.dst.name}.log")
    job.returncode = measured.returncode
    if measured.returncode:
        job.error = measured.stderr_tail
        return
    job.seconds = measured.seconds
    if sampled is not None:
        job.gpu_peak_mib, job.gpu_util_pct = sampled.peak_mib, sampled.mean_util
    reported = harness.last_json_line(printed) or {}
    job.calibration_s = reported.get("oneshot_s")
    made = job.dst / "quantkit.json"
    if made.is_file():
        calibration = json.loads(made.read_text()).get("calibration") or {}
        job.split = {k: round(v, 2) for k, v in (calibration.get("seconds") or {}).items()}
        job.calibration_s = sum(job.split.values()) or None


def perplexities(jobs: list[Job], small: Path, args: argparse.Namespace, workdir: Path) -> float | None:
    """The small model's and its artifacts' perplexities, one `quantkit eval` on the GPU (each model alone if that fails)."""
    done = [job for job in jobs if job.model == "small" and not job.returncode]
    found, errors = bench_calibration.perplexities([small] + [job.dst for job in done], args, workdir)
    for job in done:
        job.perplexity = found.get(str(job.dst))
        job.error = job.error or errors.get(str(job.dst), "")
    return found.get(str(small))


# ---------------------------------------------------------------- report


def table(jobs: list[Job], float_ppl: float | None) -> str:
    header = ["model", "algorithm", "tool", "wall s", "calibration s", "GPU peak MiB", "GPU util %", "perplexity",
              "quantkit split (s)"]
    rows = []
    for job in jobs:
        split = ", ".join(f"{k} {v:g}" for k, v in job.split.items()) if job.split else ""
        rows.append([job.model, job.algorithm, job.tool, fmt(job.seconds, ".1f"), fmt(job.calibration_s, ".1f"),
                     fmt(job.gpu_peak_mib, ".0f"), fmt(job.gpu_util_pct, ".0f"),
                     fmt(job.perplexity, ".3f") if job.model == "small" else "", split or ("FAILED" if job.returncode else "")])
    note = f"\n\nfloat model perplexity (small): {fmt(float_ppl, '.3f')}" if float_ppl is not None else ""
    return harness.markdown_table(header, rows, "lllrrrrrl") + note


def ratios(jobs: list[Job]) -> list[dict]:
    """quantkit / llm-compressor per (model, algorithm): wall, GPU peak, perplexity."""
    out = []
    for job in jobs:
        if job.tool != "quantkit":
            continue
        peer = next((j for j in jobs if j.tool != "quantkit" and (j.model, j.algorithm) == (job.model, job.algorithm)), None)
        if peer is None:
            continue

        def ratio(a, b):
            return a / b if a is not None and b else None

        out.append({"model": job.model, "algorithm": job.algorithm, "wall": ratio(job.seconds, peer.seconds),
                    "gpu_peak": ratio(job.gpu_peak_mib, peer.gpu_peak_mib),
                    "perplexity": ratio(job.perplexity, peer.perplexity)})
    return out


def report(jobs: list[Job], float_ppl: float | None, facts: dict, json_path: Path | None, show: bool = True) -> None:
    if json_path:
        data = {"facts": facts, "float_perplexity": float_ppl, "ratios": ratios(jobs),
                "jobs": [{**asdict(j), "dst": str(j.dst), "cmd": [str(c) for c in j.cmd]} for j in jobs]}
        json_path.write_text(json.dumps(data, indent=2))
    if not show:
        return
    print(table(jobs, float_ppl))
    found = ratios(jobs)
    if found:
        print("\nquantkit / llm-compressor:")
        for r in found:
            print(f"  {r['model']:5} {r['algorithm']:16} wall {fmt(r['wall'], '.2f')}x  GPU peak {fmt(r['gpu_peak'], '.2f')}x  "
                  f"perplexity {fmt(r['perplexity'], '.4f')}x")
    for job in jobs:
        if job.error:
            print(f"\n{job.tool} {job.recipe} ({job.model}) failed:\n{job.error[-1500:]}", file=sys.stderr)


def machine_facts(args: argparse.Namespace) -> dict:
    import torch

    facts = {**harness.host_facts(), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
             "quantkit": harness.versions("torch", "transformers", "compressed-tensors"),
             "llm-compressor": harness.llmc_versions(args.llmc_python), "threads": args.threads}
    return facts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llmc-python", type=Path, help="a python that imports llmcompressor; without it only quantkit runs")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-gpu"))
    p.add_argument("--only", nargs="+", metavar="RECIPE", help="only these quantkit recipes (and the peer's)")
    p.add_argument("--no-big", action="store_true", help="skip the 0.84B model")
    p.add_argument("--no-small", action="store_true", help="skip the trained small model")
    p.add_argument("--big-layers", type=int, default=16)
    p.add_argument("--big-samples", type=int, default=64)
    p.add_argument("--big-seq-len", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512, help="the small model's hidden size")
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--train-text", type=Path, default=WIKITEXT / "valid.txt")
    p.add_argument("--calib-data", type=Path, default=WIKITEXT / "valid.txt")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-data", type=Path, default=WIKITEXT / "test.txt")
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--autoround-iters", type=int, default=200)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--device", default="cuda", help="quantkit's --device (cpu: a dry run of this script without a GPU)")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    logs = args.workdir / "logs"
    logs.mkdir(exist_ok=True)
    models, calib = {}, {}
    if not args.no_small:
        models["small"] = small_model(args.workdir, args)
        calib["small"] = harness.write_calibration(models["small"], args.calib_data, args.num_samples, args.seq_len, args.workdir)
    facts = {}  # filled at the end: torch.cuda in this process before a model is built (in a fork) would break the build
    try:
        sampler = GpuSampler()
    except Exception as exc:  # no NVML: times only
        print(f"note: no GPU sampling ({exc})", file=sys.stderr)
        sampler = None
    jobs, float_ppl = [], None
    for which in ("small", "big"):  # the small model's perplexities first: a run cut short still has them
        if which == "big" and not args.no_big:
            models["big"] = big_model(args.workdir, args.train_text, args.big_layers)
            (args.workdir / "big").mkdir(exist_ok=True)
            calib["big"] = harness.write_calibration(models["big"], args.calib_data, args.big_samples, args.big_seq_len,
                                                     args.workdir / "big")
        if which not in models:
            continue
        batch = make_jobs({which: models[which]}, calib, args.workdir, args)
        jobs += batch
        for job in batch:
            run(job, sampler, logs, args.threads)
            state = f"{job.seconds:.1f}s" if not job.returncode else f"FAILED (rc {job.returncode})"
            print(f"{job.tool} {job.recipe} ({job.model}): {state}", file=sys.stderr, flush=True)
            report(jobs, float_ppl, facts, args.json, show=False)  # what is done so far survives a run cut short
        if which == "small":
            float_ppl = perplexities(jobs, models["small"], args, args.workdir)
            report(jobs, float_ppl, facts, args.json)
    report(jobs, float_ppl, machine_facts(args), args.json)


if __name__ == "__main__":
    main()
