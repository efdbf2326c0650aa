"""auto-round's AutoScheme (a GGUF type per layer at an average bit width) against quantkit's budget plans
(`finalize --target-bpw`), both judged by llama.cpp's llama-perplexity --kl-divergence against the model's F16 file.

    ~/.cache/quantkit/autoround-venv/bin/pip install torch==2.13.0 "auto-round>=0.16,<0.17" gguf   # once
    python scripts/bench_autoscheme.py --reuse --no-repack --json autoscheme.json

The peer rows of scripts/bench_budget.py's table (read its docstring), on its models, F16 files and KL-divergence
bases in `--workdir` (run it first: this script makes no F16 file and no budget row, it reads them). Per model (the
trained Llama and its outlier copy) and per bit width (`--targets`, and the bits per weight of each llama.cpp
mixture's file of that model, as bench_budget.py's "at Q4_K_M's size" rows):

- quantkit's budget row of that size, read from bench_budget.py's file (quantkit-budget-B.gguf);
- auto-round's AutoScheme asked for that average, AVG_BITS = B, run under `--autoround-python` (auto-round's own
  venv, never imported here) by autoscheme_runner.py (AUTOSCHEME_RUNNER, written to the work dir): `AutoRound(SRC,
  scheme=AutoScheme(avg_bits=B, options=OPTIONS, nsamples, seqlen, dataset), iters=0,
  dataset=...).quantize_and_save(DIR, format="gguf:q4_k_m")`. The options are quantkit's default candidates
  (GGUF:Q2_K_S ... GGUF:Q8_0, one K type per layer each). Its scoring pass and its rounding (iters 0: its RTN, with
  an importance matrix for GGUF) both calibrate on quantkit's blocks (`--num-samples` x `--seq-len` tokens of
  `--calib-data`, harness.write_calibration's), registered as an auto-round dataset. Each such run scores afresh (a
  new score cache), as each quantkit plan measures its sensitivities afresh, and its time is AutoScheme's cost;
- AutoScheme at the plan's size: AutoScheme's count of bits is not the file's (its Q3_K is 4.0 bits a weight, Q6_K
  7.25; llama.cpp stores 3.44 and 6.56), so AVG_BITS = B writes a file 4-9% smaller than a plan of B. The runner's
  `bytes:N` mode bisects AVG_BITS, on the model's shared score cache, for AutoScheme's smallest plan whose tensors
  take at least the quantkit plan's bytes (each layer priced as llama.cpp stores its type), and that AVG_BITS is
  run (its time without the scoring, which the cache holds); at `--tune-sizes`, again with `--tune-iters` steps of
  auto-round's sign-gradient tuning a block.

Bits per weight are the file's tensors (8 x tensor bytes / parameters, bench_budget.py's measure); AutoScheme's own
average (its log's "quant layers" figure: the quantized layers' bits with scales, over their parameters, norms left
out) is shown beside it. The targets, for each size: quantkit's plan no larger than AutoScheme's file and its KL
divergence lower. Each AutoScheme run is timed (wall and CPU seconds of its process, from interpreter start). On 2
loaded CPU cores, a run with scoring took 4-6 min, one on cached scores about 1 min, a search 1.5-2 min (7 min with
the scoring): about 3 hours for both models and 9 sizes, llama-perplexity included.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import bench_budget
import bench_calibration as bench
import bench_gguf as gg
import bench_rotations
import harness
from harness import fmt

TARGETS = [2.75, 3.0, 3.5, 4.0, 4.5]  # the issue's sizes (bench_budget.py adds 5.0)
OPTIONS = "GGUF:Q2_K_S,GGUF:Q3_K_S,GGUF:Q4_K_S,GGUF:Q5_K_S,GGUF:Q6_K,GGUF:Q8_0"  # quantkit's default candidates
AUTOROUND_PYTHON = Path.home() / ".cache" / "quantkit" / "autoround-venv" / "bin" / "python"
FINAL_BITS = re.compile(r"AutoScheme final avg_bits: quant layers=([0-9.]+) \(target=([0-9.]+)")

# The runners' calibration: quantkit's blocks as an auto-round dataset (this one's and bench_budget_ct.py's)
CALIBRATION_BLOCKS = '''\
ids = load_file(calib)["input_ids"]


def quantkit_blocks(tokenizer, seqlen, **_):
    """quantkit's blocks as they are (auto-round keeps the first `seqlen` tokens of each, in this order)."""
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})


calib_dataset.CALIB_DATASETS["quantkit-blocks"] = quantkit_blocks
samples, seqlen = ids.shape
'''

# The runners' bisection over AVG_BITS (this one's and bench_budget_ct.py's), each with its own planned_bytes
BISECTION = '''\
def smallest_reaching(goal):
    """Bisection over AVG_BITS for the smallest plan of at least `goal` bytes: (its AVG_BITS, its bytes)."""
    lo, hi, best = 0.0, 16.0, None
    for _ in range(18):
        mid = (lo + hi) / 2
        try:
            found = planned_bytes(mid)
        except ValueError as error:  # outside the options' range, which AutoScheme names
            low, high = map(float, re.search(r"range \\[([0-9.]+), ([0-9.]+)\\]", str(error)).groups())
            lo, hi = max(lo, low), min(hi, high)
            continue
        lo, hi = (lo, mid) if found >= goal else (mid, hi)
        best = min(best or (mid, found), (mid, found)) if found >= goal else best
    return best or (hi, planned_bytes(hi))
'''

AUTOSCHEME_RUNNER = '''\
"""auto-round's AutoScheme with its GGUF export, written by scripts/bench_autoscheme.py, run under auto-round's venv:

    python autoscheme_runner.py SRC OUT.gguf AVG_BITS OPTIONS ITERS CALIB.safetensors PRE_TOKENIZER THREADS

It scores OPTIONS (auto-round's GGUF schemes, comma-separated) layer by layer, picks one a layer at AVG_BITS on
average (its own count), and writes OUT.gguf; ITERS 0 rounds with its RTN, more tunes. Both calibrate on the token
blocks of CALIB (quantkit's), given to auto-round as a registered dataset: AutoScheme takes a dataset by name only.
The converter patches are bench_gguf.py's autoround_runner.py's.

AVG_BITS `bytes:N` writes no file: it prints, as a JSON line, the smallest AVG_BITS (bisection over its range) whose
plan's GGUF tensors take at least N bytes, with their bytes (each layer's type priced as llama.cpp stores it, every
other tensor F32). Its scores are cached (AR_AUTO_SCHEME_CACHE), so each step is a plan, not a scoring pass."""
import json, re, shutil, sys, tempfile
from pathlib import Path

src, out, avg_bits, options, iters, calib, pre, threads = sys.argv[1:9]
import torch
from safetensors.torch import load_file

torch.set_num_threads(int(threads))
import auto_round.calib_dataset as calib_dataset
from auto_round import AutoRound
from auto_round.auto_scheme.gen_auto_scheme import AutoScheme
from auto_round.export.export_to_gguf.llama_cpp_conversion import get_conversion
from datasets import Dataset

base = sys.modules[get_conversion(src).module.__name__ + ".base"]
STORED = {2: 84 / 256, 3: 110 / 256, 4: 144 / 256, 5: 176 / 256, 6: 210 / 256, 8: 34 / 32}  # Q2_K..Q6_K, Q8_0: bytes a weight


def unknown_hash(self):
    return pre
''' + gg.CONVERTER_PATCH + '''
''' + CALIBRATION_BLOCKS + '''

def rounder(bits):
    scheme = AutoScheme(avg_bits=bits, options=options, nsamples=samples, seqlen=seqlen, dataset="quantkit-blocks",
                        enable_torch_compile=False)
    return AutoRound(src, scheme=scheme, iters=int(iters), dataset="quantkit-blocks", nsamples=samples, seqlen=seqlen,
                     seed=0, device_map="cpu", enable_torch_compile=False)


def planned_bytes(bits):
    r = rounder(bits)
    r.formats = "gguf:q4_k_m"
    r.post_init()
    model, config = r.model_context.model, r.layer_config
    total = 0
    for name, param in model.named_parameters():
        layer = config.get(name.rsplit(".", 1)[0], {})
        total += param.numel() * (STORED[layer["bits"]] if layer.get("bits", 16) < 16 else 4)
    return int(total)


''' + BISECTION + '''

if avg_bits.startswith("bytes:"):
    bits, found = smallest_reaching(int(avg_bits[6:]))
    print(json.dumps({"avg_bits": bits, "planned_bytes": found}))
    sys.exit(0)
with tempfile.TemporaryDirectory(dir=Path(out).parent) as tmp:
    rounder(float(avg_bits)).quantize_and_save(tmp, format="gguf:q4_k_m")
    written = sorted(Path(tmp).rglob("*.gguf"))
    if len(written) != 1:
        sys.exit(f"auto-round wrote {len(written)} GGUF files: {[str(p) for p in written]}")
    shutil.move(written[0], out)
'''


@dataclass
class Row(gg.Row):
    """A GGUF file of the comparison; for AutoScheme's, the AVG_BITS it was asked for, its own count of what it
    planned, its process's CPU time, and whether its scores were cached (a row at the plan's size)."""

    target: float | None = None  # the size it stands at (a --targets value or a llama.cpp file's bits per weight)
    avg_bits: float | None = None
    autoscheme_bits: float | None = None
    cpu_seconds: float | None = None
    scores_cached: bool = False


@dataclass
class Context:
    """What every AutoScheme run of one model shares."""

    model: str
    src: Path
    folder: Path
    runner: Path
    calib: Path
    pre: str  # the pre-tokenizer name for auto-round's converter (quantkit's rule)


def folder_of(src: Path, args: argparse.Namespace) -> Path:
    return args.workdir / "gguf" / (src.parent.name if src.name == "final" else src.name)


def context(model: str, src: Path, args: argparse.Namespace) -> Context:
    """The runner written to the work dir, and quantkit's calibration blocks of this model (written once)."""
    from quantkit.export.gguf_vocab import pre_tokenizer

    folder = folder_of(src, args)
    runner = args.workdir / "gguf" / "autoscheme_runner.py"
    runner.write_text(AUTOSCHEME_RUNNER)
    calib = folder / f"calib-{args.num_samples}x{args.seq_len}.safetensors"
    if not calib.is_file():
        harness.write_calibration(src, args.calib_data, args.num_samples, args.seq_len, folder)
    pre = pre_tokenizer(json.loads((src / "tokenizer.json").read_text(encoding="utf-8")))
    return Context(model, src, folder, runner, calib, pre)


def sizes_of(src: Path, args: argparse.Namespace) -> list[tuple[float, str]]:
    """(bits per weight, label): `--targets`, and each llama.cpp mixture file's bits per weight in bench_budget.py's
    folder (its "at Q4_K_M's size" rows were planned at these, rounded to 4 places)."""
    parameters = harness.parameter_count(src)
    found = [(t, f"{t:g}") for t in args.targets]
    for kind in args.llama_types:
        peer = Row("", "llama.cpp", kind, folder_of(src, args) / f"llama-{kind}-imatrix.gguf")
        if peer.path.is_file():
            gg.sizes(peer, parameters)
            found.append((round(bench_budget.tensor_bpw(peer, parameters), 4), f"at {kind}'s size"))
    return found


def budget_row(model: str, src: Path, bits: float, label: str, args: argparse.Namespace) -> Row:
    """bench_budget.py's quantkit budget file of this size (made there; measured here, or kept with --reuse)."""
    path = folder_of(src, args) / f"quantkit-budget-{bits:.4f}.gguf"
    row = Row(model, "quantkit budget", label if label.startswith("at ") else f"--target-bpw {label}", path,
              kind="budget", target=bits)
    timing = path.with_name(path.name + ".seconds")
    if not path.is_file():
        row.error = f"no {path.name}: run scripts/bench_budget.py first"
        return row
    row.seconds = float(timing.read_text()) if timing.is_file() else None
    gg.sizes(row, harness.parameter_count(src))
    return row


def rows_of(model: str, src: Path, args: argparse.Namespace) -> list[Row]:
    """Per size: quantkit's plan; AutoScheme asked for that average (its count); AutoScheme at the plan's size (the
    smallest of its plans at least as large, found on its cached scores), and tuned at `--tune-sizes`."""
    ctx = context(model, src, args)
    rows = []
    for bits, label in sizes_of(src, args):
        plan = budget_row(model, src, bits, label, args)
        rows += [plan, autoscheme_row(ctx, bits, bits, 0, args)]
        if plan.error:
            continue
        matched, error = matched_bits(ctx, bits, plan.tensor_bytes, args)
        tunes = [0] + ([args.tune_iters] if label in args.tune_sizes or f"{bits:g}" in args.tune_sizes else [])
        for iters in tunes:
            row = autoscheme_row(ctx, bits, matched, iters, args, plan.row) if matched else \
                Row(model, "auto-round AutoScheme", f"= plan {plan.row}", Path(), target=bits, error=error)
            rows.append(row)
    return rows


def matched_bits(ctx: Context, bits: float, goal: int, args: argparse.Namespace) -> tuple[float | None, str]:
    """The AVG_BITS of AutoScheme's smallest plan of at least `goal` tensor bytes (the runner's `bytes:N`, on the
    model's shared score cache), kept in a JSON file beside the files for `--reuse`."""
    found = ctx.folder / f"autoscheme-{bits:.4f}-size.json"
    if args.reuse and found.is_file() and json.loads(found.read_text())["goal_bytes"] == goal:
        return json.loads(found.read_text())["avg_bits"], ""
    cmd = [str(args.autoround_python), str(ctx.runner), str(ctx.src), "-", f"bytes:{goal}", args.options, "0",
           str(ctx.calib), ctx.pre, str(args.threads)]
    run, printed = harness.measure_logged(cmd, runner_env(ctx.folder / "autoscheme.scores", args),
                                          found.with_suffix(".log"))
    result = harness.last_json_line(printed)
    if run.returncode or not result:
        return None, gg.one_line(run.stderr_tail) or f"exit code {run.returncode}"
    found.write_text(json.dumps({**result, "goal_bytes": goal, "seconds": run.seconds}) + "\n")
    print(f"{ctx.model} AutoScheme at {goal:,} B: avg_bits {result['avg_bits']:.4f} ({result['planned_bytes']:,} B "
          f"planned), {run.seconds:.0f} s", file=sys.stderr)
    return result["avg_bits"], ""


def runner_env(cache: Path, args: argparse.Namespace) -> dict[str, str]:
    return {**harness.thread_env(args.threads), "OMP_WAIT_POLICY": "PASSIVE", "AR_AUTO_SCHEME_CACHE": str(cache),
            "AR_DISABLE_DATASET_SUBPROCESS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def autoscheme_row(ctx: Context, bits: float, avg_bits: float, iters: int, args: argparse.Namespace, at: str = "") -> Row:
    """One AutoScheme file at `avg_bits`, timed (wall and CPU seconds, kept beside it for `--reuse`), its log kept.
    A row asked for `bits` itself scores afresh (each quantkit plan measures its sensitivities afresh); a row at the
    size of the plan `at` plans on the model's shared score cache, which `matched_bits` filled."""
    name = f"autoscheme-{bits:.4f}" + ("-size" if at else "") + (f"-i{iters}" if iters else "")
    text = f"avg_bits {avg_bits:.4g}" + (f" (= plan {at})" if at else "") + (f", iters {iters}" if iters else "")
    row = Row(ctx.model, "auto-round AutoScheme", text, ctx.folder / f"{name}.gguf", kind="autoscheme", target=bits,
              avg_bits=avg_bits, scores_cached=bool(at))
    log, timing = row.path.with_suffix(".log"), row.path.with_name(row.path.name + ".seconds")
    if not (args.reuse and row.path.is_file() and timing.is_file() and f"{avg_bits!r}" in timing.read_text()):
        timing.unlink(missing_ok=True)
        cache = ctx.folder / "autoscheme.scores" if at else row.path.with_suffix(".scores")
        cmd = [str(args.autoround_python), str(ctx.runner), str(ctx.src), str(row.path), repr(avg_bits), args.options,
               str(iters), str(ctx.calib), ctx.pre, str(args.threads)]
        run, _ = harness.measure_logged(cmd, runner_env(cache, args), log)
        if run.returncode or not row.path.is_file():
            row.error = gg.one_line(run.stderr_tail) or f"exit code {run.returncode}"
            print(f"{ctx.model} AutoScheme {name}: FAILED: {row.error}", file=sys.stderr)
            return row
        timing.write_text(f"{run.seconds:.2f} {run.cpu_seconds:.2f} {avg_bits!r}\n")
    seconds, cpu, _ = timing.read_text().split()
    row.seconds, row.cpu_seconds = float(seconds), float(cpu)
    found = FINAL_BITS.search(log.read_text(errors="replace")) if log.is_file() else None
    row.autoscheme_bits = float(found[1]) if found else None
    print(f"{ctx.model} AutoScheme {name}: {row.seconds:.0f} s, its avg bits {fmt(row.autoscheme_bits, '.4f')}",
          file=sys.stderr)
    return row


def measure(rows: list[Row], models: dict[str, Path], bin_dir: Path, args: argparse.Namespace) -> None:
    """Each file's size and its KL divergence from the model's F16 file (bench_budget.py's base, kept)."""
    for model, src in models.items():
        f16 = Row(model, "llama.cpp", "F16", folder_of(src, args) / "f16.gguf")
        base = gg.divergence_base(bin_dir, f16, args) if f16.path.is_file() else None
        for row in (r for r in rows if r.model == model and not r.error):
            gg.sizes(row, harness.parameter_count(src))
            if base is None:
                row.error = f"no F16 file or KL-divergence base in {f16.path.parent}: run scripts/bench_budget.py"
                continue
            gg.divergence(bin_dir, row, base, args)
            print(f"{model} {row.tool} {row.row}: kld {fmt(row.kld, '.6f')}", file=sys.stderr)


def times(rows: list[Row], models: dict[str, Path]) -> str:
    """AutoScheme's rows: the average it was asked for, its own count of its plan, the file's, and its time."""
    lines = ["| model | row | AVG_BITS asked | AutoScheme's count | file bits per weight | wall s | CPU s | scores |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in (r for r in rows if r.tool == "auto-round AutoScheme"):
        bpw = bench_budget.tensor_bpw(r, harness.parameter_count(models[r.model]))
        lines.append(f"| {r.model} | {r.row} | {fmt(r.avg_bits, '.4f')} | {fmt(r.autoscheme_bits, '.4f')} | "
                     f"{fmt(bpw, '.3f')} | {fmt(r.seconds, '.0f')} | {fmt(r.cpu_seconds, '.0f')} | "
                     f"{'cached' if r.scores_cached else 'measured'} |" + (f" {r.error[:80]}" if r.error else ""))
    return "\n".join(lines)


def targets(rows: list[Row]) -> list[str]:
    """At each size, quantkit's plan against each AutoScheme file of that size: no larger, and a lower KLD."""
    found = []
    for peer in (r for r in rows if r.tool == "auto-round AutoScheme" and r.kld is not None):
        plan = next((r for r in rows if r.model == peer.model and r.tool == "quantkit budget" and r.target == peer.target
                     and r.kld is not None), None)
        if plan is None:
            continue
        smaller, lower = plan.tensor_bytes <= peer.tensor_bytes, plan.kld < peer.kld
        found.append(f"{peer.model} {plan.row} / AutoScheme {peer.row}: quantkit {plan.kld:.5f} "
                     f"({plan.tensor_bytes:,} B) against {peer.kld:.5f} ({peer.tensor_bytes:,} B), KLD ratio "
                     f"{plan.kld / peer.kld:.2f}: {'met' if smaller and lower else 'not met'}"
                     + ("" if smaller else " (the plan is larger)"))
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_model_arguments(p)
    p.add_argument("--intermediate", type=int, default=1536)
    p.set_defaults(train_steps=200)  # bench_budget.py's model
    p.add_argument("--models", nargs="+", choices=["plain", "outlier"], default=["plain", "outlier"])
    p.add_argument("--outlier-channels", type=int, default=4)
    p.add_argument("--outlier-factor", type=float, default=64.0)
    p.add_argument("--targets", nargs="*", type=float, default=TARGETS)
    p.add_argument("--llama-types", nargs="*", default=bench_budget.LLAMA_TYPES,
                   help="the llama.cpp mixtures whose files' sizes are sizes too")
    p.add_argument("--options", default=OPTIONS, help=f"AutoScheme's options (default: {OPTIONS})")
    p.add_argument("--tune-sizes", nargs="*", default=[], metavar="SIZE",
                   help="sizes (a target, or a label such as \"at Q4_K_M's size\") also run with tuning")
    p.add_argument("--tune-iters", type=int, default=200, help="auto-round's default tuning steps a block")
    p.add_argument("--autoround-python", type=Path, default=AUTOROUND_PYTHON)
    bench_budget.add_judging_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bin_dir = gg.llama_cpp_bin(args)
    src = bench.benchmark_model(args)
    models = {"plain": src} if "plain" in args.models else {}
    if "outlier" in args.models:
        models["outlier"] = bench_rotations.outlier_model(src, args.workdir, args)
    rows = [row for model, path in models.items() for row in rows_of(model, path, args)]
    measure(rows, models, bin_dir, args)
    version = gg.autoround_version(args)
    print(f"\n{date.today().isoformat()}, {harness.host_facts()['platform']}, {args.threads} threads; llama.cpp "
          f"{gg.llama_cpp_version(bin_dir)}; auto-round {version}; quantkit {bench_rotations.git_head()}; "
          f"calibration {args.num_samples} x {args.seq_len} tokens of {args.calib_data.name}; llama-perplexity -c "
          f"{args.ctx} --chunks {args.chunks} on {args.eval_data.name}\n")
    print(bench_budget.table(rows, models))
    print("\n" + times(rows, models))
    print("\nTargets:\n\n" + "\n".join(f"- {line}" for line in targets(rows)))
    if args.json:
        args.json.write_text(json.dumps({"auto_round": version, "rows": [{**asdict(r), "path": str(r.path)} for r in rows],
                                         "targets": targets(rows)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
