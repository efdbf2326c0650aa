"""Benchmark streamed finalize: peak RSS and wall time on a ~2 GB bf16 model, against the in-memory path and
llm-compressor's `oneshot`, in one run.

Run from the repository root (with the venv active):

    python scripts/bench_streaming.py --llmc-python /tmp/llmc-venv/bin/python --json streaming.json

(see scripts/bench_calibration.py's docstring for the llm-compressor venv). What it does:

* builds, once, under `--workdir`: a Llama of random weights (hidden 2048, MLP 5632, 16 layers, 32 heads,
  vocab 8192: 1.7 GB in bf16) saved in 500 MB safetensors shards, and a tiny model of the same family
  (hidden 64, 2 layers) for the fixed cost;
* runs, as measured subprocesses with the same thread count (peak RSS from `os.wait4`, wall time around it),
  for `int4-weight-only` (RTN) and `gptq-w4a16` (8 x 128 calibration tokens from `--text`):
  - `quantkit finalize` streamed (the default),
  - `quantkit finalize --in-memory` (the whole model loaded, as before streaming),
  - llm-compressor's `oneshot` on the same model and the same token blocks (RTN: `QuantizationModifier`
    W4A16; GPTQ: `GPTQModifier` W4A16), when `--llmc-python` is given,
  - the streamed quantkit command on the tiny model: the fixed cost (interpreter, torch, transformers);
* reports each peak, the peak above the fixed cost as a share of the model's size, and the ratios to the
  in-memory path and to llm-compressor (with `--repeats N`: each command N times in alternating order, the
  fastest time and the highest peak). Targets (issue 10): peak above the fixed cost <= 0.4 x the model for
  both recipes, <= 0.5 x llm-compressor's peak, wall time no worse than the in-memory path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import harness
from harness import MIB

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=8192, max_position_embeddings=2048)
TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=8192, max_position_embeddings=2048)
RECIPES = {"int4-weight-only": "rtn-w4a16", "gptq-w4a16": "gptq-w4a16"}  # quantkit recipe -> the llmc runner's


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = harness.build_llama(args.workdir / "llama-2gb-bf16", args.text, "bfloat16", generate_if_missing=True,
                                max_shard_size="500MB", **SHAPE)
    tiny = harness.build_llama(args.workdir / "llama-tiny-bf16", args.text, "bfloat16", generate_if_missing=True, **TINY)
    model_bytes = harness.safetensors_bytes(model)
    ids = harness.write_calibration(model, args.text, args.num_samples, args.seq_len, args.workdir)
    runner = harness.write_llmc_runner(args.workdir) if args.llmc_python else None
    env = harness.thread_env(args.threads)
    calib = harness.calibration_options(args.text, args.num_samples, args.seq_len)
    rows = []
    for recipe in args.recipes:
        options = calib if recipe != "int4-weight-only" else []
        jobs = [("quantkit, tiny model (fixed cost)", harness.finalize_command(tiny, args.workdir / "out-tiny", recipe, args.threads, *options)),
                ("quantkit streamed", harness.finalize_command(model, args.workdir / "out-streamed", recipe, args.threads, *options))]
        if not args.skip_in_memory:
            jobs.append(("quantkit --in-memory", harness.finalize_command(model, args.workdir / "out-in-memory", recipe,
                                                                          args.threads, *options, "--in-memory")))
        if runner:
            jobs.append(("llm-compressor oneshot", harness.llmc_command(args.llmc_python, runner, model, args.workdir / "out-llmc",
                                                                        ids, RECIPES[recipe], "default", args.threads)))
        runs: dict[str, list] = {label: [] for label, _ in jobs}
        for out in ("out-tiny", "out-streamed", "out-in-memory"):  # an interrupted earlier run's work directory
            shutil.rmtree(args.workdir / f"{out}.partial", ignore_errors=True)
        for repeat in range(args.repeats):  # the measured runs alternate order: a slow spell of the machine hits both
            for label, cmd in jobs if repeat % 2 == 0 else jobs[:1] + jobs[:0:-1]:
                print(f"{recipe}: {label} ({repeat + 1}/{args.repeats}) ...", file=sys.stderr, flush=True)
                run = harness.measure(cmd, env)
                if run.returncode:
                    sys.exit(f"{label} failed ({run.returncode}):\n{run.stderr_tail}")
                runs[label].append(run)
                print(f"  {run.seconds:.1f} s, peak RSS {run.peak_rss_mib:.0f} MiB", file=sys.stderr, flush=True)
        measured = {label: fastest(done) for label, done in runs.items()}
        for out in ("out-tiny", "out-streamed", "out-in-memory", "out-llmc"):
            shutil.rmtree(args.workdir / out, ignore_errors=True)
        rows.append(summarize(recipe, measured, model_bytes))
    report = {"model": str(model), "model_bytes": model_bytes, "shape": SHAPE, "threads": args.threads,
              "calibration": f"{args.num_samples} x {args.seq_len} tokens of {args.text}",
              "host": harness.host_facts(), "llmc": harness.llmc_versions(args.llmc_python), "rows": rows}
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def fastest(runs: list) -> harness.Run:
    """The fastest of a command's repeats, with the highest peak RSS any of them reached."""
    best = min(runs, key=lambda run: run.seconds)
    return dataclasses.replace(best, peak_rss_kib=max(run.peak_rss_kib for run in runs))


def summarize(recipe: str, measured: dict, model_bytes: int) -> dict:
    fixed = measured["quantkit, tiny model (fixed cost)"].peak_rss_kib * 1024
    streamed, whole = measured["quantkit streamed"], measured.get("quantkit --in-memory")
    llmc = measured.get("llm-compressor oneshot")
    above = streamed.peak_rss_kib * 1024 - fixed
    return {
        "recipe": recipe,
        "runs": {label: {"seconds": round(run.seconds, 1), "peak_rss_mib": round(run.peak_rss_mib)} for label, run in measured.items()},
        "fixed_mib": round(fixed / MIB),
        "streamed_above_fixed_vs_model": round(above / model_bytes, 3),
        "in_memory_above_fixed_vs_model": round((whole.peak_rss_kib * 1024 - fixed) / model_bytes, 3) if whole else None,
        "streamed_vs_llmc_peak": round(streamed.peak_rss_kib / llmc.peak_rss_kib, 3) if llmc else None,
        "streamed_vs_in_memory_wall": round(streamed.seconds / whole.seconds, 3) if whole else None,
        "streamed_vs_llmc_wall": round(streamed.seconds / llmc.seconds, 3) if llmc else None,
    }


def print_report(report: dict) -> None:
    print(f"model: {report['model']} ({report['model_bytes'] / 1e9:.2f} GB bf16), {report['threads']} threads, "
          f"calibration {report['calibration']}; llm-compressor: {report['llmc'] or 'skipped'}")
    header = ["recipe", "run", "wall s", "peak RSS MiB"]
    lines = [[row["recipe"], label, f"{run['seconds']:.1f}", str(run["peak_rss_mib"])]
             for row in report["rows"] for label, run in row["runs"].items()]
    print(harness.markdown_table(header, lines, "llrr"))
    for row in report["rows"]:
        print(f"- {row['recipe']}: streamed peak above the fixed cost ({row['fixed_mib']} MiB) = "
              f"{row['streamed_above_fixed_vs_model']:.3f} x the model (in-memory: {harness.fmt(row['in_memory_above_fixed_vs_model'], '.3f')} x); "
              f"streamed / llm-compressor peak = {harness.fmt(row['streamed_vs_llmc_peak'], '.3f')}; wall streamed / in-memory = "
              f"{harness.fmt(row['streamed_vs_in_memory_wall'], '.3f')}, streamed / llm-compressor = {harness.fmt(row['streamed_vs_llmc_wall'], '.3f')}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-streaming"))
    p.add_argument("--text", type=Path, default=harness.WIKITEXT / "valid.txt", help="tokenizer and calibration text")
    p.add_argument("--llmc-python", type=Path, help="python of a venv with llmcompressor; without it only quantkit runs")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1,
                   help="run each command this many times, alternating the order; report the fastest and the highest peak")
    p.add_argument("--skip-in-memory", action="store_true", help="leave out the --in-memory runs (the longest)")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
