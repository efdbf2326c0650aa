"""Benchmark quantkit's GGUF files against llama.cpp's own quantizer, both measured by llama.cpp's llama-perplexity.

The same machinery as scripts/bench_calibration.py (read its docstring for the trained benchmark model, shared
through `--workdir`, and the thread pinning) and scripts/bench_rotations.py (the outlier copy):

    scripts/build_llama_cpp.sh                                   # once: llama-quantize, -imatrix, -perplexity
    python scripts/bench_gguf.py --json gguf.json

What it does (the models, llama.cpp's converter and F16 files cached under `--workdir`; `--reuse` also keeps every
quantized file an earlier run made there, with its recorded time, and makes only the missing ones; one run compares
all rows side by side):

1. the trained benchmark model of bench_calibration.py (or `--model`), and its outlier copy made by
   scripts/make_outlier_model.py (x64 activation outlier channels feeding q/k/v and gate/up, the same float
   function). Both tools write float16: llama.cpp's converter with `--outtype f16`, quantkit with `--dtype
   float16`, so the unquantized token embedding and output are F16 in every file and only decoder weights differ;
2. llama.cpp's rows per model: its HF -> GGUF converter (convert_hf_to_gguf.py with its `conversion/` package and
   gguf-py, from the llama-cpp-python sdist of the same version as the binaries, extracted once beside them) writes
   the F16 file; `llama-quantize` makes each of `--llama-types` from it (Q4_0, Q4_K_M, and Q8_0 as a check),
   without and with an importance matrix (Q8_0 reads none) that `llama-imatrix` computes on the text quantkit
   calibrates on (`--num-samples` chunks of `--seq-len` tokens of `--calib-data`), always with
   `--token-embedding-type f16 --output-tensor-type f16`. The converter runs through a small wrapper that names a
   byte-level BPE tokenizer llama.cpp's table of hashes does not know (the benchmark model's own) by its
   pre-tokenizer, with quantkit's rule (quantkit.export.gguf_vocab.pre_tokenizer), instead of refusing it: both tools'
   files then carry the same tokenizer;
3. quantkit's rows per model (`--quantkit`): `quantkit finalize SRC OUT.gguf -q RECIPE --format gguf --dtype
   float16`, calibrated recipes on `--calib-data` with `--num-samples` x `--seq-len` tokens. A row `RECIPE:gN`
   runs the shipped recipe with its groups set to N (a user recipe file written to the work dir): gptq-w4a16's
   groups of 128 fill four Q4_0 blocks with one scale, `gptq-w4a16:g32` gives every Q4_0 block its own;
4. `llama-perplexity` on `--eval-data` (WikiText-2 test), the same `--ctx` x `--chunks` for every file, for the
   F16 file and every quantized one. The table shows file size, bits per weight (whole file over all parameters,
   and the decoder's blk.* tensors alone), the perplexity llama-perplexity printed ("Final estimate: PPL = x +/-
   y", parsed, never computed here), its rise over the same model's F16 file, and each tool's time to quantize
   (wall time of its processes: llama-imatrix + llama-quantize; quantkit finalize from interpreter start).

A row that fails (a recipe refused, a file llama.cpp does not load) is kept in the table with its one-line error.
On 2 shared CPU cores (the trained model of 21M parameters, 64 x 512 calibration tokens) quantkit's AWQ took 14 min
a model, GPTQ 1.5-2.5 min, llama.cpp's rows and each llama-perplexity under 1.5 min: about 45 min for both models.
Every process runs with OMP_NUM_THREADS / MKL_NUM_THREADS = `--threads`, and llama.cpp's tools with `-t`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path

import bench_calibration as bench
import bench_rotations
import harness
from harness import WIKITEXT, fmt

LLAMA_CPP_VERSION = os.environ.get("LLAMA_CPP_VERSION", "0.3.36")  # llama-cpp-python's release, as build_llama_cpp.sh
LLAMA_CPP_CACHE = Path(os.environ.get("LLAMA_CPP_CACHE", Path.home() / ".cache" / "quantkit" / "llama.cpp"))
LLAMA_TYPES = ["Q4_0", "Q4_K_M", "Q8_0"]
UNWEIGHTED = {"Q8_0", "F16", "BF16", "F32"}  # types llama-quantize makes without reading an importance matrix
QUANTKIT_ROWS = ["gguf-q4-0", "gptq-w4a16", "gptq-w4a16:g32", "awq-w4a16", "spinquant-gptq-w4a16", "gguf-q8-0"]
PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")

CONVERT_RUNNER = '''\
"""llama.cpp's convert_hf_to_gguf.py (beside this file), written by scripts/bench_gguf.py, with two changes: a
byte-level BPE tokenizer whose hash llama.cpp's table does not know is named by its pre-tokenizer (quantkit's rule,
quantkit.export.gguf_vocab.pre_tokenizer) instead of refused; without sentencepiece installed, a model without
tokenizer.model converts (the converter imports sentencepiece before it looks for that file)."""
import json, runpy, sys
from pathlib import Path

here = Path(__file__).resolve().parent
sys.path[:0] = [str(here), str(here / "gguf-py")]  # the converter's own gguf, not the installed one
import conversion.base as base
from quantkit.export.gguf_vocab import pre_tokenizer

hashed = base.TextModel.get_vocab_base_pre


def named(self, tokenizer):
    try:
        return hashed(self, tokenizer)
    except NotImplementedError:
        name = pre_tokenizer(json.loads((Path(self.dir_model) / "tokenizer.json").read_text(encoding="utf-8")))
        print(f"bench_gguf: tokenizer hash unknown to llama.cpp; pre-tokenizer named {name!r}", file=sys.stderr)
        return name


def sentencepiece_vocab(self):
    path = Path(self.dir_model) / "tokenizer.model"
    if not path.is_file():  # what the converter raises, before it imports sentencepiece
        raise FileNotFoundError(f"File not found: {path}")
    return spm_vocab(self)


spm_vocab = base.TextModel._create_vocab_sentencepiece
base.TextModel.get_vocab_base_pre = named
base.TextModel._create_vocab_sentencepiece = sentencepiece_vocab
sys.argv[0] = str(here / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@dataclass
class Row:
    """One GGUF file: which model, which tool and row, how it was made, and what llama.cpp measured."""

    model: str  # "plain" or "outlier"
    tool: str  # "llama.cpp" or "quantkit"
    row: str  # F16, Q4_0, "Q4_0 + imatrix", or quantkit's row spec
    path: Path
    seconds: float | None = None  # time to quantize (llama.cpp: imatrix + quantize; F16: the conversion)
    imatrix_seconds: float | None = None
    error: str = ""
    size: int | None = None
    bpw_file: float | None = None
    bpw_decoder: float | None = None
    decoder_types: str = ""  # the GGML types of the blk.* matrices, with counts (llama-quantize's mixes, fallbacks)
    ppl: float | None = None
    ppl_error: float | None = None  # llama-perplexity's +/-
    ppl_seconds: float | None = None


# ---------------------------------------------------------------- llama.cpp


def llama_cpp_bin(args: argparse.Namespace) -> Path:
    """`--llama-cpp-bin`, or the folder scripts/build_llama_cpp.sh prints (it builds once, ~7 min on 2 cores)."""
    if args.llama_cpp_bin:
        return args.llama_cpp_bin
    env = {**os.environ, "LLAMA_CPP_VERSION": LLAMA_CPP_VERSION, "LLAMA_CPP_CACHE": str(LLAMA_CPP_CACHE)}
    build = harness.REPO / "scripts" / "build_llama_cpp.sh"
    proc = subprocess.run(["bash", str(build)], env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        sys.exit("scripts/build_llama_cpp.sh failed (its output is above)")
    return Path(proc.stdout.strip().splitlines()[-1])


def llama_cpp_version(bin_dir: Path) -> str:
    """What the binaries say they are (`llama-perplexity --version`: version, build, commit), and their source."""
    proc = subprocess.run([str(bin_dir / "llama-perplexity"), "--version"], capture_output=True, text=True)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("version:")]
    found = said[-1].removeprefix("version: ") if said else "unknown"
    return f"{found}, from the llama-cpp-python {LLAMA_CPP_VERSION} sdist"


def converter(bin_dir: Path) -> Path:
    """The wrapper around llama.cpp's convert_hf_to_gguf.py, extracted once from the llama-cpp-python sdist into
    the folder beside `bin_dir`."""
    folder = bin_dir.parent / "convert"
    runner = folder / "convert_runner.py"
    if not (folder / "convert_hf_to_gguf.py").is_file():
        extract_converter(folder)
    runner.write_text(CONVERT_RUNNER)
    return runner


def extract_converter(folder: Path) -> None:
    """convert_hf_to_gguf.py, conversion/ and gguf-py/ of the sdist's vendor/llama.cpp, into `folder`."""
    print(f"extracting llama.cpp's converter into {folder} ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", tmp]
        subprocess.run(cmd, check=True)
        root = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
        wanted = (root + "convert_hf_to_gguf.py", root + "conversion/", root + "gguf-py/")
        with tarfile.open(next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))) as sdist:
            members = [m for m in sdist.getmembers() if m.name.startswith(wanted)]
            for member in members:
                member.name = member.name.removeprefix(root)
            staging = Path(tmp) / "convert"
            sdist.extractall(staging, members=members, filter="data")
        staging.rename(folder)


def convert_f16(model: str, src: Path, dst: Path, runner: Path, threads: int) -> Row:
    """llama.cpp's F16 file of `src`, converted once (its time kept beside it, for later runs' tables)."""
    timing = dst.with_suffix(".seconds")
    if not (dst.is_file() and timing.is_file()):
        cmd = [sys.executable, str(runner), str(src), "--outtype", "f16", "--outfile", str(dst)]
        run = harness.measure(cmd, harness.thread_env(threads), tail=3000)
        if run.returncode:
            sys.exit(f"llama.cpp's converter failed on {src}:\n{run.stderr_tail}")
        timing.write_text(f"{run.seconds:.2f}\n")
    return Row(model, "llama.cpp", "F16", dst, seconds=float(timing.read_text()))


def imatrix(bin_dir: Path, f16: Path, args: argparse.Namespace) -> tuple[Path | None, float | None, str]:
    """(the importance matrix, llama-imatrix's wall time, an error) over `--num-samples` chunks of `--seq-len`."""
    out = f16.with_name("imatrix.gguf")
    cmd = [str(bin_dir / "llama-imatrix"), "-m", str(f16), "-f", str(args.calib_data), "-o", str(out),
           "-c", str(args.seq_len), "--chunks", str(args.num_samples), "-t", str(args.threads), "--no-ppl"]
    seconds, error = made(out, cmd, args)
    return (None if error else out), seconds, error


def llama_rows(model: str, bin_dir: Path, f16: Path, args: argparse.Namespace) -> list[Row]:
    """llama-quantize's rows of one model: each of `--llama-types`, without and with the importance matrix (Q8_0
    without only: llama-quantize makes the same file either way)."""
    matrix, matrix_s, matrix_error = imatrix(bin_dir, f16, args)
    rows = []
    for kind in args.llama_types:
        for weighted in (False,) if kind.upper() in UNWEIGHTED else (False, True):
            row = Row(model, "llama.cpp", kind + (" + imatrix" if weighted else ""),
                      f16.with_name(f"llama-{kind}{'-imatrix' if weighted else ''}.gguf"))
            if weighted and matrix is None:
                row.error = f"llama-imatrix failed: {matrix_error}"
            else:
                llama_quantize(bin_dir, f16, row, kind, matrix if weighted else None, args)
                if weighted and row.seconds is not None:
                    row.imatrix_seconds = matrix_s
                    row.seconds += matrix_s
            rows.append(row)
            print(f"{model} llama.cpp {row.row}: {row_state(row)}", file=sys.stderr)
    return rows


def llama_quantize(bin_dir: Path, f16: Path, row: Row, kind: str, matrix: Path | None,
                   args: argparse.Namespace) -> None:
    weights = ["--imatrix", str(matrix)] if matrix else []
    cmd = [str(bin_dir / "llama-quantize"), *weights, "--token-embedding-type", "f16", "--output-tensor-type", "f16",
           str(f16), str(row.path), kind, str(args.threads)]
    row.seconds, row.error = made(row.path, cmd, args)


# ---------------------------------------------------------------- quantkit


def recipe_for(spec: str, folder: Path) -> str:
    """A row spec's recipe: the shipped name, or for `NAME:gN` a user recipe file with groups of N."""
    name, _, groups = spec.partition(":")
    if not groups:
        return name
    from quantkit.quant.registry import resolve

    if not groups.startswith("g") or not groups[1:].isdigit():
        raise ValueError(f"row {spec!r}: the part after ':' is gN (groups of N weights), e.g. {name}:g32")
    shipped = resolve(name)
    size = shipped.scheme.weights.group_size
    path = folder / f"{name}-g{groups[1:]}.yaml"
    path.write_text(Path(shipped.source).read_text().replace(f"group_size: {size}", f"group_size: {groups[1:]}"))
    return str(path)


def quantkit_row(model: str, src: Path, spec: str, folder: Path, args: argparse.Namespace) -> Row:
    """`quantkit finalize SRC OUT.gguf -q RECIPE --format gguf --dtype float16 [calibration]`, timed."""
    from quantkit.quant.registry import resolve

    row = Row(model, "quantkit", spec, folder / f"quantkit-{spec.replace(':', '-')}.gguf")
    try:
        recipe = recipe_for(spec, folder)
        calibrated = resolve(recipe).needs_calibration
    except Exception as error:  # an unknown recipe or row spec: the row says so, the other rows still run
        row.error = one_line(str(error))
        return row
    calibration = harness.calibration_options(args.calib_data, args.num_samples, args.seq_len) if calibrated else []
    cmd = harness.finalize_command(src, row.path, recipe, args.threads, "--format", "gguf", "--dtype", "float16",
                                   *calibration)
    row.seconds, row.error = made(row.path, cmd, args)
    print(f"{model} quantkit {spec}: {row_state(row)}", file=sys.stderr)
    return row


def made(path: Path, cmd: list[str], args: argparse.Namespace) -> tuple[float | None, str]:
    """(wall seconds, "") of the command that writes `path`, or (None, its one-line error). With `--reuse`, a file
    made by an earlier run is kept and its recorded time reported (PATH.seconds, written beside every file made)."""
    timing = path.with_name(path.name + ".seconds")
    if args.reuse and path.is_file() and timing.is_file():
        return float(timing.read_text()), ""
    timing.unlink(missing_ok=True)
    run = harness.measure(cmd, harness.thread_env(args.threads))
    if run.returncode or not path.is_file():
        return None, one_line(run.stderr_tail) or f"exit code {run.returncode}, nothing printed"
    timing.write_text(f"{run.seconds:.2f}\n")
    return run.seconds, ""


# ---------------------------------------------------------------- measuring


def perplexity(bin_dir: Path, row: Row, args: argparse.Namespace, tries: int = 2) -> None:
    """llama-perplexity's final estimate for `row`'s file (same -c / --chunks for every file), or its error. Run
    again when it exits 0 without the estimate: once in ~25 runs on a loaded machine its asynchronous logger lost
    the last lines of stderr (the per-chunk values on stdout were complete)."""
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(row.path), "-f", str(args.eval_data), "-c", str(args.ctx),
           "--chunks", str(args.chunks), "-t", str(args.threads), "-b", str(args.ctx)]
    log = row.path.with_suffix(".perplexity.log")
    for _ in range(tries):
        began = time.perf_counter()
        proc = subprocess.run(cmd, env=harness.thread_env(args.threads), capture_output=True, text=True)
        row.ppl_seconds = time.perf_counter() - began
        log.write_text(proc.stdout + proc.stderr)
        found = PPL.search(proc.stdout + proc.stderr)
        if found or proc.returncode:
            break
    if proc.returncode or not found:
        row.error = f"llama-perplexity (rc {proc.returncode}): " + one_line(proc.stderr or proc.stdout)
        return
    row.ppl, row.ppl_error = float(found[1]), float(found[2])


def sizes(row: Row, parameters: int) -> None:
    """File size; bits per weight of the whole file over all parameters, and of the blk.* tensors alone; the types
    of the blk.* matrices."""
    from collections import Counter

    from gguf import GGUFReader

    row.size = row.path.stat().st_size
    row.bpw_file = 8 * row.size / parameters
    tensors = [t for t in GGUFReader(row.path).tensors if t.name.startswith("blk.")]
    row.bpw_decoder = 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)
    kinds = Counter(t.tensor_type.name for t in tensors if len(t.shape) == 2)
    row.decoder_types = ", ".join(f"{kind} x{count}" for kind, count in kinds.most_common())


def one_line(text: str) -> str:
    """The last line of `text` that says something (a CLI's one-line error, llama.cpp's last complaint)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def row_state(row: Row) -> str:
    return f"FAILED: {row.error}" if row.error else f"{row.seconds:.1f}s"


# ---------------------------------------------------------------- reporting

HEADER = ["model", "tool", "row", "file MiB", "bits/weight (file)", "bits/weight (decoder)", "decoder matrices",
          "perplexity", "rise over F16", "quantize s"]


def rise(row: Row, f16: dict[str, Row]) -> float | None:
    base = f16.get(row.model)
    return row.ppl / base.ppl - 1 if row.ppl and base and base.ppl and row.row != "F16" else None


def table_row(r: Row, f16: dict[str, Row]) -> list[str]:
    change = rise(r, f16)
    took = fmt(r.seconds, ".1f") + (f" (imatrix {r.imatrix_seconds:.1f})" if r.imatrix_seconds else "")
    measured = f"{r.ppl:.3f} ± {r.ppl_error:.3f}" if r.ppl else "FAILED: " + r.error.replace("|", "/")
    return [r.model, r.tool, r.row, fmt(r.size and r.size / harness.MIB, ".2f"), fmt(r.bpw_file, ".2f"),
            fmt(r.bpw_decoder, ".2f"), r.decoder_types, measured,
            "" if r.row == "F16" else "n/a" if change is None else f"{100 * change:+.2f}%",
            f"convert {took}" if r.row == "F16" else took]


def table(rows: list[Row]) -> str:
    f16 = {r.model: r for r in rows if r.row == "F16"}
    return harness.markdown_table(HEADER, [table_row(r, f16) for r in rows], "lllrrrllrr")


def facts(models: dict[str, Path], bin_dir: Path, args: argparse.Namespace) -> dict:
    return {
        "date": date.today().isoformat(), **harness.host_facts(), **harness.versions("torch", "transformers", "gguf"),
        "llama_cpp": llama_cpp_version(bin_dir), "threads": args.threads, "quantkit_commit": bench_rotations.git_head(),
        "models": {m: {"path": str(p), "parameters": harness.parameter_count(p), "training": bench.training_facts(p)}
                   for m, p in models.items()},
        "calibration": f"quantkit: {args.num_samples} x {args.seq_len} tokens of {args.calib_data} (seed 0); "
                       f"llama-imatrix: the first {args.num_samples} chunks of {args.seq_len} tokens of the same file",
        "eval": f"llama-perplexity -c {args.ctx} --chunks {args.chunks} on {args.eval_data}",
    }


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_model_arguments(p)  # --workdir, --model, and the trained model's --hidden, --train-*
    p.add_argument("--models", nargs="+", choices=["plain", "outlier"], default=["plain", "outlier"])
    p.add_argument("--outlier-channels", type=int, default=4, help="outlier channels per norm (make_outlier_model.py)")
    p.add_argument("--outlier-factor", type=float, default=64.0, help="their scale (a power of two is exact)")
    p.add_argument("--quantkit", nargs="+", default=QUANTKIT_ROWS, metavar="ROW",
                   help="quantkit's rows: recipe names, or NAME:gN for the recipe with groups of N "
                        f"(default: {' '.join(QUANTKIT_ROWS)})")
    p.add_argument("--llama-types", nargs="+", default=LLAMA_TYPES, metavar="TYPE",
                   help=f"llama-quantize's types, each without and with an imatrix (default: {' '.join(LLAMA_TYPES)})")
    p.add_argument("--llama-cpp-bin", type=Path, help="folder with llama-quantize, llama-imatrix, llama-perplexity "
                   "(default: what scripts/build_llama_cpp.sh prints)")
    p.add_argument("--calib-data", type=Path, default=WIKITEXT / "valid.txt")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-data", type=Path, default=WIKITEXT / "test.txt")
    p.add_argument("--ctx", type=int, default=512, help="llama-perplexity -c")
    p.add_argument("--chunks", type=int, default=40, help="llama-perplexity --chunks")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reuse", action="store_true", help="keep the files (and their recorded times) an earlier run "
                   "made in --workdir, make only the missing ones, and measure them all")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    bin_dir = llama_cpp_bin(args)
    runner = converter(bin_dir)
    src = bench.benchmark_model(args)
    models = {"plain": src} if "plain" in args.models else {}
    if "outlier" in args.models:
        models["outlier"] = bench_rotations.outlier_model(src, args.workdir, args)
    rows = []
    for model, path in models.items():
        folder = args.workdir / "gguf" / (path.parent.name if path.name == "final" else path.name)
        folder.mkdir(parents=True, exist_ok=True)
        f16 = convert_f16(model, path, folder / "f16.gguf", runner, args.threads)
        rows += [f16, *llama_rows(model, bin_dir, f16.path, args)]
        rows += [quantkit_row(model, path, spec, folder, args) for spec in args.quantkit]
    for row in rows:
        if not row.error:
            sizes(row, harness.parameter_count(models[row.model]))
            perplexity(bin_dir, row, args)
            print(f"{row.model} {row.tool} {row.row}: ppl {fmt(row.ppl, '.3f')} {row.error}", file=sys.stderr)
    known = facts(models, bin_dir, args)
    print(f"\n{known['date']}, {known['platform']}, {known['cpus']} CPUs, {args.threads} threads; "
          f"llama.cpp {known['llama_cpp']}; {known['calibration']}; {known['eval']}\n")
    print(table(rows))
    if args.json:
        f16 = {r.model: r for r in rows if r.row == "F16"}
        args.json.write_text(json.dumps({"machine": known, "rows": [
            {**asdict(r), "path": str(r.path), "rise": rise(r, f16)} for r in rows]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
