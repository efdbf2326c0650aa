"""Benchmark calibration at real sizes on one GPU: a Llama-3.1-8B-shaped model (and reduced-depth copies of it and
of Qwen3-30B-A3B), quantkit against llm-compressor, both in the same call.

The models are built on the machine from their configs with random bf16 weights (scripts/build_large_checkpoint.py:
no download), on its local disk; the calibration text is WikiText-2 and Tiny Shakespeare, repeated until it holds
the tokens asked for (the weights are random: only the token count matters to time and memory). Each job is one
subprocess with its own time limit: `quantkit finalize ... --device cuda [--max-gpu-memory SIZE]`, or
scripts/harness.py's llm-compressor runner (`oneshot`, the same token blocks). Measured per job: wall time, the GPU's
memory in use (NVML, every 50 ms, minus what was in use before) and its mean utilisation; for quantkit also its
time split, its own allocator peak and the preflight's estimate (from `--json`). Jobs run in the order given and
stop being started once `--deadline` seconds have passed, so that a device call ends with what it measured;
with `--done FILE` the same command run again skips the jobs an earlier call completed.

    python scripts/bench_gpu_scale.py --llmc-python /tmp/llmc-python --json scale.json \\
        --jobs qk:gptq-w4a16:8b:512 qk:gptq-w4a16:8b-l8:512:22GiB llmc:gptq-w4a16:8b-l8:128

A job is TOOL:RECIPE:MODEL:SAMPLES[:BUDGET]: TOOL qk (quantkit) or llmc; MODEL 8b (32 layers), 8b-lN (N layers),
moe-lN (Qwen3-30B-A3B with N of its 48 layers); SAMPLES x `--seq-len` tokens; BUDGET quantkit's --max-gpu-memory.
A `gguf-*` RECIPE writes MODEL as one .gguf file (llama.cpp's K search on the GPU). RECIPE+actorder /
RECIPE+noactorder (quantkit) runs the recipe with GPTQ's `actorder` true / false; RECIPE+noactorder
(llm-compressor) with `actorder: None` (its default: static actorder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import harness
from bench_gpu import GpuSampler
from harness import fmt

HERE = Path(__file__).resolve().parent
SHAPES = {"8b": ("llama-3.1-8b", 32), "moe": ("qwen3-30b-a3b", 48)}


@dataclass
class ScaleJob:
    spec: str
    tool: str
    recipe: str
    model: str
    samples: int
    budget: str | None
    seconds: float | None = None
    returncode: int | None = None
    gpu_peak_mib: float | None = None
    gpu_util_pct: float | None = None
    torch_peak_mib: float | None = None  # quantkit: torch's allocator peak during calibration
    torch_reserved_mib: float | None = None  # quantkit: what the allocator reserved at most (its cache included):
    # NVML's peak minus it is the CUDA context and what is allocated outside torch's allocator
    outside_mib: float | None = None  # quantkit: the most the GPU's memory in use exceeded torch's reserved at a
    # layer's end (the CUDA context, the libraries' kernels and workspaces)
    estimate_mib: float | None = None  # quantkit: the preflight's GPU peak (with the CUDA context)
    mode: str | None = None  # quantkit: hidden states resident or offloaded
    split: dict = field(default_factory=dict)
    layers: int | None = None
    error: str = ""


class NoSampler:
    peak_mib = mean_util = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def parse_job(spec: str) -> ScaleJob:
    parts = spec.split(":")
    if len(parts) not in (4, 5) or parts[0] not in ("qk", "llmc"):
        sys.exit(f"--jobs {spec}: write TOOL:RECIPE:MODEL:SAMPLES[:BUDGET], e.g. qk:gptq-w4a16:8b:512")
    return ScaleJob(spec, parts[0], parts[1], parts[2], int(parts[3]), parts[4] if len(parts) == 5 else None)


def model_dir(name: str, cache: Path, text: Path) -> tuple[Path, int]:
    """The checkpoint for MODEL (8b, 8b-lN, moe-lN), built once under `cache`; its decoder layer count."""
    base, _, depth = name.partition("-l")
    shape, full = SHAPES[base]
    layers = int(depth) if depth else full
    cmd = [sys.executable, str(HERE / "build_large_checkpoint.py"), "--shape", shape, "--cache", str(cache), "--text", str(text)]
    if layers != full:
        cmd += ["--layers", str(layers)]
    built = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return Path(built.stdout.strip().splitlines()[-1]), layers


def calibration_text(texts: list[Path], tokens: int, out: Path) -> Path:
    """`texts` joined and repeated until about 5 characters a token cover `tokens` tokens."""
    body = "\n\n".join(p.read_text(encoding="utf-8") for p in texts if p.is_file())
    out.write_text("\n\n".join([body] * max(1, -(-5 * tokens // max(1, len(body))))), encoding="utf-8")
    return out


def command(job: ScaleJob, src: Path, dst: Path, calib: Path, ids: Path | None, args: argparse.Namespace,
            runner: Path | None) -> list[str]:
    base, _, variant = job.recipe.partition("+")
    if job.tool == "llmc":  # +noactorder: GPTQ's columns in their own order (llm-compressor's default: static actorder)
        return harness.llmc_command(args.llmc_python, runner, src, dst, ids, base, "none" if variant else "default",
                                    args.threads)
    recipe = base
    if variant in ("actorder", "noactorder"):  # quantkit's recipe with GPTQ's actorder on or off
        shown = subprocess.run(harness.quantkit_command("recipes", "show", base), check=True, capture_output=True, text=True)
        path = args.workdir / f"{base}-{variant}.yaml"
        on = variant == "actorder"
        path.write_text(shown.stdout.replace(f"actorder: {str(not on).lower()}", f"actorder: {str(on).lower()}"))
        recipe = str(path)
    options = harness.calibration_options(calib, job.samples, args.seq_len) + ["--device", args.device, "--json", str(dst) + ".json"]
    if job.budget:
        options += ["--max-gpu-memory", job.budget]
    return harness.finalize_command(src, dst, recipe, args.threads, *options)


def _remove(dst: Path) -> None:
    """An artifact: a directory, or one file (GGUF)."""
    if dst.is_file():
        dst.unlink()
    shutil.rmtree(dst, ignore_errors=True)


def run(job: ScaleJob, cmd: list[str], dst: Path, sampler, logs: Path, timeout: float, threads: int) -> None:
    _remove(dst)
    with sampler as sampled:
        measured, _ = harness.measure_logged(["timeout", str(int(timeout))] + cmd, harness.thread_env(threads),
                                             logs / f"{job.spec.replace(':', '_')}.log")
    job.returncode, job.seconds = measured.returncode, measured.seconds
    job.gpu_peak_mib, job.gpu_util_pct = sampled.peak_mib, sampled.mean_util
    if measured.returncode:
        job.error = ("timed out after %d s; " % timeout if measured.returncode == 124 else "") + measured.stderr_tail[-1500:]
    report = Path(str(dst) + ".json")
    if report.is_file():
        result = json.loads(report.read_text())
        result = result.get("result", result)
        calib = result.get("calibration") or {}
        job.split = {k: round(v, 1) for k, v in (calib.get("seconds") or {}).items()} | outside_phases(
            calib, result.get("seconds"), measured.seconds)
        job.torch_peak_mib = (calib.get("peak_device_bytes") or 0) / harness.MIB or None
        job.torch_reserved_mib = (calib.get("peak_device_reserved_bytes") or 0) / harness.MIB or None
        job.outside_mib = (calib.get("device_outside_allocator_bytes") or 0) / harness.MIB or None
        job.mode = calib.get("hidden_states")
        estimate = (result.get("preflight") or {}).get("peak_device_bytes")
        job.estimate_mib = estimate / harness.MIB if estimate else None
    _remove(dst)  # the disk holds the models, not every artifact


def outside_phases(calib: dict, finalize_seconds: float | None, wall: float) -> dict[str, float]:
    """Where the rest of the process's wall went: calibration's time outside its phases, finalize's outside
    calibration (the checks, tokenizing, the preflight, the modules outside the layers written at the end), and
    the process's before finalize (imports, CUDA's start)."""
    phases = sum((calib.get("seconds") or {}).values())
    inside = calib.get("wall_seconds")
    split = {}
    if inside:
        split["calibration's other"] = round(inside - phases, 1)
        if finalize_seconds:
            split["finalize's other"] = round(finalize_seconds - inside, 1)
    if finalize_seconds:
        split["start"] = round(wall - finalize_seconds, 1)
    return split


def table(jobs: list[ScaleJob], seq_len: int) -> str:
    header = ["job", "model (layers)", "tokens", "wall s", "GPU peak MiB (NVML)", "torch peak MiB",
              "torch reserved MiB", "outside torch MiB", "preflight MiB",
              "hidden states", "GPU util %", "quantkit split (s)"]
    rows = [[f"{j.tool} {j.recipe}" + (f" --max-gpu-memory {j.budget}" if j.budget else ""), f"{j.model} ({j.layers})",
             f"{j.samples} x {seq_len}",
             fmt(j.seconds, ".1f") + ("" if not j.returncode else f" (FAILED rc {j.returncode})"),
             fmt(j.gpu_peak_mib, ".0f"), fmt(j.torch_peak_mib, ".0f"), fmt(j.torch_reserved_mib, ".0f"), fmt(j.outside_mib, ".0f"),
             fmt(j.estimate_mib, ".0f"), j.mode or "",
             fmt(j.gpu_util_pct, ".0f"), ", ".join(f"{k} {v:g}" for k, v in j.split.items())] for j in jobs]
    return harness.markdown_table(header, rows, "llrrrrrrrlrl")


def save(jobs: list[ScaleJob], args: argparse.Namespace, facts: dict) -> None:
    if args.json:
        args.json.write_text(json.dumps({"facts": facts, "seq_len": args.seq_len, "jobs": [asdict(j) for j in jobs]}, indent=2))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", nargs="+", required=True, metavar="TOOL:RECIPE:MODEL:SAMPLES[:BUDGET]")
    p.add_argument("--llmc-python", type=Path, help="a python that imports llmcompressor (for llmc jobs)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-scale"))
    p.add_argument("--text", type=Path, nargs="+", default=[harness.WIKITEXT / "valid.txt", harness.WIKITEXT / "test.txt"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300, help="seconds a job may run")
    p.add_argument("--deadline", type=float, default=1e9, help="start no job after this many seconds")
    p.add_argument("--min-left", type=float, default=30, help="start no job with fewer seconds than this left before "
                   "the deadline (a job stopped by it measured nothing)")
    p.add_argument("--device", default="cuda", help="quantkit's --device (cpu: a dry run of this script without a GPU)")
    p.add_argument("--json", type=Path)
    p.add_argument("--done", type=Path, help="a file of the jobs already measured (one spec a line): they are "
                   "skipped, and each job this run completes is added, so that the same command in a second device "
                   "call on the same machine goes on where the first stopped")
    p.add_argument("--build-only", action="store_true",
                   help="build the models the jobs name and stop (run beside other work before the timed jobs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    logs = args.workdir / "logs"
    logs.mkdir(exist_ok=True)
    done = set(args.done.read_text().split()) if args.done and args.done.is_file() else set()
    jobs = [parse_job(spec) for spec in args.jobs if spec not in done]
    if done:
        print(f"skipped, measured in an earlier call: {' '.join(s for s in args.jobs if s in done)}", file=sys.stderr)
    if not jobs:
        print("every job was measured in an earlier call", file=sys.stderr)
        return
    if args.build_only:
        for name in dict.fromkeys(job.model for job in jobs):
            began = time.perf_counter()
            path, _ = model_dir(name, args.workdir / "models", args.text[0])
            print(f"built {name} in {time.perf_counter() - began:.0f} s: {path}", flush=True)
        return
    most = max(j.samples for j in jobs)
    calib = calibration_text(args.text, most * args.seq_len, args.workdir / "calib.txt")
    runner = harness.write_llmc_runner(args.workdir) if any(j.tool == "llmc" for j in jobs) else None
    try:
        sampler = GpuSampler()
    except Exception as exc:  # noqa: BLE001 - no NVML (a dry run on a CPU): times only
        print(f"note: no GPU sampling ({exc})", file=sys.stderr)
        sampler = NoSampler()
    facts = {**harness.host_facts(), "quantkit": harness.versions("torch", "transformers", "compressed-tensors"),
             "llm-compressor": harness.llmc_versions(args.llmc_python)}
    models: dict[str, tuple[Path, int]] = {}
    for job in jobs:
        left = args.deadline - (time.perf_counter() - started)
        if left < args.min_left:
            job.error = "not started: the deadline passed"
            continue
        if job.model not in models:
            began = time.perf_counter()
            models[job.model] = model_dir(job.model, args.workdir / "models", args.text[0])
            print(f"built {job.model} in {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
        src, job.layers = models[job.model]
        ids = None
        if job.tool == "llmc":
            ids = harness.write_calibration(src, calib, job.samples, args.seq_len, args.workdir)
        dst = args.workdir / "out" / (job.spec.replace(":", "_") + (".gguf" if job.recipe.startswith("gguf-") else ""))
        dst.parent.mkdir(exist_ok=True)
        run(job, command(job, src, dst, calib, ids, args, runner), dst, sampler, logs, min(args.timeout, left), args.threads)
        print(f"{job.spec}: {fmt(job.seconds, '.1f')} s, GPU peak {fmt(job.gpu_peak_mib, '.0f')} MiB, rc {job.returncode}",
              file=sys.stderr, flush=True)
        if args.done and job.returncode == 0:
            with args.done.open("a") as f:
                f.write(job.spec + "\n")
        save(jobs, args, facts)
    print(table(jobs, args.seq_len))
    for job in jobs:
        if job.error:
            print(f"\n{job.spec}: {job.error}", file=sys.stderr)
    save(jobs, args, facts)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
