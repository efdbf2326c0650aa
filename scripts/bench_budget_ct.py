"""Benchmark `finalize --target-bpw` for compressed-tensors (a recipe's scheme per Linear, from measured sensitivity,
written as per-layer config_groups) against every uniform recipe of the same size and auto-round's AutoScheme, all
judged by `quantkit eval --kl-divergence` against the model in bfloat16.

    ~/.cache/quantkit/autoround-venv/bin/pip install "compressed-tensors==0.20.1"   # once: auto-round's CT export
    python scripts/bench_budget_ct.py --reuse --json budget-ct.json

The models are scripts/bench_budget.py's (the trained Llama and its outlier copy, in `--workdir`), each saved once
in bfloat16 (the dtype vLLM runs; `--workdir`/ct/NAME/bf16): every artifact is made from that copy and judged
against it. Per model:

- quantkit's uniform rows: `quantkit finalize BF16 OUT -q RECIPE` for each of `--uniform`, the weight-only
  compressed-tensors recipes whose size lands between W4A16's and W8A16's (GPTQ; round to nearest and HQQ, which
  need no data; AWQ and AutoRound are left out for their time);
- quantkit's budget rows: `quantkit finalize BF16 OUT -q gptq-w4a16 --target-bpw B` (the default candidates
  gptq-w4a16, gptq-w8a16; GPTQ with gptq-w4a16's settings), at W4A16's size + 0.1 bits and three points between
  W4A16's and W8A16's sizes (`--targets` overrides), and `--target-size` at the tensor bytes of each uniform recipe
  of `--at-sizes` ("at gptq-w8a16's size"; default every uniform GPTQ recipe); with `--wide-candidates`, again at
  `--wide-sizes` with those candidates (e.g. gptq-w4a16-asym beside the defaults);
- auto-round's AutoScheme (`--autoscheme`, under `--autoround-python`, auto-round's own venv, never imported here):
  autoscheme_ct_runner.py (AUTOSCHEME_CT_RUNNER, written to the work dir) runs `AutoRound(BF16,
  scheme=AutoScheme(avg_bits=B, options=("W4A16", "W8A16")), iters=N, dataset=quantkit's calibration
  blocks).quantize_and_save(DIR, format="llm_compressor")` (compressed-tensors). AutoScheme's count of bits is not
  the file's, so the runner bisects avg_bits (on the model's cached scores) for its smallest plan whose tensors take
  at least the quantkit plan's bytes, each Linear priced as compressed-tensors packs its scheme, and exports that
  one: the row "at the plan's size" (`--autoscheme-sizes` names the plan rows; `--tune-sizes` adds tuned runs).
  Its W8A16 is auto-round's preset (int8 in groups of 128), not quantkit's gptq-w8a16 (int8 per channel). Its
  scoring calibrates on quantkit's blocks (harness.write_calibration's) registered as an auto-round dataset, as
  scripts/bench_autoscheme.py's GGUF runs do, and is cached per model (`autoscheme.scores`): the first row of a
  model pays for it.

Every artifact is judged by one `quantkit eval BF16 A B ... --data test.txt --seq-len 512 --max-samples 40
--kl-divergence --json` per model (40 windows of 512 tokens of WikiText-2 test, as the GGUF rows' llama-perplexity
-c 512 --chunks 40; quantkit's tokenization and scoring, so the numbers are not the GGUF tables'): mean and 99th
percentile KL divergence from the bfloat16 model, top-1 agreement, paired perplexity ratio. Bits per weight are
the planner's: 8 x the bytes of every tensor in the artifact's safetensors files (packed weights, scales, zero
points, the float embedding, lm_head and norms in bfloat16) over the model's parameters. The targets, per size:
for every other artifact (a uniform recipe, AutoScheme's), the largest plan no larger than it has a lower KL
divergence. Each artifact's eval result is kept beside it (PATH.eval.json) and `--reuse` keeps those too.
On 2 shared cores a GPTQ artifact took 1-2.5 min, a plan 1.5-2.5 min, AutoScheme's first row 4-5 min, and one eval of
16 artifacts about 6 min.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import bench_autoscheme
import bench_calibration as bench
import bench_gguf as gg
import bench_rotations
import harness
from harness import WIKITEXT, fmt

UNIFORM = ["gptq-w4a16", "gptq-w4a16-asym", "gptq-nvfp4-a16", "gptq-w8a16", "int4-weight-only", "hqq-w4a16",
           "int8-weight-only"]
PLAN_RECIPE = "gptq-w4a16"  # the plans' algorithm and calibration
LOW, HIGH = "gptq-w4a16", "gptq-w8a16"  # the range the plans span

AUTOSCHEME_CT_RUNNER = '''\
"""auto-round's AutoScheme with its compressed-tensors export, written by scripts/bench_budget_ct.py, run under
auto-round's venv:

    python autoscheme_ct_runner.py SRC OUT_DIR AVG_BITS OPTIONS ITERS CALIB.safetensors THREADS

AVG_BITS `bytes:N` first bisects avg_bits (on the cached scores, AR_AUTO_SCHEME_CACHE) for the smallest plan whose
tensors take at least N bytes, each Linear priced as compressed-tensors packs it (int32-packed weights, one scale
a group in the model dtype, the shape), every other tensor in the model dtype. It prints a JSON line and writes
OUT_DIR (format llm_compressor); ITERS 0 rounds with auto-round's RTN, more tunes."""
import json, math, re, sys, time
from pathlib import Path

src, out, avg_bits, options, iters, calib, threads = sys.argv[1:8]
import torch
from safetensors.torch import load_file

torch.set_num_threads(int(threads))
import auto_round.calib_dataset as calib_dataset
from auto_round import AutoRound
from auto_round.auto_scheme.gen_auto_scheme import AutoScheme
from datasets import Dataset

''' + bench_autoscheme.CALIBRATION_BLOCKS + '''

def rounder(bits):
    scheme = AutoScheme(avg_bits=bits, options=options.split(","), nsamples=samples, seqlen=seqlen,
                        dataset="quantkit-blocks", enable_torch_compile=False)
    return AutoRound(src, scheme=scheme, iters=int(iters), dataset="quantkit-blocks", nsamples=samples,
                     seqlen=seqlen, seed=0, device_map="cpu", enable_torch_compile=False)


def planned_bytes(bits):
    r = rounder(bits)
    r.formats = "llm_compressor"
    r.post_init()
    total = 0
    for name, param in r.model_context.model.named_parameters():
        layer = r.layer_config.get(name.rsplit(".", 1)[0], {})
        if layer.get("bits", 16) >= 16 or param.dim() != 2:
            total += param.numel() * 2
            continue
        rows, cols = param.shape
        group = layer.get("group_size", 128)
        group = cols if group in (-1, 0) else group
        total += rows * math.ceil(cols * layer["bits"] / 32) * 4 + rows * math.ceil(cols / group) * 2 + 16
    return int(total)


''' + bench_autoscheme.BISECTION + '''

began = time.perf_counter()
result = {}
if avg_bits.startswith("bytes:"):
    bits, found = smallest_reaching(int(avg_bits[6:]))
    result = {"avg_bits": bits, "planned_bytes": found, "search_s": time.perf_counter() - began}
else:
    bits = float(avg_bits)
rounder(bits).quantize_and_save(out, format="llm_compressor")
for written in [p.parent for p in Path(out).glob("*/config.json")]:  # auto-round saves into OUT/<model>-w4g128
    for path in written.iterdir():
        path.rename(Path(out) / path.name)
    written.rmdir()
print(json.dumps({**result, "avg_bits": bits, "seconds": time.perf_counter() - began}))
'''


@dataclass
class Row:
    """One compressed-tensors artifact: how it was made and what `quantkit eval --kl-divergence` measured."""

    model: str
    tool: str  # "quantkit", "quantkit budget", "auto-round AutoScheme"
    row: str
    path: Path
    size_of: str = ""  # the uniform recipe whose size it stands at, or "" for a --target-bpw row
    seconds: float | None = None
    cpu_seconds: float | None = None
    avg_bits: float | None = None  # AutoScheme's
    error: str = ""
    tensor_bytes: int | None = None
    bpw: float | None = None
    schemes: str = ""
    kld: float | None = None
    kld_p99: float | None = None
    same_top: float | None = None
    ratio: float | None = None
    perplexity: float | None = None


def tensor_bytes(folder: Path) -> int:
    """The bytes of every tensor in the folder's safetensors files (their headers' data offsets)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")
    return total


def schemes(folder: Path) -> str:
    """The decoder Linears' schemes from config.json's config_groups (a name, a `re:` pattern, or the class
    "Linear" as catch-all, as vLLM matches them), counted: "int8 channel x16, int4 g128 x12"."""
    groups = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]
    with next(folder.glob("*.safetensors")).open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    linears = sorted({k.rsplit(".", 1)[0] for k in header if k.startswith("model.layers.") and
                      (k.endswith(".weight_packed") or k.endswith(".weight") and len(header[k]["shape"]) == 2)})
    counts = {}
    for name in linears:
        matched = [g for g in groups.values() if any(t == name or t.startswith("re:") and re.fullmatch(t[3:], name)
                                                      for t in g["targets"])]
        group = (matched or [g for g in groups.values() if "Linear" in g["targets"]] or [None])[0]
        w = group and group["weights"]
        text = "float" if not w else f"{w['type']}{w['num_bits']} " + \
            (f"g{w['group_size']}" if "group" in w["strategy"] else w["strategy"]) + ("" if w["symmetric"] else " asym")
        counts[text] = counts.get(text, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def bf16_copy(src: Path, folder: Path) -> Path:
    """The model in bfloat16 (what vLLM runs, and every artifact here is made from), saved once."""
    dst = folder / "bf16"
    if (dst / "config.json").is_file():
        return dst

    def save() -> None:
        import shutil

        import torch
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(torch.bfloat16).save_pretrained(dst)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / name, dst / name)

    harness.in_child(save, what=f"saving {src} in bfloat16")
    return dst


def finalize_row(row: Row, src: Path, recipe: str, args: argparse.Namespace, *options: object) -> Row:
    calibration = harness.calibration_options(args.calib_data, args.num_samples, args.seq_len)
    cmd = harness.finalize_command(src, row.path, recipe, args.threads, *options, *calibration)
    row.seconds, row.error = made(row.path, cmd, args)
    print(f"{row.model} {row.tool} {row.row}: {gg.row_state(row)}", file=sys.stderr)
    return sized(row)


def made(path: Path, cmd: list[str], args: argparse.Namespace) -> tuple[float | None, str]:
    """bench_gguf.made for an artifact directory: (wall seconds, "") of the command that writes it, or (None, its
    one-line error); with `--reuse`, one made before is kept with its recorded time (PATH.seconds)."""
    timing = path.with_name(path.name + ".seconds")
    if args.reuse and (path / "config.json").is_file() and timing.is_file():
        return float(timing.read_text()), ""
    run = harness.measure(cmd, harness.thread_env(args.threads))
    if run.returncode or not (path / "config.json").is_file():
        return None, gg.one_line(run.stderr_tail) or f"exit code {run.returncode}, nothing written"
    timing.write_text(f"{run.seconds:.2f}\n")
    return run.seconds, ""


def sized(row: Row) -> Row:
    if not row.error and row.path.is_dir():
        row.tensor_bytes = tensor_bytes(row.path)
        row.schemes = schemes(row.path)
    return row


def plan_targets(low: Row, high: Row, parameters: int, args: argparse.Namespace) -> list[float]:
    """`--targets`, else W4A16's bits per weight + 0.1 and three points evenly between W4A16's and W8A16's."""
    if args.targets:
        return args.targets
    a, b = (8 * r.tensor_bytes / parameters for r in (low, high))
    return [round(a + 0.1, 2)] + [round(a + (b - a) * k / 4, 2) for k in (1, 2, 3)]


def rows_of(model: str, src: Path, args: argparse.Namespace) -> list[Row]:
    """The model's uniform rows, then its plans, then AutoScheme at the plans of `--autoscheme-sizes`."""
    folder = args.workdir / "ct" / (src.parent.name if src.name == "final" else src.name)
    folder.mkdir(parents=True, exist_ok=True)
    bf16 = bf16_copy(src, folder)
    parameters = harness.parameter_count(bf16)
    uniform = [finalize_row(Row(model, "quantkit", recipe, folder / recipe), bf16, recipe, args) for recipe in args.uniform]
    rows = uniform + plan_rows(model, bf16, folder, {r.row: r for r in uniform if not r.error}, parameters, args)
    if args.autoscheme:
        calib = folder / f"calib-{args.num_samples}x{args.seq_len}.safetensors"
        if not calib.is_file():
            harness.write_calibration(bf16, args.calib_data, args.num_samples, args.seq_len, folder)
        for plan in [r for r in rows if r.tool == "quantkit budget" and not r.error and r.row in args.autoscheme_sizes]:
            for iters in [0] + ([args.tune_iters] if plan.row in args.tune_sizes else []):
                rows.append(autoscheme_row(model, bf16, plan, iters, calib, folder, args))
    for row in rows:
        row.bpw = None if row.tensor_bytes is None else 8 * row.tensor_bytes / parameters
    return rows


def plan_rows(model: str, src: Path, folder: Path, uniform: dict[str, Row], parameters: int,
              args: argparse.Namespace) -> list[Row]:
    """`--target-bpw` at each target, `--target-size` at each `--at-sizes` recipe's bytes, and with
    `--wide-candidates` at each `--wide-sizes` recipe's bytes."""
    rows = []
    for target in plan_targets(uniform[LOW], uniform[HIGH], parameters, args):
        row = Row(model, "quantkit budget", f"--target-bpw {target:g}", folder / f"budget-{target:.4f}")
        rows.append(finalize_row(row, src, PLAN_RECIPE, args, "--target-bpw", f"{target:.4f}"))
    for peer in (uniform[name] for name in args.at_sizes if name in uniform):
        row = Row(model, "quantkit budget", f"at {peer.row}'s size", folder / f"budget-at-{peer.row}", size_of=peer.row)
        rows.append(finalize_row(row, src, PLAN_RECIPE, args, "--target-size", peer.tensor_bytes))
    for peer in (uniform[name] for name in args.wide_sizes if name in uniform and args.wide_candidates):
        row = Row(model, "quantkit budget", f"at {peer.row}'s size, wide", folder / f"budget-wide-at-{peer.row}",
                  size_of=peer.row)
        rows.append(finalize_row(row, src, PLAN_RECIPE, args, "--target-size", peer.tensor_bytes,
                                 "--candidates", args.wide_candidates))
    return rows


def autoscheme_row(model: str, src: Path, plan: Row, iters: int, calib: Path, folder: Path,
                   args: argparse.Namespace) -> Row:
    """AutoScheme's smallest plan of at least `plan`'s tensor bytes (the runner's bisection on the model's cached
    scores), exported as compressed-tensors; its time (wall and CPU seconds of the process, the search included)
    kept beside it for `--reuse`."""
    name = f"autoscheme-{re.sub(r'[^0-9a-z.]+', '-', plan.row.lower()).strip('-')}" + (f"-i{iters}" if iters else "")
    row = Row(model, "auto-round AutoScheme", "", folder / name, size_of=plan.size_of or plan.row)
    timing = folder / f"{name}.json"
    if not (args.reuse and row.path.is_dir() and timing.is_file()):
        runner = folder.parent / "autoscheme_ct_runner.py"
        runner.write_text(AUTOSCHEME_CT_RUNNER)
        cmd = [str(args.autoround_python), str(runner), str(src), str(row.path), f"bytes:{plan.tensor_bytes}",
               args.options, str(iters), str(calib), str(args.threads)]
        run, printed = harness.measure_logged(cmd, bench_autoscheme.runner_env(folder / "autoscheme.scores", args),
                                              folder / f"{name}.log")
        result = harness.last_json_line(printed)
        if run.returncode or not result:
            row.row, row.error = f"= plan {plan.row}", gg.one_line(run.stderr_tail) or f"exit code {run.returncode}"
            print(f"{model} AutoScheme {name}: FAILED: {row.error}", file=sys.stderr)
            return row
        timing.write_text(json.dumps({**result, "wall_s": run.seconds, "cpu_s": run.cpu_seconds}) + "\n")
    found = json.loads(timing.read_text())
    row.avg_bits, row.seconds, row.cpu_seconds = found["avg_bits"], found["wall_s"], found["cpu_s"]
    row.row = f"avg_bits {row.avg_bits:.4g} (= plan {plan.row})" + (f", iters {iters}" if iters else "")
    print(f"{model} AutoScheme {name}: avg_bits {row.avg_bits:.4f}, {row.seconds:.0f} s", file=sys.stderr)
    return sized(row)


def measure(rows: list[Row], models: dict[str, Path], args: argparse.Namespace) -> None:
    """One `quantkit eval --kl-divergence` per model over its artifacts not yet measured (each result kept beside
    its artifact as PATH.eval.json for `--reuse`), against the model in bfloat16."""
    for model in models:
        mine = [r for r in rows if r.model == model and not r.error]
        todo = [r for r in mine if not (args.reuse and r.path.with_name(r.path.name + ".eval.json").is_file())]
        if todo:
            reference = todo[0].path.parent / "bf16"
            out = reference.parent / "eval-latest.json"
            cmd = harness.quantkit_command("eval", reference, *(r.path for r in todo), "--data", args.eval_data,
                                           "--seq-len", args.ctx, "--max-samples", args.chunks, "--kl-divergence",
                                           "--batch-size", args.eval_batch, "--json", out, "--threads", args.threads,
                                           "--device", "cpu", "--quiet")
            run = harness.measure(cmd, harness.thread_env(args.threads))
            if run.returncode:
                sys.exit(f"quantkit eval failed: {run.stderr_tail}")
            reports = json.loads(out.read_text())["results"]
            for row, report in zip(todo, reports[1:]):
                assert Path(report["path"]).resolve() == row.path.resolve(), (report["path"], row.path)
                row.path.with_name(row.path.name + ".eval.json").write_text(json.dumps(report, indent=1) + "\n")
        for row in mine:
            report = json.loads(row.path.with_name(row.path.name + ".eval.json").read_text())
            kl = report["kl_divergence"]
            row.kld, row.kld_p99, row.same_top, row.ratio = kl["mean"], kl["p99"], 100 * kl["top1_agreement"], \
                kl["perplexity_ratio"]
            row.perplexity = report["perplexity"]["perplexity"]


def table(rows: list[Row]) -> str:
    lines = ["| model | tool | row | bits per weight | tensors MiB | decoder Linears | KLD mean | KLD p99 | same top % | "
             "PPL ratio | make s |", "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r.model, r.tensor_bytes or 0, r.tool)):
        kld = fmt(r.kld, ".7f") if not r.error else gg.one_line(r.error)[:80]
        lines.append(f"| {r.model} | {r.tool} | {r.row} | {fmt(r.bpw, '.3f')} | "
                     f"{fmt(r.tensor_bytes and r.tensor_bytes / 2**20, '.2f')} | {r.schemes} | {kld} | "
                     f"{fmt(r.kld_p99, '.5f')} | {fmt(r.same_top, '.2f')} | {fmt(r.ratio, '.4f')} | {fmt(r.seconds, '.0f')} |")
    return "\n".join(lines)


def targets(rows: list[Row]) -> list[str]:
    """For every other artifact (a uniform recipe, AutoScheme): the largest plan of the default candidates no
    larger than it, met when that plan's KLD is lower."""
    found = []
    plans = [r for r in rows if r.tool == "quantkit budget" and "wide" not in r.row and r.kld is not None]
    for peer in (r for r in rows if r.tool != "quantkit budget" and r.kld is not None):
        fitting = [p for p in plans if p.model == peer.model and p.tensor_bytes <= peer.tensor_bytes]
        if not fitting:
            found.append(f"{peer.model} {peer.tool} {peer.row} ({peer.tensor_bytes:,} B): no plan at or below its size")
            continue
        plan = max(fitting, key=lambda p: (p.tensor_bytes, -p.kld))
        found.append(f"{peer.model} {peer.tool} {peer.row}: {peer.kld:.7f} ({peer.tensor_bytes:,} B) against the plan "
                     f"{plan.row} {plan.kld:.7f} ({plan.tensor_bytes:,} B), KLD ratio {plan.kld / peer.kld:.2f}: "
                     f"{'met' if plan.kld < peer.kld else 'not met'}")
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_model_arguments(p)
    p.add_argument("--intermediate", type=int, default=1536)
    p.set_defaults(train_steps=200)  # bench_budget.py's model
    p.add_argument("--models", nargs="+", choices=["plain", "outlier"], default=["plain", "outlier"])
    p.add_argument("--outlier-channels", type=int, default=4)
    p.add_argument("--outlier-factor", type=float, default=64.0)
    p.add_argument("--uniform", nargs="*", default=UNIFORM)
    p.add_argument("--at-sizes", nargs="*", default=[n for n in UNIFORM if n.startswith("gptq-")], metavar="RECIPE",
                   help="the uniform recipes at whose tensor bytes a plan is made (--target-size)")
    p.add_argument("--targets", nargs="*", type=float, help="--target-bpw values (default: from the uniform sizes)")
    p.add_argument("--wide-candidates", default="", help="a second candidate set, e.g. gptq-w4a16,gptq-w4a16-asym,"
                                                         "gptq-nvfp4-a16,gptq-w8a16")
    p.add_argument("--wide-sizes", nargs="*", default=["gptq-w4a16-asym", "gptq-nvfp4-a16"],
                   help="the uniform recipes at whose sizes the wide candidates are planned")
    p.add_argument("--autoscheme", action="store_true", help="auto-round's AutoScheme at the plans' sizes")
    p.add_argument("--autoscheme-sizes", nargs="*", default=[], metavar="ROW",
                   help="the plan rows (\"--target-bpw 9.2\", \"at gptq-w4a16-asym's size\") AutoScheme is matched to")
    p.add_argument("--options", default="W4A16,W8A16", help="AutoScheme's options")
    p.add_argument("--tune-sizes", nargs="*", default=[], metavar="ROW", help="plan rows AutoScheme also tunes at")
    p.add_argument("--tune-iters", type=int, default=200)
    p.add_argument("--autoround-python", type=Path, default=bench_autoscheme.AUTOROUND_PYTHON)
    p.add_argument("--calib-data", type=Path, default=WIKITEXT / "valid.txt")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-data", type=Path, default=WIKITEXT / "test.txt")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=40)
    p.add_argument("--eval-batch", type=int, default=8, help="eval's windows per forward pass")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    src = bench.benchmark_model(args)
    models = {"plain": src} if "plain" in args.models else {}
    if "outlier" in args.models:
        models["outlier"] = bench_rotations.outlier_model(src, args.workdir, args)
    rows = [row for model, path in models.items() for row in rows_of(model, path, args)]
    measure(rows, models, args)
    print(f"\n{date.today().isoformat()}, {harness.host_facts()['platform']}, {args.threads} threads; quantkit "
          f"{bench_rotations.git_head()}; calibration {args.num_samples} x {args.seq_len} tokens of "
          f"{args.calib_data.name}; quantkit eval --seq-len {args.ctx} --max-samples {args.chunks} on "
          f"{args.eval_data.name}, against the model in bfloat16\n")
    print(table(rows))
    print("\nTargets:\n\n" + "\n".join(f"- {line}" for line in targets(rows)))
    if args.json:
        args.json.write_text(json.dumps({"rows": [{**asdict(r), "path": str(r.path)} for r in rows],
                                         "targets": targets(rows)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
