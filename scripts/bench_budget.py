"""Benchmark `finalize --target-bpw` (a GGUF type per tensor from measured sensitivity) against fixed mixtures of the
same size, all measured by llama.cpp's llama-perplexity --kl-divergence against the model's F16 file.

    scripts/build_llama_cpp.sh                                   # once
    python scripts/bench_budget.py --reuse --json budget.json --svg docs/budget-kld.svg

The models, the F16 files, the importance matrix and the measuring are scripts/bench_gguf.py's (read its docstring;
`--workdir` shares its cache, and `--reuse` keeps the files and measurements an earlier run of either made). Per
model (the trained Llama and its outlier copy):

- quantkit's budget rows: `quantkit finalize SRC OUT.gguf --target-bpw B --calib-data ... --dtype float16` for each
  of `--targets` (the default algorithm: gguf-q4-k-m's GPTQ on K grids), and one more at the bits per weight of
  each llama.cpp file of the same model ("at Q4_K_M's size": its tensors' bytes over the parameters), and where
  quantkit's file of that mixture is the smaller, at its size too ("at gguf-q4-k-m's size": on an 8-expert MoE,
  llama.cpp's rules put attn_k / attn_v in Q8_0 and attn_output in Q5_K, quantkit's mixtures keep the dense rules);
- quantkit's fixed mixtures: the shipped gguf-q2-k, gguf-q3-k-m, gguf-q4-k-m, gguf-q5-k-m (GPTQ, llama.cpp's
  per-tensor rules);
- llama.cpp's own: llama-quantize Q2_K, Q3_K_M, Q4_K_M, Q5_K_M with llama-imatrix's importance matrix.

The table is sorted by size per model: bits per weight of the file's tensors (8 x tensor bytes / parameters, the
measure --target-bpw plans; the header's metadata left out), the mean KL divergence from F16 with its +/-, the
share of tokens with F16's most likely next token, the paired perplexity ratio, and the time to make the file.
The targets it checks, for each mixture: the budget row at its size is no larger than llama.cpp's file and quantkit's
gguf-* file of that mixture, and its KL divergence is below both (at Q4_K_M's size: below quantkit's own
gguf-q4-k-m). `--svg` draws KL divergence
against bits per weight, one line per tool and model (log scale), as a self-contained SVG.

`--arch qwen3_moe --models plain` runs the same rows on a Qwen3-MoE trained the same way (bench_calibration.py's
`build_init`: the Llama's attention, vocabulary and tokenizer, every MLP `--experts` experts of width
`--moe-intermediate`, `--experts-per-token` routed per token), named qwen3-moe in the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from datetime import date
from pathlib import Path

import bench_calibration as bench
import bench_gguf as gg
import bench_rotations
import harness
from harness import WIKITEXT, fmt

TARGETS = [2.75, 3.0, 3.5, 4.0, 4.5, 5.0]
MIXTURES = ["gguf-q2-k", "gguf-q3-k-m", "gguf-q4-k-m", "gguf-q5-k-m"]
LLAMA_TYPES = ["Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M"]


def budget_row(model: str, src: Path, target: float, folder: Path, args: argparse.Namespace, label: str = "") -> gg.Row:
    row = gg.Row(model, "quantkit budget", label or f"--target-bpw {target:g}", folder / f"quantkit-budget-{target:.4f}.gguf",
                 kind="budget")
    calibration = harness.calibration_options(args.calib_data, args.num_samples, args.seq_len)
    cmd = harness.finalize_command(src, row.path, "gguf-q4-k-m", args.threads, "--target-bpw", f"{target:.4f}",
                                   "--dtype", "float16", *calibration)
    row.seconds, row.error = gg.made(row.path, cmd, args)
    print(f"{model} budget {target}: {gg.row_state(row)}", file=sys.stderr)
    return row


def tensor_bpw(row: gg.Row, parameters: int) -> float | None:
    return None if row.tensor_bytes is None else 8 * row.tensor_bytes / parameters


def rows_of(model: str, src: Path, bin_dir: Path, runner: Path, args: argparse.Namespace) -> list[gg.Row]:
    folder = args.workdir / "gguf" / (src.parent.name if src.name == "final" else src.name)
    folder.mkdir(parents=True, exist_ok=True)
    f16 = gg.convert_f16(model, src, folder / "f16.gguf", runner, args.threads)
    matrix, matrix_s, matrix_error = gg.imatrix(bin_dir, f16.path, args)
    rows = [f16]
    for kind in args.llama_types:
        row = gg.Row(model, "llama.cpp", f"{kind} + imatrix", folder / f"llama-{kind}-imatrix.gguf", kind=kind)
        if matrix is None:
            row.error = f"llama-imatrix failed: {matrix_error}"
        else:
            gg.llama_quantize(bin_dir, f16.path, row, kind, matrix, args)
            row.seconds = None if row.seconds is None else row.seconds + matrix_s
        rows.append(row)
    rows += [gg.quantkit_row(model, src, spec, folder, args) for spec in args.mixtures]
    rows += [budget_row(model, src, target, folder, args) for target in args.targets]
    parameters = harness.parameter_count(src)
    mixtures = {r.kind: r for r in rows if r.tool == "quantkit" and not r.error}
    for peer in [r for r in rows if r.tool == "llama.cpp" and r.row != "F16" and not r.error]:
        gg.sizes(peer, parameters)
        rows.append(budget_row(model, src, tensor_bpw(peer, parameters), folder, args, f"at {peer.kind}'s size"))
        own = mixtures.get(peer.kind)
        if own is not None:  # where quantkit's mixture is the smaller file (llama.cpp's 8-expert rules): its size too
            gg.sizes(own, parameters)
            if own.tensor_bytes < peer.tensor_bytes:
                rows.append(budget_row(model, src, tensor_bpw(own, parameters), folder, args, f"at {own.row}'s size"))
    return rows


def measure(rows: list[gg.Row], models: dict[str, Path], bin_dir: Path, args: argparse.Namespace) -> None:
    bases = {r.model: gg.divergence_base(bin_dir, r, args) for r in rows if r.row == "F16" and not r.error}
    for row in rows:
        if row.error:
            continue
        gg.sizes(row, harness.parameter_count(models[row.model]))
        if row.row != "F16" and bases.get(row.model):
            gg.divergence(bin_dir, row, bases[row.model], args)
        print(f"{row.model} {row.tool} {row.row}: kld {fmt(row.kld, '.6f')} {row.error}", file=sys.stderr)


def table(rows: list[gg.Row], models: dict[str, Path]) -> str:
    lines = ["| model | tool | row | bits per weight | size MiB | types (blk.*) | embd / output | KLD mean | same top % | PPL ratio | make s |",
             "|---|---|---|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r.model, r.tensor_bytes or 0)):
        bpw = tensor_bpw(r, harness.parameter_count(models[r.model]))
        kld = f"{r.kld:.5f} ± {r.kld_error:.5f}" if r.kld is not None else (gg.one_line(r.error)[:60] if r.error else "")
        ratio = f"{r.ratio:.4f}" if r.ratio is not None else ""
        lines.append(f"| {r.model} | {r.tool} | {r.row} | {fmt(bpw, '.3f')} | {fmt(r.size and r.size / 2**20, '.2f')} | "
                     f"{r.decoder_types} | {r.outer_types} | {kld} | {fmt(r.same_top, '.2f')} | {ratio} | {fmt(r.seconds, '.0f')} |")
    return "\n".join(lines)


def targets(rows: list[gg.Row], models: dict[str, Path]) -> list[str]:
    """Each "at X's size" budget row (X: a mixture, or quantkit's file of it) against llama.cpp's mixture + imatrix
    and quantkit's gguf-* file of the same mixture and model."""
    found = []
    for r in rows:
        if r.tool != "quantkit budget" or not r.row.startswith("at ") or r.kld is None:
            continue
        named = r.row[3:].split("'")[0]
        kind = next((o.kind for o in rows if o.model == r.model and o.tool == "quantkit" and o.row == named), named)
        peers = [o for o in rows if o.model == r.model and o.kld is not None and o.tool != "quantkit budget"
                 and o.kind == kind and o.row != "F16"]
        if not peers:
            continue
        smaller = all(r.tensor_bytes <= o.tensor_bytes for o in peers)
        lower = all(r.kld < o.kld for o in peers)
        against = ", ".join(f"{o.tool} {o.row} {o.kld:.5f} ({o.tensor_bytes:,} B)" for o in peers)
        found.append(f"{r.model} at {named}'s size: budget {r.kld:.5f} ({r.tensor_bytes:,} B) against {against}: "
                     f"{'met' if smaller and lower else 'not met'}")
    return found


def svg(rows: list[gg.Row], models: dict[str, Path], path: Path) -> None:
    """KL divergence (log scale) against bits per weight, one polyline per model and tool (`harness.log_chart`)."""
    lines = {}
    for r in rows:
        if r.kld and r.row != "F16":
            bpw = tensor_bpw(r, harness.parameter_count(models[r.model]))
            lines.setdefault(f"{r.tool} ({r.model})", []).append((bpw, r.kld))
    harness.log_chart(lines, path, "bits per weight (file tensors / parameters)", "mean KL divergence from F16",
                      dashed={name for name in lines if not name.endswith("(plain)")})


def add_judging_arguments(p: argparse.ArgumentParser) -> None:
    """llama.cpp, the calibration and evaluation text, llama-perplexity's windows, threads and output: as this script
    judges files (bench_autoscheme.py judges its peer the same way)."""
    p.add_argument("--llama-cpp-bin", type=Path)
    p.add_argument("--calib-data", type=Path, default=WIKITEXT / "valid.txt")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-data", type=Path, default=WIKITEXT / "test.txt")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-repack", action="store_true", help="as bench_gguf.py's (AMX kernels that segfault in a VM)")
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--json", type=Path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_model_arguments(p)
    p.add_argument("--intermediate", type=int, default=1536)
    p.set_defaults(train_steps=200)  # the trained model of bench_gguf.py and bench_hqq.py
    p.add_argument("--models", nargs="+", choices=["plain", "outlier"], default=["plain", "outlier"])
    p.add_argument("--outlier-channels", type=int, default=4)
    p.add_argument("--outlier-factor", type=float, default=64.0)
    p.add_argument("--targets", nargs="*", type=float, default=TARGETS)
    p.add_argument("--mixtures", nargs="*", default=MIXTURES)
    p.add_argument("--llama-types", nargs="*", default=LLAMA_TYPES)
    add_judging_arguments(p)
    p.add_argument("--svg", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    bin_dir = gg.llama_cpp_bin(args)
    runner = gg.converter(bin_dir)
    src = bench.benchmark_model(args)
    plain = "plain" if args.arch == "llama" else args.arch.replace("_", "-")  # the table's name for the trained model
    models = {plain: src} if "plain" in args.models else {}
    if "outlier" in args.models:
        models["outlier"] = bench_rotations.outlier_model(src, args.workdir, args)
    rows = [row for model, path in models.items() for row in rows_of(model, path, bin_dir, runner, args)]
    measure(rows, models, bin_dir, args)
    print(f"\n{date.today().isoformat()}, {harness.host_facts()['platform']}, {args.threads} threads; llama.cpp "
          f"{gg.llama_cpp_version(bin_dir)}; quantkit {bench_rotations.git_head()}; calibration {args.num_samples} x "
          f"{args.seq_len} tokens of {args.calib_data.name}; llama-perplexity -c {args.ctx} --chunks {args.chunks} "
          f"on {args.eval_data.name}\n")
    print(table(rows, models))
    print("\nTargets:\n\n" + "\n".join(f"- {line}" for line in targets(rows, models)))
    if args.svg:
        svg(rows, models, args.svg)
    if args.json:
        args.json.write_text(json.dumps({"rows": [{**asdict(r), "path": str(r.path)} for r in rows],
                                         "targets": targets(rows, models)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
