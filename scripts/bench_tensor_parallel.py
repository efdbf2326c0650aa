"""Benchmark `quantkit eval --tp`: tokens/s and peak RSS per rank, one process against a model sharded over two, in
one run.

Run from the repository root (with the venv active):

    python scripts/bench_tensor_parallel.py --json tp.json

What it does:

* builds, once, under `--workdir`: the ~70M-parameter Llama of bench_finalize.py (hidden 1024, 4 layers, 16
  heads, vocab 8192; float32 by default: CPU kernels) and its `int4-weight-only` compressed-tensors artifact;
* for each model, runs `quantkit eval MODEL --data TEXT --json` as measured subprocesses:
  - `--tp 1` with all `--threads` threads in one process,
  - `--tp 1` with `--threads / 2` threads (the per-rank budget of the sharded run: the same compute per rank),
  - `--tp 2`, each rank with `--threads / 2` threads (torchrun, gloo on CPU);
  each `--repeats` times in alternating order (the fastest run kept);
* reports perplexity (the sharded run's must equal the single process's), tokens/s as `quantkit eval` measures
  it (every rank runs every window, so it is the sharded model's throughput), the bytes of weights each rank
  held while it computed (its shards and the replicated tensors; an artifact's dequantized weights), the peak
  RSS of each rank while the model was loaded and measured (both from eval's JSON), and the peak RSS above the
  fixed cost (the same command on a tiny model of the same family) as a share of the model's files.

On CPU a single process maps the safetensors files and computes from the mapped pages (file-backed, shared and
evictable), while a rank copies its shards into its own memory: peak RSS per rank falls much less than the
weights a rank holds. The weights held are what a GPU rank's memory holds.

On CPU tensor parallelism trades compute for communication: each rank multiplies half the weights but all-reduces
every row-split layer's output over gloo. Its point is memory per rank (a model larger than one device); on
GPUs (nccl) it is also speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import harness
from harness import MIB

TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=8192, max_position_embeddings=2048)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    half = max(1, args.threads // 2)
    model = harness.llama_70m(args.workdir, args.text, args.dtype)
    tiny = harness.build_llama(args.workdir / f"llama-tiny-{args.dtype}", args.text, args.dtype, generate_if_missing=True, **TINY)
    models = {"float": model}
    if not args.skip_artifact:
        models["int4-weight-only"] = artifact(model, args.workdir / f"{model.name}-int4", args.threads)
    configurations = [(f"tp 1 x {args.threads} threads", 1, args.threads), (f"tp 1 x {half} threads", 1, half),
                      (f"tp 2 x {half} threads", 2, half)]
    env = harness.thread_env(half)  # the ranks' threads: --threads says it to quantkit, this to torchrun's children
    rows = []
    fixed = {}
    for tp in (1, 2):  # the fixed cost: interpreter, torch, transformers, the process group
        fixed[tp] = evaluate(tiny, args, tp, half, env, args.workdir / "tiny.json")["peak_rss_per_rank"]
    for name, path in models.items():
        measured: dict[str, list[dict]] = {label: [] for label, *_ in configurations}
        for repeat in range(args.repeats):  # alternating order: a slow spell of the machine hits every configuration
            for label, tp, threads in configurations if repeat % 2 == 0 else configurations[::-1]:
                print(f"{name}: {label} ({repeat + 1}/{args.repeats}) ...", file=sys.stderr, flush=True)
                result = evaluate(path, args, tp, threads, env, args.workdir / "eval.json")
                measured[label].append(result)
                print(f"  ppl {result['perplexity']['perplexity']:.3f}, {result['perplexity']['tokens_per_second']:,.0f} tokens/s, "
                      f"peak RSS per rank {[round(b / MIB) for b in result['peak_rss_per_rank']]} MiB", file=sys.stderr, flush=True)
        rows += [summarize(name, label, tp, runs, harness.safetensors_bytes(path), fixed[tp])
                 for label, tp, _ in configurations for runs in [measured[label]]]
    report = {"model": str(model), "dtype": args.dtype, "parameters": harness.parameter_count(model),
              "data": f"{args.max_samples} x {args.seq_len} tokens of {args.data}", "threads": args.threads,
              "fixed_rss_mib": {tp: [round(b / MIB) for b in peaks] for tp, peaks in fixed.items()},
              "host": harness.host_facts(), "versions": harness.versions("torch", "transformers", "compressed-tensors"),
              "rows": rows}
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def artifact(model: Path, dst: Path, threads: int) -> Path:
    """`quantkit finalize MODEL DST -q int4-weight-only`, once."""
    if not (dst / "config.json").is_file():
        print(f"finalizing {dst} ...", file=sys.stderr, flush=True)
        run = harness.measure(harness.finalize_command(model, dst, "int4-weight-only", threads), harness.thread_env(threads))
        if run.returncode:
            sys.exit(f"finalize failed ({run.returncode}):\n{run.stderr_tail}")
    return dst


def evaluate(path: Path, args: argparse.Namespace, tp: int, threads: int, env: dict, report: Path) -> dict:
    """One `quantkit eval` of `path` (its JSON result, with the process's wall time)."""
    cmd = harness.quantkit_command("eval", path, "--data", args.data, "--seq-len", args.seq_len, "--max-samples",
                                   args.max_samples, "--threads", threads, "--tp", tp, "--json", report, "--quiet")
    run = harness.measure(cmd, env)
    if run.returncode:
        sys.exit(f"quantkit eval --tp {tp} failed ({run.returncode}):\n{run.stderr_tail}")
    (result,) = json.loads(report.read_text())["results"]
    return result | {"wall_seconds": run.seconds}


def summarize(name: str, label: str, tp: int, runs: list[dict], weights: int, fixed: list[int]) -> dict:
    """The fastest run's throughput, the highest peak each rank reached over the repeats."""
    best = max(runs, key=lambda r: r["perplexity"]["tokens_per_second"])
    peaks = [max(r["peak_rss_per_rank"][rank] for r in runs) for rank in range(tp)]
    return {"model": name, "run": label, "tp": tp, "perplexity": best["perplexity"]["perplexity"],
            "tokens_per_second": round(best["perplexity"]["tokens_per_second"]), "wall_seconds": round(best["wall_seconds"], 1),
            "weights_held_mib_per_rank": [round(b / MIB, 1) for b in best["weight_bytes_per_rank"]],
            "peak_rss_mib_per_rank": [round(p / MIB) for p in peaks], "weights_mib": round(weights / MIB, 1),
            "above_fixed_vs_weights": round((max(peaks) - max(fixed)) / weights, 3)}


def print_report(report: dict) -> None:
    print(f"model: {report['model']} ({report['parameters'] / 1e6:.0f}M parameters, {report['dtype']}), "
          f"{report['data']}, {report['threads']} threads in all; fixed cost per rank (tiny model): {report['fixed_rss_mib']} MiB")
    header = ["model", "run", "perplexity", "tokens/s", "wall s", "weights held / rank MiB", "peak RSS / rank MiB",
              "RSS above fixed / file size"]
    lines = [[r["model"], r["run"], f"{r['perplexity']:.4f}", f"{r['tokens_per_second']:,}", f"{r['wall_seconds']:.1f}",
              " / ".join(map(str, r["weights_held_mib_per_rank"])), " / ".join(map(str, r["peak_rss_mib_per_rank"])), f"{r['above_fixed_vs_weights']:.2f} x {r['weights_mib']} MiB"]
             for r in report["rows"]]
    print(harness.markdown_table(header, lines, "llrrrrrr"))
    for name in dict.fromkeys(r["model"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["model"] == name]
        one, two = rows[0], rows[-1]
        print(f"- {name}: tp 2 / tp 1 perplexity - 1 = {two['perplexity'] / one['perplexity'] - 1:+.1e}; tokens/s tp 2 / "
              f"tp 1 x {report['threads']} threads = {two['tokens_per_second'] / one['tokens_per_second']:.2f}, / tp 1 at the "
              f"per-rank threads = {two['tokens_per_second'] / rows[1]['tokens_per_second']:.2f}; peak RSS per rank tp 2 / tp 1 = "
              f"{max(two['peak_rss_mib_per_rank']) / max(one['peak_rss_mib_per_rank']):.2f}, weights held per rank tp 2 / tp 1 = "
              f"{max(two['weights_held_mib_per_rank']) / max(one['weights_held_mib_per_rank']):.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-tp"))
    p.add_argument("--text", type=Path, default=harness.WIKITEXT / "valid.txt", help="the tokenizer's text")
    p.add_argument("--data", type=Path, default=harness.WIKITEXT / "test.txt", help="the evaluation text")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2, help="threads in all: the one process's, or split over the ranks")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-samples", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-artifact", action="store_true", help="leave out the int4 compressed-tensors artifact")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not args.data.is_file():
        p.error(f"{args.data} does not exist; pass --data FILE (WikiText-2 lives in ../shared/data)")
    return args


if __name__ == "__main__":
    main()
