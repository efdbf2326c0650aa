"""Distributed GPTQ calibration: 1 rank x 1 thread, 1 rank x 2 threads and 2 ranks x 1 thread, in one run.

    python scripts/bench_distributed.py [--repeats 2] [--model DIR] [--json out.json]

GPTQ W4A16 (`gptq-w4a16`) on the ~68M-parameter Llama that scripts/bench_finalize.py builds (hidden 1024,
4 layers, MLP 2816, vocab 8192; or --model DIR), with 64 x 256 calibration tokens from WikiText-2 valid.
Each configuration is a separate `quantkit finalize` process (the 2-rank one self-launches torchrun), run in
turn round after round; wall time includes imports and loading. Peak RSS is the largest single process of the
run (for the 2-rank run: one rank, or the launcher). The 2-rank artifact is checked against the 1-rank one.

With `--llmc-python PY` (a venv with llm-compressor, as for scripts/bench_calibration.py), llm-compressor's
oneshot GPTQModifier W4A16 runs the same three configurations right after quantkit's, in the same round, on
the same calibration token ids (quantkit's blocks, saved to a file): 1 process with 1 or 2 threads, and 2
processes under `torch.distributed.run` (its distributed oneshot: each rank gets half the samples; gloo, as its
`init_dist` needs an accelerator). Its 2-rank artifact is compared with its 1-rank one too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_finalize import build_source, measure, quantkit_executable, safetensors_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"1 rank x 1 thread": (1, 1), "1 rank x 2 threads": (1, 2), "2 ranks x 1 thread": (2, 1)}


def command(src: Path, dst: Path, calib: Path, ranks: int, threads: int, samples: int, seq_len: int) -> list[str]:
    cmd = [quantkit_executable(), "finalize", str(src), str(dst), "-q", "gptq-w4a16", "--calib-data", str(calib),
           "--num-samples", str(samples), "--seq-len", str(seq_len), "--threads", str(threads), "--quiet", "--overwrite"]
    return cmd + (["--nproc-per-node", str(ranks)] if ranks > 1 else [])


def llmc_command(python: Path, runner: Path, src: Path, dst: Path, ids: Path, ranks: int, threads: int) -> list[str]:
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1 else []
    return [str(python), *launch, str(runner), str(src), str(dst), str(ids), "gptq-w4a16", "default", str(threads)]


def run_round(src: Path, work: Path, calib: Path, args, llmc: tuple[Path, Path] | None) -> dict[str, tuple[float, int, int]]:
    results = {}
    tools = [("quantkit", lambda dst, r, t: command(src, dst, calib, r, t, args.samples, args.seq_len))]
    if llmc:
        runner, ids = llmc
        tools.append(("llm-compressor", lambda dst, r, t: llmc_command(args.llmc_python, runner, src, dst, ids, r, t)))
    for tool, make in tools:
        for label, (ranks, threads) in CONFIGS.items():
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            dst = work / tool / label.replace(" ", "")
            shutil.rmtree(dst, ignore_errors=True)
            run = measure(make(dst, ranks, threads), env)
            if run.returncode:
                sys.exit(f"{tool} {label} failed:\n{run.stderr_tail}")
            results[f"{tool}: {label}"] = (run.seconds, run.peak_rss_kib, run.returncode)
            print(f"{tool} {label}: {run.seconds:.1f} s, peak RSS {run.peak_rss_kib / 1024:.0f} MiB", file=sys.stderr)
    return results


def same_artifact(work: Path) -> bool:
    from safetensors.torch import load_file

    one = load_file(next((work / "1rankx1thread").glob("*.safetensors")))
    two = load_file(next((work / "2ranksx1thread").glob("*.safetensors")))
    return one.keys() == two.keys() and all((one[k] == two[k]).all() for k in one)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model directory (default: build the 68M Llama)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench"))
    parser.add_argument("--text", type=Path, default=ROOT.parent / "shared/data/wikitext-2/valid.txt")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--llmc-python", type=Path, help="python of a venv with llmcompressor: run it side by side")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.model or build_source(args.workdir, args.text, "bfloat16", 16)
    work = args.workdir / "distributed"
    llmc = None
    if args.llmc_python:
        from bench_calibration import LLMC_RUNNER, write_calibration

        runner = work / "llmc_runner.py"
        work.mkdir(parents=True, exist_ok=True)
        runner.write_text(LLMC_RUNNER)
        llmc = (runner, write_calibration(src, args.text, args.samples, args.seq_len, work))
    rounds = [run_round(src, work, args.text, args, llmc) for _ in range(args.repeats)]
    labels = list(rounds[0])
    medians = {label: statistics.median(r[label][0] for r in rounds) for label in labels}
    rss = {label: max(r[label][1] for r in rounds) / 1024 for label in labels}
    print(f"model {src} ({safetensors_bytes(src) / 2**20:.0f} MiB), gptq-w4a16, {args.samples} x {args.seq_len} tokens, "
          f"{args.repeats} round(s)\n")
    print("| tool: configuration | wall s (median) | speed-up vs its 1x1 | peak RSS MiB |\n|---|---|---|---|")
    for label in labels:
        base = medians[label.split(":")[0] + ": 1 rank x 1 thread"]
        print(f"| {label} | {medians[label]:.1f} | {base / medians[label]:.2f}x | {rss[label]:.0f} |")
    identical = {tool: same_artifact(work / tool) for tool in ("quantkit", "llm-compressor") if (work / tool).is_dir()}
    print()
    for tool, same in identical.items():
        print(f"{tool}: 2-rank artifact bit-identical to its 1-rank x 1-thread one: {same}")
    if "llm-compressor: 2 ranks x 1 thread" in medians:
        ratio = medians["quantkit: 2 ranks x 1 thread"] / medians["llm-compressor: 2 ranks x 1 thread"]
        print(f"quantkit / llm-compressor wall time, 2 ranks x 1 thread each: {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"wall_s": medians, "peak_rss_mib": rss, "identical": identical}, indent=2))


if __name__ == "__main__":
    main()
