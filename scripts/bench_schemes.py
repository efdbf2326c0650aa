"""Benchmark today's schemes (NVFP4, MXFP4, MXFP8, FP8 block, asymmetric int4, W4A8-FP8) against llm-compressor's
presets for the same scheme: perplexity rise over the float model, artifact size, wall time, in one run.

The same machinery as scripts/bench_calibration.py (read its docstring for the llm-compressor venv, the thread
pinning and the trained benchmark model, shared through `--workdir`):

    python scripts/bench_schemes.py --llmc-python /tmp/llmc-venv/bin/python --json schemes.json

Each row pairs a quantkit recipe with the llm-compressor runner recipe of the same scheme (scripts/harness.py's
LLM_RUNNER: QuantizationModifier / GPTQModifier / AWQModifier with compressed-tensors' preset, W4A16_ASYM,
NVFP4A16 (RTN, GPTQ, AWQ), NVFP4, MXFP4A16, MXFP4, MXFP8, FP8_BLOCK, W4AFP8), plus the W4A16 RTN and GPTQ rows the FP4 targets are
read against. Every artifact is evaluated by ONE `quantkit eval` call on this CPU: weights dequantized (the CPU
has no FP4 / FP8 kernels), activations fake-quantized at run time as compressed-tensors' forward does (FP4 / FP8
per group, per token). llm-compressor's asymmetric artifacts are evaluated through quantkit's loader too
(plain transformers cannot load packed zero points). Targets: ppl rise <= the peer's per scheme; GPTQ NVFP4A16
within 1% ppl of GPTQ W4A16.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import bench_calibration as bench
import harness
from harness import fmt

# (row, quantkit recipe, llm-compressor runner recipe)
SCHEMES = [
    ("RTN W4A16", "int4-weight-only", "rtn-w4a16"),
    ("GPTQ W4A16", "gptq-w4a16", "gptq-w4a16"),
    ("RTN W4A16 asym", "int4-asym", "rtn-w4a16-asym"),
    ("GPTQ W4A16 asym", "gptq-w4a16-asym", "gptq-w4a16-asym"),
    ("AWQ W4A16", "awq-w4a16", "awq-w4a16"),
    ("AWQ W4A16 asym", "awq-w4a16-asym", "awq-w4a16-asym"),
    ("RTN NVFP4A16", "nvfp4-a16", "rtn-nvfp4a16"),
    ("GPTQ NVFP4A16", "gptq-nvfp4-a16", "gptq-nvfp4a16"),
    ("AWQ NVFP4A16", "awq-nvfp4-a16", "awq-nvfp4a16"),
    ("RTN NVFP4 (W4A4)", "nvfp4", "rtn-nvfp4"),
    ("RTN MXFP4A16", "mxfp4-a16", "rtn-mxfp4a16"),
    ("RTN MXFP4 (W4A4)", "mxfp4", "rtn-mxfp4"),
    ("RTN MXFP8", "mxfp8", "rtn-mxfp8"),
    ("RTN FP8 block", "fp8-block", "rtn-fp8-block"),
    ("RTN W4A8-FP8", "w4a8-fp8", "rtn-w4afp8"),
    ("RTN FP8 block + FP8 KV cache", "fp8-block+kv-fp8", "rtn-fp8-block-kv-fp8"),
]
AWQ_ROWS = {"AWQ W4A16", "AWQ W4A16 asym", "AWQ NVFP4A16"}


def make_jobs(src: Path, calib: Path, args: argparse.Namespace) -> list[bench.Job]:
    out = args.workdir / "out-schemes"
    out.mkdir(exist_ok=True)
    runner = harness.write_llmc_runner(args.workdir)
    jobs = []
    for row, recipe, llmc_recipe in SCHEMES:
        if args.only and recipe not in args.only:
            continue
        jobs.append(bench.quantkit_job(row, kv_cache_recipe(recipe, out) if "+kv-" in recipe else recipe, src, out, args))
        if args.llmc_python and (row not in AWQ_ROWS or args.awq):
            jobs.append(bench.llmc_job(row, llmc_recipe, src, out, calib, runner, args))
    return jobs


def kv_cache_recipe(name: str, folder: Path) -> str:
    """"fp8-block+kv-fp8": a user recipe file, the shipped fp8-block with `kv_cache: fp8` (static FP8 KV cache
    scales, measured on the calibration data; llm-compressor's peer: the preset with a `kv_cache_scheme`)."""
    from quantkit.quant.registry import resolve

    base, kv = name.split("+kv-")
    path = folder / f"{base}-kv-{kv}.yaml"
    path.write_text(Path(resolve(base).source).read_text() + f"kv_cache: {kv}\n")
    return str(path)


def artifact_mib(path: Path) -> float | None:
    files = list(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) / 2**20 if files else None


HEADER = ["scheme", "tool", "recipe", "wall s", "size MiB", "ppl", "ppl rise vs float", "quantkit rise / peer rise"]


def rows(jobs: list[bench.Job], float_ppl: float | None) -> list[list[str]]:
    def rise(job):
        return job.perplexity / float_ppl - 1 if job.perplexity and float_ppl else None

    peer = {j.algorithm: rise(j) for j in jobs if j.tool == "llm-compressor" and not j.returncode}
    out = []
    for job in jobs:
        mine, theirs = rise(job), peer.get(job.algorithm)
        ratio = fmt(mine / theirs, ".2f") if job.tool == "quantkit" and mine is not None and theirs else "-"
        wall = "FAILED" if job.returncode else fmt(harness.median(job.seconds), ".1f")
        out.append([job.algorithm, job.tool, job.recipe, wall, fmt(artifact_mib(job.dst), ".1f"), fmt(job.perplexity, ".3f"),
                    "n/a" if mine is None else f"{100 * mine:+.2f}%", ratio])
    return out


def targets(jobs: list[bench.Job], float_ppl: float | None) -> dict:
    ppl = {(j.tool, j.algorithm): j.perplexity for j in jobs if j.perplexity}
    found = {}
    for _, recipe, _ in SCHEMES:
        row = next((r for r, q, _ in SCHEMES if q == recipe), None)
        ours, theirs = ppl.get(("quantkit", row)), ppl.get(("llm-compressor", row))
        if ours and theirs and float_ppl:
            found[row] = {"quantkit_rise": ours / float_ppl - 1, "peer_rise": theirs / float_ppl - 1,
                          "met": ours / float_ppl - 1 <= theirs / float_ppl - 1 + 1e-9}
    nvfp4, w4a16 = ppl.get(("quantkit", "GPTQ NVFP4A16")), ppl.get(("quantkit", "GPTQ W4A16"))
    if nvfp4 and w4a16:
        found["GPTQ NVFP4A16 vs GPTQ W4A16"] = {"ppl_ratio": nvfp4 / w4a16, "met": nvfp4 / w4a16 <= 1.01}
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_model_arguments(p)  # --workdir, --model, and the trained model's --hidden, --train-*
    p.add_argument("--llmc-python", type=Path, help="python of a venv with llmcompressor; without it only quantkit runs")
    p.add_argument("--only", nargs="+", metavar="RECIPE", help="only these quantkit recipes (and their peers)")
    bench.add_run_arguments(p)  # --calib-data, --num-samples, --seq-len, --eval-*, --threads, --repeats
    p.add_argument("--awq", action="store_true", help="also run llm-compressor's AWQ rows (slow on CPU)")
    p.add_argument("--llmc-actorder", choices=["default", "none"], default="none",
                   help="llm-compressor GPTQ column order (none: as quantkit's recipes, the same algorithm)")
    p.add_argument("--autoround-iters", type=int, default=200)
    p.add_argument("--quantkit-ranks", type=int, default=1, help="quantkit's calibrated recipes on this many ranks")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = bench.benchmark_model(args)
    calib = harness.write_calibration(src, args.calib_data, args.num_samples, args.seq_len, args.workdir)
    jobs = make_jobs(src, calib, args)
    logs = args.workdir / "logs"
    logs.mkdir(exist_ok=True)
    bench.run_jobs(jobs, args.repeats, args.threads, logs)
    done = [job for job in jobs if not job.returncode]
    ppl, errors = bench.perplexities([src] + [job.dst for job in done], args, args.workdir)
    for job in done:
        job.perplexity = ppl.get(str(job.dst))
    float_ppl = ppl.get(str(src))
    print(f"model {src}: float perplexity {fmt(float_ppl, '.3f')}, {fmt(artifact_mib(src), '.1f')} MiB; threads {args.threads}")
    print(harness.markdown_table(HEADER, rows(jobs, float_ppl)))
    found = targets(jobs, float_ppl)
    print(json.dumps(found, indent=2))
    for path, error in errors.items():
        print(f"eval failed for {path}: {error[-300:]}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"model": str(src), "float_ppl": float_ppl, "targets": found, "errors": errors,
                                         "jobs": [{**vars(j), "dst": str(j.dst), "size_mib": artifact_mib(j.dst)} for j in jobs]},
                                        indent=2, default=str))


if __name__ == "__main__":
    main()
