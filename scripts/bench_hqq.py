"""Benchmark HQQ (half-quadratic quantization) against round to nearest on the same grid: perplexity, size on disk
and `quantkit finalize` wall time at 4, 3 and 2 bits, on a trained model and its outlier copy, in one run; and the
quantization of one Llama-3.1-8B-shaped weight alone.

The same machinery as scripts/bench_calibration.py (read its docstring for the trained benchmark model, shared
through `--workdir`, and the thread pinning) and scripts/bench_rotations.py (the outlier copy):

    python scripts/bench_hqq.py --json hqq.json
    python scripts/bench_hqq.py --model /tmp/quantkit-bench-calib/llama-h512-i1536-trained200/final --threads 1

What it does (the models cached under `--workdir`, the artifacts and recipe files under `--workdir`/hqq):

1. the trained benchmark model of bench_calibration.py (or `--model`; by default the hidden 512, MLP 1536 Llama
   trained 200 steps that bench_gguf.py's `--intermediate 1536` also uses), and its outlier copy made by
   scripts/make_outlier_model.py (x64 activation outlier channels feeding q/k/v and gate/up, the same float
   function): `--models plain outlier`;
2. the recipes: HQQ is the shipped `hqq-w{4,3,2}a16` (asymmetric int4 / int3 / int2 in groups of 64 with an
   integer zero point, compressed-tensors); round to nearest is the same YAML with `algorithm: {name: rtn}`,
   written to `--workdir`/hqq/rtn-w{B}a16.yaml (checked: the same scheme, format and ignore list as HQQ's);
3. `quantkit finalize SRC DST -q RECIPE --threads T --quiet --overwrite` for every model, bit width and algorithm,
   each its own subprocess with OMP_NUM_THREADS / MKL_NUM_THREADS = `--threads`; `--repeats` rounds, RTN and HQQ
   of one model and bit width back to back, which of the two goes first alternating from pair to pair and from
   round to round, so that a machine's drift hits both alike. Wall time is perf_counter around the whole process
   (interpreter start, imports, load, quantize, write); the table shows the median (and the spread), CPU time
   (user + system) from os.wait4 (peak RSS too, in the JSON), and HQQ over RTN as the median over rounds of the
   ratio of the two runs of a round (back to back, so less drift between them than between rounds);
4. one `quantkit eval` call for every float model and every artifact: WikiText-2 test (`--eval-data`), windows
   of 256 tokens, the first `--eval-samples` of them (64: 16,384 tokens, a few minutes for all 14 models on 2
   cores), the same windows for every model; size is the bytes of the artifact's *.safetensors;
5. the targets, per model: at 3 and 2 bits HQQ's perplexity below RTN's at RTN's size (bytes) or less; at 4 bits
   HQQ's perplexity not above RTN's; at every bit width HQQ's finalize wall within 10% of RTN's (the median of
   the paired ratios);
6. `--weight-threads` (default 1 2): the quantization alone of one Llama-3.1-8B-shaped weight (`--weight-shape`,
   14336 x 4096, bf16, normal with std 0.02 as scripts/build_large_checkpoint.py draws it, seed 0), by the
   algorithms' own `quantize_weight` as finalize calls it, in one subprocess per thread count (torch threads and
   OMP / MKL pinned), after a warm-up on a small weight; `--repeats` rounds, RTN and HQQ alternating, medians;
   with each algorithm's relative squared error |W - Q(W)|^2 / |W|^2 on that weight. From the time HQQ adds per
   weight element at 1 thread (CPU seconds, no thread waits in them) it projects what HQQ would add to a streamed
   finalize of the whole Llama-3.1-8B shape (6.98 G decoder Linear weights), against `--rtn-8b-wall` and
   `--rtn-8b-cpu` (round to nearest's streamed int4 finalize of that checkpoint at 2 threads, measured by
   bench_large_checkpoint.py: 83.9 s wall, 143 CPU s): the wall from the extra halved by 2 threads to the extra
   whole.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path

import bench_calibration as bench
import bench_rotations
import harness
from harness import WIKITEXT, fmt, median

BITS = (4, 3, 2)
ALGORITHMS = ("rtn", "hqq")
WALL_TARGET = 1.10  # HQQ's finalize wall at most 10% above RTN's
# Llama-3.1-8B's decoder Linears per layer [out, in]: q, k, v, o, gate, up, down; 32 layers
LLAMA_8B_LINEARS = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
LLAMA_8B_LAYERS = 32


@dataclass
class Job:
    """One finalize: a model, a bit width, an algorithm, and its measured runs."""

    model: str
    bits: int
    algorithm: str
    recipe: str
    dst: Path
    cmd: list[str]
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    peak_rss_mib: list[float] = field(default_factory=list)
    returncode: int = 0
    error: str = ""
    perplexity: float | None = None
    size_bytes: int | None = None


# ---------------------------------------------------------------- recipes and jobs


def recipe_pair(bits: int, folder: Path) -> dict[str, str]:
    """{"rtn": a recipe file, "hqq": the shipped recipe's name}: the shipped `hqq-w{bits}a16` and the same YAML with
    round to nearest for its algorithm, checked to differ in the algorithm alone."""
    import yaml

    from quantkit.quant.registry import resolve

    name = f"hqq-w{bits}a16"
    hqq = resolve(name)
    data = yaml.safe_load(Path(hqq.source).read_text())
    data["algorithm"] = {"name": "rtn"}
    data["description"] = data["description"].replace("by HQQ", "by round to nearest")
    path = folder / f"rtn-w{bits}a16.yaml"
    path.write_text(f"# {name} with round to nearest instead of HQQ (scripts/bench_hqq.py)\n"
                    + yaml.safe_dump(data, sort_keys=False))
    rtn = resolve(str(path))
    same = all(getattr(rtn, key) == getattr(hqq, key) for key in ("scheme", "format", "ignore", "on_indivisible"))
    if not same or rtn.quantizer.name != "rtn" or hqq.quantizer.name != "hqq":
        sys.exit(f"{path} is not {name} with round to nearest")
    return {"rtn": str(path), "hqq": name}


def make_jobs(models: dict[str, Path], out: Path, args: argparse.Namespace) -> list[Job]:
    recipes = {bits: recipe_pair(bits, out) for bits in args.bits}
    jobs = []
    for model, src in models.items():
        for bits in args.bits:
            for algorithm in ALGORITHMS:
                dst = out / model / f"{algorithm}-w{bits}a16"
                cmd = harness.finalize_command(src, dst, recipes[bits][algorithm], args.threads)
                jobs.append(Job(model, bits, algorithm, recipes[bits][algorithm], dst, cmd))
    return jobs


def run_jobs(jobs: list[Job], args: argparse.Namespace, logs: Path) -> None:
    """`--repeats` rounds; RTN and HQQ of one model and bit width back to back, the first of the two alternating from
    pair to pair and from round to round."""
    env = harness.thread_env(args.threads)
    pairs = [jobs[i:i + 2] for i in range(0, len(jobs), 2)]
    for round_no in range(args.repeats):
        for k, pair in enumerate(pairs):
            for job in pair if (round_no + k) % 2 == 0 else reversed(pair):
                if job.returncode:
                    continue
                run = harness.measure(job.cmd, env)
                if run.returncode:
                    (logs / f"{job.model}-{job.dst.name}.log").write_text(run.stderr_tail)
                job.returncode, job.error = run.returncode, run.stderr_tail
                state = f"{run.seconds:.1f} s" if not run.returncode else f"FAILED (rc {run.returncode})"
                if not run.returncode:
                    job.seconds.append(run.seconds)
                    job.cpu_seconds.append(run.cpu_seconds)
                    job.peak_rss_mib.append(run.peak_rss_mib)
                print(f"round {round_no + 1}/{args.repeats} {job.model} {job.algorithm} w{job.bits}a16: {state}",
                      file=sys.stderr)


# ---------------------------------------------------------------- one 8B-shaped weight


def weight_worker(args: argparse.Namespace) -> None:
    """In its own process (`--weight-worker T`): time RTN and HQQ on one weight at T torch threads; print JSON."""
    import torch

    from quantkit.quant.registry import AlgorithmStep, resolve

    torch.set_num_threads(args.weight_worker)
    rows, cols = args.weight_shape
    weight = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    specs = {bits: resolve(f"hqq-w{bits}a16").scheme.weights for bits in args.bits}
    steps = {name: AlgorithmStep(name) for name in ALGORITHMS}

    def quantize(name: str, w: torch.Tensor, bits: int):
        return steps[name].algorithm.quantize_weight(w, specs[bits], steps[name].arguments)

    for name in ALGORITHMS:  # imports and first-call costs out of the timings
        quantize(name, weight[:256], args.bits[0])
    seconds = {f"{name}-w{bits}": [] for bits in args.bits for name in ALGORITHMS}
    cpu_seconds = {key: [] for key in seconds}
    error = {}
    for round_no in range(args.repeats):
        for k, bits in enumerate(args.bits):
            for name in ALGORITHMS if (round_no + k) % 2 == 0 else ALGORITHMS[::-1]:
                began, cpu_began = time.perf_counter(), time.process_time()
                q = quantize(name, weight, bits)
                seconds[f"{name}-w{bits}"].append(time.perf_counter() - began)
                cpu_seconds[f"{name}-w{bits}"].append(time.process_time() - cpu_began)
                if round_no == 0:
                    w = weight.float()
                    residual = (w - q.dequantize(torch.float32)).square().sum()
                    error[f"{name}-w{bits}"] = float(residual / w.square().sum())
                del q
    print(json.dumps({"threads": torch.get_num_threads(), "seconds": seconds, "cpu_seconds": cpu_seconds,
                      "relative_error": error}))


def weight_timings(args: argparse.Namespace) -> list[dict]:
    """One `--weight-worker` subprocess per thread count of `--weight-threads`."""
    found = []
    for threads in args.weight_threads:
        cmd = [sys.executable, __file__, "--weight-worker", str(threads), "--repeats", str(args.repeats),
               "--weight-shape", *map(str, args.weight_shape), "--bits", *map(str, args.bits)]
        rows, cols = args.weight_shape
        print(f"timing one {rows} x {cols} weight at {threads} threads ...", file=sys.stderr)
        proc = subprocess.run(cmd, env=harness.thread_env(threads), capture_output=True, text=True)
        if proc.returncode:
            print(f"weight timing at {threads} threads failed:\n{proc.stderr[-1500:]}", file=sys.stderr)
            continue
        found.append(harness.last_json_line(proc.stdout))
    return found


def llama_8b_elements() -> int:
    return LLAMA_8B_LAYERS * sum(o * i for o, i in LLAMA_8B_LINEARS)


# ---------------------------------------------------------------- reporting

HEADER = ["bits", "algorithm", "size bytes", "size HQQ / RTN", "perplexity", "rise vs float", "finalize wall s",
          "CPU s", "wall HQQ / RTN", "CPU HQQ / RTN"]


def walls(job: Job) -> str:
    """The median wall time, and the spread of the runs."""
    if job.returncode or not job.seconds:
        return "FAILED"
    spread = f" ({min(job.seconds):.1f}-{max(job.seconds):.1f})" if len(job.seconds) > 1 else ""
    return f"{median(job.seconds):.2f}{spread}"


def ratio(a: float | None, b: float | None, spec: str = ".3f") -> str:
    return fmt(a / b, spec) if a is not None and b else "n/a"


def paired(hqq: Job, rtn: Job, what: str = "seconds") -> float | None:
    """The median over rounds of HQQ's time over RTN's in the same round (the two ran back to back)."""
    return median([h / r for h, r in zip(getattr(hqq, what), getattr(rtn, what))])


def model_table(model: str, jobs: list[Job], float_ppl: float | None, float_bytes: int) -> str:
    rows = [["-", "float (reference)", f"{float_bytes:,}", "", fmt(float_ppl, ".3f"), "", "", "", "", ""]]
    for bits in sorted({j.bits for j in jobs}, reverse=True):
        pair = {j.algorithm: j for j in jobs if j.model == model and j.bits == bits}
        for name in ALGORITHMS:
            job = pair[name]
            rise = job.perplexity / float_ppl - 1 if job.perplexity and float_ppl else None
            hqq_row = name == "hqq"
            rows.append([str(bits), name.upper(), fmt(job.size_bytes, ","),
                         ratio(job.size_bytes, pair["rtn"].size_bytes, ".4f") if hqq_row else "",
                         fmt(job.perplexity, ".3f"), "n/a" if rise is None else f"{100 * rise:+.2f}%", walls(job),
                         fmt(median(job.cpu_seconds), ".2f"),
                         fmt(paired(job, pair["rtn"]), ".3f") if hqq_row else "",
                         fmt(paired(job, pair["rtn"], "cpu_seconds"), ".3f") if hqq_row else ""])
    return harness.markdown_table(HEADER, rows, "rlrrrrrrrr")


def targets(model: str, jobs: list[Job]) -> list[dict]:
    found = []
    for bits in sorted({j.bits for j in jobs}, reverse=True):
        pair = {j.algorithm: j for j in jobs if j.model == model and j.bits == bits}
        rtn, hqq = pair["rtn"], pair["hqq"]
        if rtn.perplexity and hqq.perplexity:
            if bits == 4:
                met, what = hqq.perplexity <= rtn.perplexity, "HQQ's perplexity not above RTN's"
            else:
                met = hqq.perplexity < rtn.perplexity and (hqq.size_bytes or 0) <= (rtn.size_bytes or 0)
                what = "HQQ's perplexity below RTN's at RTN's size or less"
            found.append({"model": model, "bits": bits, "target": what, "met": met,
                          "detail": f"{hqq.perplexity:.3f} against {rtn.perplexity:.3f}, "
                                    f"{hqq.size_bytes:,} against {rtn.size_bytes:,} bytes"})
        if rtn.seconds and hqq.seconds:
            wall, cpu = paired(hqq, rtn), paired(hqq, rtn, "cpu_seconds")
            found.append({"model": model, "bits": bits, "target": "HQQ's finalize wall within 10% of RTN's (median of "
                          "pairs)", "met": wall <= WALL_TARGET, "wall_ratio": wall, "cpu_ratio": cpu,
                          "detail": f"{wall:.3f}x; medians {median(hqq.seconds):.2f} s against "
                                    f"{median(rtn.seconds):.2f} s; CPU time {cpu:.3f}x"})
    return found


def weight_table(timings: list[dict], args: argparse.Namespace) -> str:
    header = ["threads", "bits", "RTN s (CPU s)", "HQQ s (CPU s)", "wall HQQ / RTN", "RTN rel. error",
              "HQQ rel. error", "HQQ's extra CPU s per G weights"]
    rows = []
    elements = args.weight_shape[0] * args.weight_shape[1]
    for t in timings:
        for bits in args.bits:
            (rtn, rtn_cpu), (hqq, hqq_cpu) = (medians(t, f"{name}-w{bits}") for name in ALGORITHMS)
            rows.append([str(t["threads"]), str(bits), f"{rtn:.2f} ({rtn_cpu:.2f})", f"{hqq:.2f} ({hqq_cpu:.2f})",
                         f"{hqq / rtn:.1f}x", f"{t['relative_error'][f'rtn-w{bits}']:.5f}",
                         f"{t['relative_error'][f'hqq-w{bits}']:.5f}", f"{(hqq_cpu - rtn_cpu) / elements * 1e9:.0f}"])
    return harness.markdown_table(header, rows, "rrrrrrrr")


def medians(timing: dict, key: str) -> tuple[float, float]:
    """The median wall and CPU seconds of one algorithm and bit width in one worker's timings."""
    return median(timing["seconds"][key]), median(timing["cpu_seconds"][key])


def projection(timings: list[dict], args: argparse.Namespace) -> list[str]:
    """What HQQ would add to round to nearest's streamed 8B finalize (`--rtn-8b-wall`, `--rtn-8b-cpu`: measured at 2
    threads by bench_large_checkpoint.py), if every decoder Linear costs what this weight does per element: the
    CPU seconds HQQ adds per element at 1 thread (no thread waits in them) times the 8B's decoder weights, and the
    wall time that gives from perfect use of 2 threads (the extra halved) to none (the extra whole)."""
    one = next((t for t in timings if t["threads"] == 1), None)
    if one is None:
        return []
    lines = []
    elements = args.weight_shape[0] * args.weight_shape[1]
    for bits in args.bits:
        (_, rtn_cpu), (_, hqq_cpu) = (medians(one, f"{name}-w{bits}") for name in ALGORITHMS)
        added = (hqq_cpu - rtn_cpu) / elements * llama_8b_elements()
        low, high = args.rtn_8b_wall + added / 2, args.rtn_8b_wall + added
        wall = args.rtn_8b_wall
        lines.append(f"{bits} bits: HQQ adds about {added:.0f} CPU s to a streamed 8B finalize "
                     f"({llama_8b_elements() / 1e9:.2f} G decoder weights; round to nearest's: {args.rtn_8b_cpu:.0f} "
                     f"CPU s, {wall:.1f} s wall at 2 threads): {low:.0f}-{high:.0f} s wall, "
                     f"{low / wall:.1f}x-{high / wall:.1f}x round to nearest's")
    return lines


def facts(models: dict[str, Path], args: argparse.Namespace, load_before: tuple) -> dict:
    return {"date": date.today().isoformat(), **harness.host_facts(), **harness.versions("torch", "transformers"),
            "quantkit_commit": bench_rotations.git_head(), "threads": args.threads, "repeats": args.repeats,
            "load_average_before": load_before, "load_average_after": os.getloadavg(),
            "models": {m: {"path": str(p), "parameters": harness.parameter_count(p),
                           "training": bench.training_facts(p)} for m, p in models.items()},
            "eval": f"{args.eval_data}, seq_len 256, first {args.eval_samples} windows"}


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_model_arguments(p)  # --workdir, --model, and the trained model's --hidden, --train-*
    p.add_argument("--intermediate", type=int, default=1536, help="the trained model's MLP width")
    p.set_defaults(train_steps=200)
    p.add_argument("--models", nargs="+", choices=["plain", "outlier"], default=["plain", "outlier"])
    p.add_argument("--outlier-channels", type=int, default=4, help="outlier channels per norm (make_outlier_model.py)")
    p.add_argument("--outlier-factor", type=float, default=64.0, help="their scale (a power of two is exact)")
    p.add_argument("--bits", nargs="+", type=int, choices=BITS, default=list(BITS))
    p.add_argument("--eval-data", type=Path, default=WIKITEXT / "test.txt")
    p.add_argument("--eval-samples", type=int, default=64, help="perplexity windows of 256 tokens")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of every job (the tables show medians)")
    p.add_argument("--weight-threads", nargs="*", type=int, default=[1, 2],
                   help="thread counts for the one 8B-shaped weight (none: skip it)")
    p.add_argument("--weight-shape", nargs=2, type=int, default=[14336, 4096], metavar=("OUT", "IN"))
    p.add_argument("--weight-only", action="store_true", help="only the one 8B-shaped weight, no models")
    p.add_argument("--rtn-8b-wall", type=float, default=83.9, help="round to nearest's streamed 8B finalize wall at 2 "
                   "threads (bench_large_checkpoint.py, int4-weight-only), for the projection")
    p.add_argument("--rtn-8b-cpu", type=float, default=143.0, help="its CPU seconds (user + system)")
    p.add_argument("--weight-worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.weight_worker:
        return weight_worker(args)
    load_before = os.getloadavg()
    found: dict = {"models": {}}
    if not args.weight_only:
        args.workdir.mkdir(parents=True, exist_ok=True)
        src = bench.benchmark_model(args)
        models = {"plain": src} if "plain" in args.models else {}
        if "outlier" in args.models:
            models["outlier"] = bench_rotations.outlier_model(src, args.workdir, args)
        out = args.workdir / "hqq"
        (out / "logs").mkdir(parents=True, exist_ok=True)
        jobs = make_jobs(models, out, args)
        run_jobs(jobs, args, out / "logs")
        done = [job for job in jobs if not job.returncode]
        ppl, errors = bench.perplexities([*models.values()] + [job.dst for job in done], args, out)
        for job in done:
            job.perplexity, job.size_bytes = ppl.get(str(job.dst)), harness.safetensors_bytes(job.dst)
        found["facts"] = facts(models, args, load_before)
        print(f"\n{found['facts']['date']}, {found['facts']['platform']}, {found['facts']['cpus']} CPUs, "
              f"{args.threads} threads, {args.repeats} runs each (median, min-max); quantkit "
              f"{found['facts']['quantkit_commit']}; perplexity on {found['facts']['eval']}; load average "
              f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after\n")
        for model, path in models.items():
            float_ppl = ppl.get(str(path))
            float_bytes = harness.safetensors_bytes(path)
            print(f"{model}: {path}\n\n{model_table(model, jobs, float_ppl, float_bytes)}\n")
            found["models"][model] = {"path": str(path), "float_ppl": float_ppl, "float_bytes": float_bytes,
                                      "targets": targets(model, jobs)}
        print("Targets:\n")
        for t in (t for m in found["models"].values() for t in m["targets"]):
            verdict = "met" if t["met"] else "NOT met"
            print(f"- {t['model']}, {t['bits']} bits, {t['target']}: {verdict} ({t['detail']})")
        for path, error in errors.items():
            print(f"eval failed for {path}: {error[-300:]}", file=sys.stderr)
        found["errors"] = errors
        found["jobs"] = [{**asdict(j), "dst": str(j.dst)} for j in jobs]
    timings = weight_timings(args) if args.weight_threads else []
    if timings:
        print(f"\nOne {args.weight_shape[0]} x {args.weight_shape[1]} bf16 weight (normal, std 0.02), quantize_weight "
              f"alone, median of {args.repeats}:\n\n{weight_table(timings, args)}\n")
        print("\n".join(f"- {line}" for line in projection(timings, args)))
        found["weight"] = {"shape": args.weight_shape, "timings": timings, "projection": projection(timings, args)}
    if args.json:
        args.json.write_text(json.dumps(found, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
