"""Distributed GPTQ calibration: 1 rank x 1 thread, 1 rank x 2 threads and 2 ranks x 1 thread, in one run.

    python scripts/bench_distributed.py [--repeats 2] [--model DIR] [--json out.json]

GPTQ W4A16 (`gptq-w4a16`) on the ~68M-parameter Llama that scripts/bench_finalize.py builds (hidden 1024,
4 layers, MLP 2816, vocab 8192; or --model DIR), with 64 x 256 calibration tokens from WikiText-2 valid.
Each configuration is a separate `quantkit finalize` process (the 2-rank one self-launches torchrun), run in
turn round after round; wall time includes imports and loading. Peak RSS is the largest single process of the
run (for the 2-rank run: one rank, or the launcher). The 2-rank artifact is checked against the 1-rank one.
"""

from __future__ import annotations

import argparse
import json
import os
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


def run_round(src: Path, work: Path, calib: Path, args) -> dict[str, tuple[float, int, int]]:
    results = {}
    for label, (ranks, threads) in CONFIGS.items():
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        dst = work / label.replace(" ", "")
        run = measure(command(src, dst, calib, ranks, threads, args.samples, args.seq_len), env)
        if run.returncode:
            sys.exit(f"{label} failed:\n{run.stderr_tail}")
        results[label] = (run.seconds, run.peak_rss_kib, run.returncode)
        print(f"{label}: {run.seconds:.1f} s, peak RSS {run.peak_rss_kib / 1024:.0f} MiB", file=sys.stderr)
    return results


def same_artifact(work: Path) -> bool:
    from safetensors.torch import load_file

    one = load_file(work / "1rankx1thread" / "model.safetensors")
    two = load_file(work / "2ranksx1thread" / "model.safetensors")
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
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.model or build_source(args.workdir, args.text, "bfloat16", 16)
    work = args.workdir / "distributed"
    rounds = [run_round(src, work, args.text, args) for _ in range(args.repeats)]
    medians = {label: statistics.median(r[label][0] for r in rounds) for label in CONFIGS}
    rss = {label: max(r[label][1] for r in rounds) / 1024 for label in CONFIGS}
    base = medians["1 rank x 1 thread"]
    print(f"model {src} ({safetensors_bytes(src) / 2**20:.0f} MiB), gptq-w4a16, {args.samples} x {args.seq_len} tokens\n")
    print("| configuration | wall s (median) | speed-up vs 1x1 | peak RSS MiB |\n|---|---|---|---|")
    for label in CONFIGS:
        print(f"| {label} | {medians[label]:.1f} | {base / medians[label]:.2f}x | {rss[label]:.0f} |")
    identical = same_artifact(work)
    print(f"\n2-rank artifact bit-identical to the 1-rank x 1-thread one: {identical}")
    if args.json:
        args.json.write_text(json.dumps({"wall_s": medians, "peak_rss_mib": rss, "identical": identical}, indent=2))


if __name__ == "__main__":
    main()
