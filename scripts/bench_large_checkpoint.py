"""Benchmark round-to-nearest on a Llama-3.1-8B-shaped checkpoint streamed on the CPU: quantkit against
llm-compressor's `model_free_ptq`, wall time and peak RSS, with quantkit's preflight estimate beside each.

Run from the repository root (with the venv active):

    python scripts/bench_large_checkpoint.py --llmc-python /tmp/llmc-venv/bin/python --json large.json

(see docs/benchmarks.md for the llm-compressor venv). What it does:

* builds, once, the checkpoint (`build_large_checkpoint.py --shape llama-3.1-8b`: 8.0 B parameters of random
  bf16 weights, 16 GB in 5 GB shards) in `--cache`, in a child process, shard by shard;
* for each recipe (`int4-weight-only`, `float8-dynamic-act-float8-weight`, `nvfp4-a16`):
  - `quantkit finalize --dry-run --json`: the preflight's peak RAM (and its parts), output size and time;
  - `quantkit finalize` (streamed, the default) with `--threads`,
  - llm-compressor's `model_free_ptq` (its tool for calibration-free quantization of large checkpoints, shard
    by shard without a model definition) with the matching preset (W4A16, FP8_DYNAMIC, NVFP4A16), the embeddings
    and lm_head left in bf16 as quantkit leaves them (by name, model_free_ptq takes the embeddings for a Linear),
    `--workers` worker threads and torch limited to `--threads` threads,
  as measured subprocesses (wall time around each, peak RSS from `os.wait4`), quantkit first for the first
  recipe and second for the next (a slow spell of the machine hits both); the outputs are deleted after each.
* prints a markdown table (wall s, peak RSS GiB, the preflight's peak, the output's size) and writes `--json`.

With `--gptq-layers K` it checks GPTQ's preflight at 8B instead: `quantkit finalize -q gptq-w4a16 --dry-run` on
the whole checkpoint and on a K-layer copy (`build_large_checkpoint.py --layers K`) at `--num-samples` x
`--seq-len` tokens of `--calib-data`, then the K-layer run itself (`--checkpoint-every 0`: a resume checkpoint
after every layer), measured: its peak RSS against the estimate, its calibration seconds per layer against the
estimate's one layer, the resume state's size against the estimate's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import harness

GIB = 1024 ** 3
RECIPES = {"int4-weight-only": "W4A16", "float8-dynamic-act-float8-weight": "FP8_DYNAMIC", "nvfp4-a16": "NVFP4A16"}
HERE = Path(__file__).resolve().parent

MODEL_FREE_RUNNER = '''\
"""llm-compressor side of scripts/bench_large_checkpoint.py (written there): one model_free_ptq run."""
import sys, time

start = time.perf_counter()
src, dst, scheme, workers, threads = sys.argv[1:6]
import torch
torch.set_num_threads(int(threads))
from llmcompressor import model_free_ptq

model_free_ptq(src, dst, scheme=scheme, ignore=["lm_head", "re:.*embed_tokens$"], max_workers=int(workers), device="cpu")
print(f"model_free_ptq: {time.perf_counter() - start:.1f} s", file=sys.stderr)
'''


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.gptq_layers:
        return gptq_check(args)
    model = build_checkpoint(args.cache, args.layers)
    runner = args.workdir / "model_free_runner.py"
    runner.write_text(MODEL_FREE_RUNNER)
    env = harness.thread_env(args.threads)
    rows = []
    for i, recipe in enumerate(args.recipes):
        dst = args.workdir / "out"
        preflight = dry_run(model, dst, recipe, args.threads, env, args.workdir)
        jobs = [("quantkit", harness.finalize_command(model, dst, recipe, args.threads))]
        if args.llmc_python:
            jobs.append(("llm-compressor model_free_ptq", [str(args.llmc_python), str(runner), str(model), str(dst),
                                                           RECIPES[recipe], str(args.workers), str(args.threads)]))
        runs = {}
        for label, cmd in jobs if i % 2 == 0 else jobs[::-1]:
            shutil.rmtree(dst, ignore_errors=True)
            print(f"{recipe}: {label} ...", file=sys.stderr, flush=True)
            run = harness.measure(cmd, env)
            if run.returncode:
                sys.exit(f"{label} failed ({run.returncode}):\n{run.stderr_tail}")
            runs[label] = {"seconds": round(run.seconds, 1), "peak_rss_gib": round(run.peak_rss_kib * 1024 / GIB, 2),
                           "cpu_seconds": round(run.cpu_seconds, 1), "output_bytes": harness.safetensors_bytes(dst)}
            print(f"  {run.seconds:.1f} s, peak RSS {run.peak_rss_kib / 1024 ** 2:.2f} GiB", file=sys.stderr, flush=True)
        shutil.rmtree(dst, ignore_errors=True)
        rows.append({"recipe": recipe, "llmc_scheme": RECIPES[recipe], "preflight": preflight, "runs": runs})
    report = {"model": str(model), "model_bytes": harness.safetensors_bytes(model), "parameters": harness.parameter_count(model),
              "threads": args.threads, "llmc_workers": args.workers, "host": harness.host_facts(),
              "quantkit": harness.versions("torch", "transformers", "compressed-tensors"),
              "llmc": harness.llmc_versions(args.llmc_python), "rows": rows}
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def gptq_check(args: argparse.Namespace) -> None:
    """GPTQ's preflight on the whole checkpoint and on a few layers, against a measured run of the few layers."""
    env = harness.thread_env(args.threads)
    calib = harness.calibration_options(args.calib_data, args.num_samples, args.seq_len)
    dst = args.workdir / "out-gptq"
    whole, few = build_checkpoint(args.cache, None), build_checkpoint(args.cache, args.gptq_layers)
    estimates = {str(model): dry_run(model, dst, "gptq-w4a16", args.threads, env, args.workdir, *calib)
                 for model in (whole, few)}
    shutil.rmtree(dst, ignore_errors=True)
    cmd = harness.finalize_command(few, dst, "gptq-w4a16", args.threads, *calib, "--checkpoint-every", 0, "--json",
                                   args.workdir / "gptq-run.json")
    run = harness.measure(cmd, env)
    if run.returncode:
        sys.exit(f"the {args.gptq_layers}-layer GPTQ run failed ({run.returncode}):\n{run.stderr_tail}")
    done = json.loads((args.workdir / "gptq-run.json").read_text())
    seconds = done["calibration"]["seconds"]
    measured = {"seconds": round(run.seconds, 1), "peak_rss_gib": round(run.peak_rss_kib * 1024 / GIB, 2),
                "calibration_seconds": seconds, "per_layer_seconds": round(sum(seconds.values()) / args.gptq_layers, 1),
                "gptq_order": done["calibration"].get("gptq_order")}
    shutil.rmtree(dst, ignore_errors=True)
    report = {"samples": f"{args.num_samples} x {args.seq_len}", "threads": args.threads, "estimates": estimates,
              "measured": measured, "host": harness.host_facts()}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def build_checkpoint(cache: Path, layers: int | None) -> Path:
    """The Llama-3.1-8B-shaped checkpoint, built once by build_large_checkpoint.py in a child process (so that
    no measured command inherits its memory)."""
    cmd = [sys.executable, str(HERE / "build_large_checkpoint.py"), "--shape", "llama-3.1-8b", "--cache", str(cache)]
    cmd += ["--layers", str(layers)] if layers else []
    return Path(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1])


def dry_run(model: Path, dst: Path, recipe: str, threads: int, env: dict, workdir: Path, *options: str) -> dict:
    """quantkit's preflight for this run: peak RAM (GiB) and its parts, output bytes, time, resume state, and its
    own wall time."""
    plan_file = workdir / "dry-run.json"
    cmd = harness.quantkit_command("finalize", model, dst, "-q", recipe, *options, "--threads", threads, "--dry-run",
                                   "--json", plan_file)
    run = harness.measure(cmd, env)
    if run.returncode:
        sys.exit(f"quantkit --dry-run failed ({run.returncode}):\n{run.stderr_tail}")
    report = json.loads(plan_file.read_text())["preflight"]
    return {"peak_ram_gib": round(report["peak_ram_bytes"] / GIB, 2),
            "peak_ram_breakdown_gib": {part: round(size / GIB, 2) for part, size in report["peak_ram_breakdown"].items()},
            "output_bytes": report["output_bytes"], "work_dir_bytes": report["work_dir_bytes"], "time": report.get("time"),
            "seconds": round(run.seconds, 1)}


def print_report(report: dict) -> None:
    print(f"model: {report['model']} ({report['parameters'] / 1e9:.2f} B parameters, {report['model_bytes'] / 1e9:.1f} GB "
          f"bf16); {report['threads']} threads, model_free_ptq with {report['llmc_workers']} workers; "
          f"llm-compressor: {report['llmc'] or 'skipped'}")
    header = ["recipe", "tool", "wall s", "peak RSS GiB", "preflight peak GiB", "output GB"]
    lines = []
    for row in report["rows"]:
        for label, run in row["runs"].items():
            estimate = f"{row['preflight']['peak_ram_gib']:.2f}" if label == "quantkit" else ""
            lines.append([f"`{row['recipe']}`" if label == "quantkit" else row["llmc_scheme"], label, f"{run['seconds']:.1f}",
                          f"{run['peak_rss_gib']:.2f}", estimate, f"{run['output_bytes'] / 1e9:.2f}"])
    print(harness.markdown_table(header, lines, "llrrrr"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "quantkit-bench",
                   help="where the checkpoint is built once (about 16 GB)")
    p.add_argument("--layers", type=int, help="a reduced-depth copy with this many decoder layers (default: all 32)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-large"), help="outputs (deleted after each run)")
    p.add_argument("--llmc-python", type=Path, help="python of a venv with llmcompressor; without it only quantkit runs")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--threads", type=int, default=2, help="torch threads of each tool (and OMP_NUM_THREADS)")
    p.add_argument("--workers", type=int, default=2, help="model_free_ptq's worker threads (one shard each)")
    p.add_argument("--gptq-layers", type=int, metavar="K",
                   help="check GPTQ's preflight at 8B against a measured run of a K-layer copy instead")
    p.add_argument("--calib-data", type=Path, default=harness.WIKITEXT / "test.txt", help="GPTQ's calibration text")
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
