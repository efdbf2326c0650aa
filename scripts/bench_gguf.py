"""Benchmark quantkit's GGUF files against llama.cpp's own quantizer, both measured by llama.cpp's llama-perplexity.

The same machinery as scripts/bench_calibration.py (read its docstring for the trained benchmark model, shared
through `--workdir`, and the thread pinning) and scripts/bench_rotations.py (the outlier copy):

    scripts/build_llama_cpp.sh                                   # once: llama-quantize, -imatrix, -perplexity
    /tmp/llmc-venv/bin/pip install auto-round gguf               # once: the peer (its GGUF export needs gguf)
    python scripts/bench_gguf.py --intermediate 1536 --json gguf.json

What it does (the models, llama.cpp's converter and F16 files cached under `--workdir`; `--reuse` also keeps every
quantized file an earlier run made there, with its recorded time, and makes only the missing ones; one run compares
all rows side by side):

1. the trained benchmark model of bench_calibration.py (or `--model`), and its outlier copy made by
   scripts/make_outlier_model.py (x64 activation outlier channels feeding q/k/v and gate/up, the same float
   function). Both tools write float16: llama.cpp's converter with `--outtype f16`, quantkit with `--dtype
   float16`, so a token embedding or output left unquantized is F16 in every file;
2. llama.cpp's rows per model: its HF -> GGUF converter (convert_hf_to_gguf.py with its `conversion/` package and
   gguf-py, from the llama-cpp-python sdist of the same version as the binaries, extracted once beside them) writes
   the F16 file; `llama-quantize` makes each of `--llama-types` from it (Q4_0, Q4_K_M, Q3_K_M, Q2_K, IQ4_NL,
   IQ4_XS, and Q8_0 as a check), without and with an importance matrix (Q8_0 reads none) that `llama-imatrix`
   computes on the text
   quantkit calibrates on (`--num-samples` chunks of `--seq-len` tokens of `--calib-data`). The converter runs
   through a small wrapper that names a byte-level BPE tokenizer llama.cpp's table of hashes does not know (the
   benchmark model's own) by its pre-tokenizer, with quantkit's rule (quantkit.export.gguf_vocab.pre_tokenizer),
   instead of refusing it: both tools' files then carry the same tokenizer;
3. quantkit's rows per model (`--quantkit`): `quantkit finalize SRC OUT.gguf -q RECIPE --format gguf --dtype
   float16`, calibrated recipes on `--calib-data` with `--num-samples` x `--seq-len` tokens (row specs below);
4. auto-round's own GGUF export as a peer (`--autoround`, run under `--autoround-python`, auto-round's venv, never
   imported here): autoround_runner.py (AUTOROUND_RUNNER, written to the work dir) calls `AutoRound(SRC,
   scheme="GGUF:Q4_K_M", iters=N, dataset=quantkit's calibration blocks).quantize_and_save(DIR,
   format="gguf:q4_k_m")`, with the two patches of the llama.cpp converter wrapper applied to auto-round's bundled
   copy of that converter. A row `q4_k_m` is its RTN (iters 0: auto-round's "optimised RTN" for GGUF), `q4_k_m:i50`
   its sign-gradient tuning for 50 steps a block. auto-round has no plain Q2_K mixture: its `q2_k_s` (every
   matrix Q2_K) is compared with the Q2_K rows;
5. `llama-perplexity` on `--eval-data` (WikiText-2 test), the same `--ctx` x `--chunks` for every file, for the
   F16 file and every quantized one. The table, grouped by GGUF type, shows file size, bits per weight (whole file
   over all parameters, and the decoder's blk.* tensors alone), the types of the token embedding and the output,
   the perplexity llama-perplexity printed ("Final estimate: PPL = x +/- y", parsed, never computed here), its rise
   over the same model's F16 file, and each tool's time to quantize (wall time of its processes: llama-imatrix +
   llama-quantize; quantkit finalize and auto-round's runner from interpreter start). Then, token by token against
   the F16 file's logits on the same windows (`llama-perplexity --kl-divergence-base` once per model, then
   `--kl-divergence` per file): the paired perplexity ratio PPL / PPL(F16) and the mean KL divergence, each with
   llama-perplexity's +/-, and the share of tokens whose most likely next token is F16's. On a weak model every
   4-bit perplexity lies within the estimate's own +/- (3.5% here) of F16's, while the paired measures rank them;
6. the targets, checked from the table: at every type, quantkit's best file no larger than a peer's (llama.cpp with
   and without imatrix, auto-round) is at or below it by the mean KL divergence from F16; on the outlier model, a
   rotated quantkit Q4_K_M row within 1% of F16's perplexity;
7. `llama-bench -p 0 -n 64 -r 3` decode tokens/s of the first model's files of `--bench-types` (one file per tool
   and type: the kernels are the type's, so the other rows of a type decode alike);
8. quantkit's round-to-nearest rows against llama-quantize's files of their type without an imatrix (RTN_TWINS:
   gguf-q4-0, gguf-q4-k-m+rtn, gguf-iq4-nl, gguf-iq4-xs+rtn, gguf-q8-0), read back with gguf's reader: how many of
   the decoder's matrices hold the same bytes (the same search on the same F16-rounded weights gives the same
   bytes), whether the token embedding and output do, and the other tensors (the norms: llama.cpp's converter keeps
   them float32, quantkit's `--dtype float16` writes them rounded to fp16, in F32).

Row specs for quantkit: a shipped recipe name, with optional modifiers, each making a user recipe file in the work
dir from the shipped YAML: `:gN` sets its groups to N (gptq-w4a16's groups of 128 fill four Q4_0 blocks with one
scale, `gptq-w4a16:g32` gives every Q4_0 block its own); `+rot` adds fused Hadamard rotations R1+R2 (`transforms:
[{type: hadamard, rotations: [R1, R2]}]`, as spinquant-gptq-w4a16); `+rtn` replaces the algorithm by
round-to-nearest and drops the calibration (`gguf-q4-k-m+rtn`: the Q4_K_M mixture without calibration, as
llama-quantize without an imatrix); `+gptq` replaces it by GPTQ (GPTQ_ALGORITHM: the shipped gguf-q4-k-m's and
gguf-iq4-xs's, columns left to right) on the benchmark's calibration (`gguf-iq4-nl+gptq`). The IQ4 rows:
`gguf-iq4-nl` (llama.cpp's search, no data) and `gguf-iq4-nl+gptq`, `gguf-iq4-xs+rtn` and `gguf-iq4-xs` (GPTQ).
llama-quantize writes the token embedding and output in F16 for the types whose quantkit recipe leaves them
unquantized (Q4_0, Q4_1, Q8_0, IQ4_NL, IQ4_XS: `--token-embedding-type f16 --output-tensor-type f16`; left to
itself it would write IQ4_NL / IQ4_XS's embedding in the type and the output in Q6_K), and its own mixture's types
for the K mixtures, which quantkit's K recipes follow (Q4_K_M: Q4_K and Q6_K): each type's files then hold the same
tensors in the same types, and differ only in how the values were chosen.

`--export-time` runs another benchmark instead: the time (wall and CPU), peak memory and load average to write a
GGUF file of a 0.84B Llama of random bf16 weights (hidden 1536, 24 layers, MLP 4608, vocab 32000, untied; built once
in `--workdir` with scripts/build_large_checkpoint.py's writer), or of `--export-model` (e.g. that script's
Llama-3.1-8B shape with fewer layers): `quantkit finalize -q gguf-q4-0`, `-q gguf-q4-k-m+rtn` and `-q
gguf-iq4-xs+rtn` (`--export-types`; none calibrated), streamed from the shards, against llama.cpp's
convert_hf_to_gguf.py (F16) + llama-quantize Q4_0 / Q4_K_M / IQ4_XS. Each file is removed once measured.

A row that fails (a recipe refused, a file llama.cpp does not load) is kept in the table with its one-line error.
On 2 shared CPU cores (the trained model of 21M parameters, 64 x 512 calibration tokens) quantkit's GPTQ rows took
0.5-2.5 min each (AWQ, not a default row, 14 min), llama.cpp's rows and each llama-perplexity under a minute,
auto-round's RTN under a minute and its 50 tuning steps 2-9 min: about an hour for both models with the default
rows before the IQ4 ones. The IQ4 rows alone (the four quantkit IQ4 rows, `--llama-types IQ4_NL IQ4_XS`) took
about half an hour on a machine loaded 3-17: 17 min to make the files (quantkit's GPTQ IQ4 rows 1.5-5 min each), 10
min to measure them. `--export-time` takes about 10 min. Every process runs with OMP_NUM_THREADS / MKL_NUM_THREADS =
`--threads`, and llama.cpp's tools with `-t`. `--no-repack` runs llama-perplexity (and llama-bench) without ggml's
CPU extra buffer types: on an Intel CPU with AMX in a VM (firecracker) the AMX kernels that build_llama_cpp.sh's
native build holds for Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K and IQ4_XS segfault (ggml_backend_amx_mul_mat, at
ldtilecfg), while the same files run with the option.
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
LLAMA_TYPES = ["Q4_0", "Q4_K_M", "Q3_K_M", "Q2_K", "IQ4_NL", "IQ4_XS", "Q8_0"]
UNWEIGHTED = {"Q8_0", "F16", "BF16", "F32"}  # types llama-quantize makes without reading an importance matrix
# quantkit's recipes of these leave the embedding and output in F16 (llama-quantize's own choice for the IQ4 types:
# the embedding in the type itself, the output Q6_K)
UNQUANTIZED_OUTER = {"Q4_0", "Q4_1", "Q8_0", "IQ4_NL", "IQ4_XS"}
QUANTKIT_ROWS = ["gguf-q4-0", "gptq-w4a16:g32", "gptq-w4a16:g32+rot", "gguf-q4-k-m", "gguf-q4-k-m+rtn",
                 "gguf-q4-k-m+rot", "gguf-q3-k-m", "gguf-q3-k-m+rot", "gguf-q2-k", "gguf-q2-k+rot", "gguf-iq4-nl",
                 "gguf-iq4-nl+gptq", "gguf-iq4-xs+rtn", "gguf-iq4-xs", "gguf-q8-0"]
# `+gptq`: the algorithm of the shipped GPTQ GGUF recipes (gguf-q4-k-m, gguf-iq4-xs), columns left to right
GPTQ_ALGORITHM = {"name": "gptq", "block_size": 128, "dampening_frac": 0.01, "actorder": False}
# quantkit's round-to-nearest rows and the llama-quantize file (no imatrix) each should equal in the decoder's bytes
RTN_TWINS = {"gguf-q4-0": "Q4_0", "gguf-q4-k-m+rtn": "Q4_K_M", "gguf-iq4-nl": "IQ4_NL", "gguf-iq4-xs+rtn": "IQ4_XS",
             "gguf-q8-0": "Q8_0"}
AUTOROUND_ROWS = ["q4_0", "q4_k_m", "q4_k_m:i50", "q3_k_m", "q2_k_s"]
AUTOROUND_PYTHON = Path("/tmp/llmc-venv/bin/python")  # bench_calibration.py's peer venv, where auto-round lives
AUTOROUND_KINDS = {"Q2_K_S": "Q2_K"}  # auto-round's scheme -> the llama.cpp type its rows are compared with
TOOLS = ["llama.cpp", "quantkit", "auto-round"]
ROTATION_TARGET = 0.01  # a rotated quantkit Q4_K_M row on the outlier model: within 1% of F16
PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
# llama-perplexity --kl-divergence against the F16 file's logits, token by token on the same windows
KLD = re.compile(r"Mean +KLD: +([0-9.]+) ± +([0-9.]+)")
SAME_TOP = re.compile(r"Same top p: +([0-9.]+) ± +([0-9.]+) %")
PAIRED = re.compile(r"Mean PPL\(Q\)/PPL\(base\) +: +([0-9.]+) ± +([0-9.]+)")

# Both converters' patches (llama.cpp's, and auto-round's bundled copy), after a runner's `base` (the converter's
# conversion.base) and its `unknown_hash(self)` (the pre-tokenizer name of a hash the converter does not know)
CONVERTER_PATCH = '''
hashed, spm_vocab = base.TextModel.get_vocab_base_pre, base.TextModel._create_vocab_sentencepiece


def named(self, tokenizer):
    try:
        return hashed(self, tokenizer)
    except NotImplementedError:
        return unknown_hash(self)


def sentencepiece_vocab(self):
    path = Path(self.dir_model) / "tokenizer.model"
    if not path.is_file():  # what the converter raises, before it imports sentencepiece
        raise FileNotFoundError(f"File not found: {path}")
    return spm_vocab(self)


base.TextModel.get_vocab_base_pre, base.TextModel._create_vocab_sentencepiece = named, sentencepiece_vocab
'''

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


def unknown_hash(self):
    name = pre_tokenizer(json.loads((Path(self.dir_model) / "tokenizer.json").read_text(encoding="utf-8")))
    print(f"bench_gguf: tokenizer hash unknown to llama.cpp; pre-tokenizer named {name!r}", file=sys.stderr)
    return name
''' + CONVERTER_PATCH + '''
sys.argv[0] = str(here / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''


AUTOROUND_RUNNER = '''\
"""auto-round's own GGUF export, written by scripts/bench_gguf.py and run under auto-round's venv:

    python autoround_runner.py SRC OUT.gguf SCHEME ITERS CALIB.safetensors PRE_TOKENIZER THREADS

SCHEME is auto-round's GGUF scheme and format (gguf:q4_k_m, ...); ITERS 0 is its RTN (the optimised one for GGUF),
more its sign-gradient tuning. It calibrates on the token blocks of CALIB (quantkit's, the same as every row).
Two patches to its bundled copy of llama.cpp's converter, as the benchmark's llama.cpp converter has: a byte-level
BPE tokenizer whose hash it does not know is named PRE_TOKENIZER (quantkit's rule) instead of refused; a model
without tokenizer.model converts without sentencepiece installed."""
import shutil, sys, tempfile
from pathlib import Path

src, out, scheme, iters, calib, pre, threads = sys.argv[1:8]
import torch
from safetensors.torch import load_file

torch.set_num_threads(int(threads))
from auto_round import AutoRound
from auto_round.export.export_to_gguf.llama_cpp_conversion import get_conversion

base = sys.modules[get_conversion(src).module.__name__ + ".base"]  # its bundled converter, imported once


def unknown_hash(self):
    return pre
''' + CONVERTER_PATCH + '''
ids = load_file(calib)["input_ids"]
rounder = AutoRound(src, scheme=scheme.upper(), iters=int(iters), dataset=[row[None] for row in ids],
                    nsamples=len(ids), seqlen=ids.shape[1], seed=0, device_map="cpu", enable_torch_compile=False)
with tempfile.TemporaryDirectory(dir=Path(out).parent) as tmp:
    rounder.quantize_and_save(tmp, format=scheme)
    written = sorted(Path(tmp).rglob("*.gguf"))
    if len(written) != 1:
        sys.exit(f"auto-round wrote {len(written)} GGUF files: {[str(p) for p in written]}")
    shutil.move(written[0], out)
'''


@dataclass
class Row:
    """One GGUF file: which model, which tool and row, how it was made, and what llama.cpp measured."""

    model: str  # "plain" or "outlier"
    tool: str  # "llama.cpp", "quantkit" or "auto-round"
    row: str  # F16, Q4_0, "Q4_0 + imatrix", quantkit's or auto-round's row spec
    path: Path
    kind: str = ""  # the GGUF type (llama-quantize's name) the row is compared at; quantkit's Q4_0/Q8_0: read back
    seconds: float | None = None  # time to quantize (llama.cpp: imatrix + quantize; F16: the conversion)
    imatrix_seconds: float | None = None
    error: str = ""
    size: int | None = None
    tensor_bytes: int | None = None  # the file's tensors alone (its metadata differs between tools by some KiB)
    bpw_file: float | None = None
    bpw_decoder: float | None = None
    decoder_types: str = ""  # the GGML types of the blk.* matrices, with counts (llama-quantize's mixes, fallbacks)
    outer_types: str = ""  # the types of token_embd and output ("F16 / Q6_K")
    ppl: float | None = None
    ppl_error: float | None = None  # llama-perplexity's +/-
    ppl_seconds: float | None = None
    kld: float | None = None  # mean KL divergence of its next-token distributions from the F16 file's, and its +/-
    kld_error: float | None = None
    same_top: float | None = None  # % of tokens whose most likely next token is the F16 file's
    ratio: float | None = None  # PPL / PPL(F16), paired token by token (llama-perplexity's), and its +/-
    ratio_error: float | None = None
    decode_tps: float | None = None  # llama-bench's tg64 tokens/s (mean over its repetitions) and their std
    decode_tps_std: float | None = None


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
                      f16.with_name(f"llama-{kind}{'-imatrix' if weighted else ''}.gguf"), kind=kind.upper())
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
    """`llama-quantize [--imatrix M] F16 OUT KIND`, the embedding and output pinned to F16 where quantkit's recipe of
    the type leaves them unquantized (UNQUANTIZED_OUTER: Q4_0, Q8_0, the IQ4 types), else the mixture's own types."""
    weights = ["--imatrix", str(matrix)] if matrix else []
    outer = ["--token-embedding-type", "f16", "--output-tensor-type", "f16"]
    outer = outer if kind.upper() in UNQUANTIZED_OUTER else []
    cmd = [str(bin_dir / "llama-quantize"), *weights, *outer, str(f16), str(row.path), kind, str(args.threads)]
    row.seconds, row.error = made(row.path, cmd, args)


# ---------------------------------------------------------------- quantkit


def recipe_for(spec: str, folder: Path) -> str:
    """A row spec's recipe: the shipped name, or for `NAME[:gN][+rot][+rtn|+gptq]` a user recipe file in `folder`
    made from the shipped YAML (groups of N; fused R1+R2 Hadamard rotations; round-to-nearest without calibration,
    or GPTQ (GPTQ_ALGORITHM) with calibration)."""
    import yaml

    from quantkit.quant.registry import resolve

    base, *modifiers = spec.split("+")
    name, _, groups = base.partition(":")
    if not groups and not modifiers:
        return name
    if groups and (not groups.startswith("g") or not groups[1:].isdigit()):
        raise ValueError(f"row {spec!r}: the part after ':' is gN (groups of N weights), e.g. {name}:g32")
    unknown = set(modifiers) - {"rot", "rtn", "gptq"}
    if unknown:
        raise ValueError(f"row {spec!r}: unknown modifier(s) {sorted(unknown)}; known: +rot (R1+R2 rotations), +rtn, "
                         "+gptq")
    if {"rtn", "gptq"} <= set(modifiers):
        raise ValueError(f"row {spec!r}: +rtn and +gptq each replace the algorithm; name one")
    recipe = yaml.safe_load(Path(resolve(name).source).read_text())
    if groups:
        recipe["scheme"]["weights"]["group_size"] = int(groups[1:])
    if "rot" in modifiers:
        recipe["transforms"] = [{"type": "hadamard", "rotations": ["R1", "R2"]}]
    if "rtn" in modifiers:
        recipe["algorithm"] = {"name": "rtn"}
        recipe.pop("calibration", None)
    if "gptq" in modifiers:  # the calibration's sizes are the benchmark's (finalize's options override the file's)
        recipe["algorithm"] = dict(GPTQ_ALGORITHM)
        recipe.setdefault("calibration", {"num_samples": 128, "seq_len": 512})
    path = folder / f"{spec.replace(':', '-').replace('+', '-')}.yaml"
    path.write_text(f"# {spec}: {name}, modified by scripts/bench_gguf.py\n" + yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


def quantkit_row(model: str, src: Path, spec: str, folder: Path, args: argparse.Namespace) -> Row:
    """`quantkit finalize SRC OUT.gguf -q RECIPE --format gguf --dtype float16 [calibration]`, timed."""
    from quantkit.quant.registry import resolve

    row = Row(model, "quantkit", spec, folder / f"quantkit-{spec.replace(':', '-').replace('+', '-')}.gguf")
    try:
        recipe = recipe_for(spec, folder)
        resolved = resolve(recipe)
    except Exception as error:  # an unknown recipe or row spec: the row says so, the other rows still run
        row.error = one_line(str(error))
        return row
    row.kind = str(getattr(resolved, "mixture", None) or "")  # Q4_0 / Q8_0 rows: read back from the file
    calibration = (harness.calibration_options(args.calib_data, args.num_samples, args.seq_len)
                   if resolved.needs_calibration else [])
    cmd = harness.finalize_command(src, row.path, recipe, args.threads, "--format", "gguf", "--dtype", "float16",
                                   *calibration)
    row.seconds, row.error = made(row.path, cmd, args)
    print(f"{model} quantkit {spec}: {row_state(row)}", file=sys.stderr)
    return row


# ---------------------------------------------------------------- auto-round


def autoround_rows(model: str, src: Path, folder: Path, args: argparse.Namespace) -> list[Row]:
    """auto-round's rows of one model (`--autoround`), under `--autoround-python`, on quantkit's calibration blocks."""
    from quantkit.export.gguf_vocab import pre_tokenizer

    if not args.autoround:
        return []
    runner = folder.parent / "autoround_runner.py"
    runner.write_text(AUTOROUND_RUNNER)
    calib = folder / f"calib-{args.num_samples}x{args.seq_len}.safetensors"
    if not calib.is_file():
        harness.write_calibration(src, args.calib_data, args.num_samples, args.seq_len, folder)
    tokenizer = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    return [autoround_row(model, src, spec, folder, runner, calib, pre_tokenizer(tokenizer), args)
            for spec in args.autoround]


def autoround_row(model: str, src: Path, spec: str, folder: Path, runner: Path, calib: Path, pre: str,
                  args: argparse.Namespace) -> Row:
    """One auto-round GGUF file: `SCHEME` (its RTN, iters 0) or `SCHEME:iN` (N tuning steps a block), timed."""
    scheme, _, iters = spec.partition(":")
    kind = scheme.upper()
    row = Row(model, "auto-round", spec, folder / f"autoround-{spec.replace(':', '-')}.gguf",
              kind=AUTOROUND_KINDS.get(kind, kind))
    if iters and (not iters.startswith("i") or not iters[1:].isdigit()):
        row.error = f"row {spec!r}: the part after ':' is iN (N tuning steps), e.g. {scheme}:i50"
        return row
    cmd = [str(args.autoround_python), str(runner), str(src), str(row.path), f"gguf:{scheme}", iters[1:] or "0",
           str(calib), pre, str(args.threads)]
    row.seconds, row.error = made(row.path, cmd, args)
    print(f"{model} auto-round {spec}: {row_state(row)}", file=sys.stderr)
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
           "--chunks", str(args.chunks), "-t", str(args.threads), "-b", str(args.ctx), *no_repack(args)]
    log = row.path.with_suffix(".perplexity.log")
    marker = f"bench_gguf: -c {args.ctx} --chunks {args.chunks} -f {args.eval_data}{' --no-repack' * args.no_repack}"
    kept = PPL.search(log.read_text()) if args.reuse and log.is_file() and newer(log, row.path) else None
    if kept and marker in log.read_text().splitlines():
        row.ppl, row.ppl_error = float(kept[1]), float(kept[2])
        return
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
    with log.open("a") as f:  # what `--reuse` checks before it keeps this estimate
        f.write(f"\n{marker}\n")


def divergence_base(bin_dir: Path, f16: Row, args: argparse.Namespace) -> Path | None:
    """The F16 file's logits on the evaluation windows (llama-perplexity --kl-divergence-base), which every other
    file of the model is compared with token by token (`divergence`)."""
    base = f16.path.with_suffix(".kld")
    if args.reuse and base.is_file() and newer(base, f16.path):
        return base
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(f16.path), "-f", str(args.eval_data), "-c", str(args.ctx),
           "--chunks", str(args.chunks), "-t", str(args.threads), "-b", str(args.ctx),
           "--kl-divergence-base", str(base), *no_repack(args)]
    proc = subprocess.run(cmd, env=harness.thread_env(args.threads), capture_output=True, text=True)
    return base if proc.returncode == 0 and base.is_file() else None


def divergence(bin_dir: Path, row: Row, base: Path, args: argparse.Namespace, tries: int = 3) -> None:
    """Mean KL divergence from the F16 file's next-token distributions, the share of tokens with the same most
    likely next token, and the paired PPL ratio, as llama-perplexity --kl-divergence prints them: on one model's
    windows these rank files whose perplexities lie within llama-perplexity's own +/- of each other."""
    log = row.path.with_suffix(".kld.log")
    text = log.read_text() if args.reuse and log.is_file() and newer(log, row.path) and newer(log, base) else ""
    marker = "bench_gguf: --kl-divergence --no-repack"  # a log made with --no-repack says so (older logs say nothing)
    text = text if (marker in text.splitlines()) == args.no_repack else ""
    for _ in range(tries if not KLD.search(text) else 0):
        cmd = [str(bin_dir / "llama-perplexity"), "-m", str(row.path), "-t", str(args.threads), "-b", str(args.ctx),
               "--kl-divergence-base", str(base), "--kl-divergence", *no_repack(args)]
        proc = subprocess.run(cmd, env=harness.thread_env(args.threads), capture_output=True, text=True)
        text = proc.stdout + proc.stderr
        log.write_text(text + (f"\n{marker}\n" if args.no_repack else ""))
        if KLD.search(text) or proc.returncode:  # rc 0 without the summary: its logger lost the last lines
            break
    for pattern, fields in ((KLD, ("kld", "kld_error")), (SAME_TOP, ("same_top", None)), (PAIRED, ("ratio", "ratio_error"))):
        if found := pattern.search(text):
            setattr(row, fields[0], float(found[1]))
            if fields[1]:
                setattr(row, fields[1], float(found[2]))


def no_repack(args: argparse.Namespace) -> list[str]:
    """llama-perplexity's `--no-repack` where `--no-repack` asks for it: ggml's CPU extra buffer types off (weights
    repacked for its interleaved kernels, and its AMX kernels)."""
    return ["--no-repack"] if args.no_repack else []


def newer(a: Path, b: Path) -> bool:
    return a.stat().st_mtime >= b.stat().st_mtime


def sizes(row: Row, parameters: int) -> None:
    """File size; bits per weight of the whole file over all parameters, and of the blk.* tensors alone; the types
    of the blk.* matrices, and of the token embedding and output; the row's type, where it was not named (the most
    common type of its decoder matrices: quantkit's Q4_0 and Q8_0 rows)."""
    from collections import Counter

    from gguf import GGUFReader

    row.size = row.path.stat().st_size
    row.bpw_file = 8 * row.size / parameters
    every = GGUFReader(row.path).tensors
    row.tensor_bytes = sum(int(t.n_bytes) for t in every)
    tensors = [t for t in every if t.name.startswith("blk.")]
    row.bpw_decoder = 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)
    kinds = Counter(t.tensor_type.name for t in tensors if len(t.shape) >= 2)  # 3-D: stacked MoE experts
    row.decoder_types = ", ".join(f"{kind} x{count}" for kind, count in kinds.most_common())
    outer = {t.name: t.tensor_type.name for t in every if t.name in ("token_embd.weight", "output.weight")}
    row.outer_types = f"{outer.get('token_embd.weight', '-')} / {outer.get('output.weight', 'tied')}"
    row.kind = row.kind or ("F16" if row.row == "F16" else kinds.most_common(1)[0][0])


def decode_speed(bin_dir: Path, row: Row, args: argparse.Namespace) -> None:
    """llama-bench's decode tokens/s for `row`'s file: 64 generated tokens, no prompt, `--threads`, 3 repetitions."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(row.path), "-p", "0", "-n", "64", "-t", str(args.threads),
           "-r", "3", "-o", "json", *(["--repack", "0"] if args.no_repack else [])]
    proc = subprocess.run(cmd, env=harness.thread_env(args.threads), capture_output=True, text=True)
    try:
        result = json.loads(proc.stdout)[0]
        row.decode_tps, row.decode_tps_std = float(result["avg_ts"]), float(result["stddev_ts"])
    except (ValueError, IndexError, KeyError):
        print(f"llama-bench failed on {row.path} (rc {proc.returncode}): {one_line(proc.stderr)}", file=sys.stderr)


def bench_rows(rows: list[Row], args: argparse.Namespace) -> list[Row]:
    """The files llama-bench times: on the first model, per type of `--bench-types`, each tool's first good row
    (llama.cpp's without imatrix: the same types as with one)."""
    chosen: dict[tuple[str, str], Row] = {}
    first = rows[0].model if rows else ""
    for row in rows:
        if row.model == first and row.kind in args.bench_types and not row.error and row.ppl:
            chosen.setdefault((row.kind, row.tool), row)
    return list(chosen.values())


def one_line(text: str) -> str:
    """The last line of `text` that says something (a CLI's one-line error, llama.cpp's last complaint)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def row_state(row: Row) -> str:
    return f"FAILED: {row.error}" if row.error else f"{row.seconds:.1f}s"


# ---------------------------------------------------------------- reporting

HEADER = ["model", "type", "tool", "row", "file MiB", "bits/weight (file)", "bits/weight (decoder)",
          "decoder matrices", "embd / output", "perplexity", "rise over F16", "PPL / PPL(F16), paired", "mean KLD",
          "same top token", "quantize s"]


def rise(row: Row, f16: dict[str, Row]) -> float | None:
    base = f16.get(row.model)
    return row.ppl / base.ppl - 1 if row.ppl and base and base.ppl and row.row != "F16" else None


def table_row(r: Row, f16: dict[str, Row]) -> list[str]:
    change = rise(r, f16)
    took = fmt(r.seconds, ".1f") + (f" (imatrix {r.imatrix_seconds:.1f})" if r.imatrix_seconds else "")
    measured = f"{r.ppl:.3f} ± {r.ppl_error:.3f}" if r.ppl else "FAILED: " + r.error.replace("|", "/")
    return [r.model, r.kind, r.tool, r.row, fmt(r.size and r.size / harness.MIB, ".2f"), fmt(r.bpw_file, ".2f"),
            fmt(r.bpw_decoder, ".2f"), r.decoder_types, r.outer_types, measured,
            "" if r.row == "F16" else "n/a" if change is None else f"{100 * change:+.2f}%",
            f"{r.ratio:.4f} ± {r.ratio_error:.4f}" if r.ratio else "",
            f"{r.kld:.6f} ± {r.kld_error:.6f}" if r.kld is not None else "",
            f"{r.same_top:.2f}%" if r.same_top is not None else "",
            f"convert {took}" if r.row == "F16" else took]


def ordered(rows: list[Row], kinds: list[str]) -> list[Row]:
    """Rows by model, then type (F16 first, then `kinds`' order), then tool; each tool's rows as they ran."""
    models = list(dict.fromkeys(r.model for r in rows))
    order = ["F16", *map(str.upper, kinds)]
    rank = {kind: i for i, kind in enumerate(order)}
    return sorted(rows, key=lambda r: (models.index(r.model), rank.get(r.kind, len(order)), TOOLS.index(r.tool)))


def table(rows: list[Row]) -> str:
    f16 = {r.model: r for r in rows if r.row == "F16"}
    return harness.markdown_table(HEADER, [table_row(r, f16) for r in rows], "llllrrrlllrrrrr")


def mib(row: Row) -> str:
    return f"tensors {row.tensor_bytes / harness.MIB:.2f} MiB"


def type_target(model: str, kind: str, rows: list[Row]) -> list[str]:
    """One line per peer row of `kind` (llama.cpp, auto-round): quantkit's best file of that type whose tensors
    take no more bytes than the peer's (metadata aside), and whether it is at or below the peer: by the mean KL
    divergence from F16 (token by token on the same windows, so it ranks files that perplexity cannot tell apart),
    by perplexity where a file has none."""
    def score(r: Row) -> float:
        return r.kld if r.kld is not None else r.ppl

    def shown(r: Row) -> str:
        return f"KLD {r.kld:.6f}, PPL {r.ppl:.3f}" if r.kld is not None else f"PPL {r.ppl:.3f}"

    mine = [r for r in rows if r.model == model and r.kind == kind and r.tool == "quantkit" and r.ppl]
    lines = []
    for peer in (r for r in rows if r.model == model and r.kind == kind and r.tool != "quantkit" and r.ppl):
        fits = [r for r in mine if r.tensor_bytes <= peer.tensor_bytes and (r.kld is None) == (peer.kld is None)]
        if not fits:
            smallest = min(mine, key=lambda r: r.tensor_bytes, default=None)
            least = f" (smallest: {smallest.row}, {mib(smallest)})" if smallest else ""
            lines.append(f"{model} {kind} vs {peer.tool} {peer.row} ({shown(peer)}, {mib(peer)}): NOT MET, no "
                         f"quantkit file this small{least}")
            continue
        best = min(fits, key=score)
        verdict = "met" if score(best) <= score(peer) else "NOT MET"
        lines.append(f"{model} {kind} vs {peer.tool} {peer.row} ({shown(peer)}, {mib(peer)}): {verdict}, "
                     f"quantkit {best.row} ({shown(best)}, {mib(best)}, {100 * (score(best) / score(peer) - 1):+.1f}%)")
    return lines


def rotation_target(rows: list[Row]) -> list[str]:
    """Every rotated quantkit Q4_K_M row of the outlier model against the 1% target over its F16 file."""
    f16 = {r.model: r for r in rows if r.row == "F16"}
    lines = []
    for r in rows:
        if r.model == "outlier" and r.tool == "quantkit" and r.kind == "Q4_K_M" and "+rot" in r.row:
            change = rise(r, f16)
            verdict = "n/a" if change is None else "met" if change <= ROTATION_TARGET else "NOT MET"
            lines.append(f"outlier Q4_K_M rotated ({r.row}) within {100 * ROTATION_TARGET:g}% of F16: {verdict} "
                         f"({'n/a' if change is None else f'{100 * change:+.2f}%'})")
    return lines


def targets(rows: list[Row], kinds: list[str]) -> str:
    models = list(dict.fromkeys(r.model for r in rows))
    lines = [line for m in models for k in map(str.upper, kinds) for line in type_target(m, k, rows)]
    return "\n".join(f"- {line}" for line in lines + rotation_target(rows))


def twins(rows: list[Row]) -> list[str]:
    """Each quantkit round-to-nearest row of RTN_TWINS against llama-quantize's file of its type without an imatrix,
    read back with gguf's reader: how many of the decoder's matrices (2-D blk.* tensors) hold the same type and the
    same bytes, and whether the token embedding and output do."""
    from gguf import GGUFReader

    lines = []
    for mine in (r for r in rows if r.tool == "quantkit" and r.row in RTN_TWINS and not r.error):
        peer = next((r for r in rows if r.model == mine.model and r.tool == "llama.cpp" and r.row == RTN_TWINS[mine.row]
                     and not r.error), None)
        if peer is None:
            continue
        a = {t.name: t for t in GGUFReader(mine.path).tensors}
        b = {t.name: t for t in GGUFReader(peer.path).tensors}
        matrices = [n for n, t in a.items() if n.startswith("blk.") and len(t.shape) == 2]
        same = [n for n in matrices if n in b and a[n].tensor_type == b[n].tensor_type
                and a[n].data.tobytes() == b[n].data.tobytes()]
        differ = [n for n in matrices if n not in same]
        worst = ""
        if differ:
            share = {n: differing_share(a[n], b[n]) for n in differ}
            name = max(share, key=share.get)
            worst = f"; differing: {', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''} (most: {name}, " \
                    f"{100 * share[name]:.3f}% of its bytes)"
        outer = []
        for n in ("token_embd.weight", "output.weight"):
            if n in a and n in b:
                kinds = f"{a[n].tensor_type.name}" + ("" if a[n].tensor_type == b[n].tensor_type
                                                      else f" vs {b[n].tensor_type.name}")
                same_bytes = a[n].tensor_type == b[n].tensor_type and a[n].data.tobytes() == b[n].data.tobytes()
                outer.append(f"{n.removesuffix('.weight')} {kinds} {'same bytes' if same_bytes else 'differ'}")
        rest = [n for n in a if n not in matrices and n not in ("token_embd.weight", "output.weight")]
        rest_same = [n for n in rest if n in b and a[n].data.tobytes() == b[n].data.tobytes()]
        rounded = [n for n in rest if n not in rest_same and n in b and fp16_of(a[n], b[n])]
        others = f"; other tensors (norms): {len(rest_same)} of {len(rest)} same bytes"
        if rounded:
            others += f", {len(rounded)} hold llama.cpp's F32 values rounded to fp16 (quantkit's --dtype float16)"
        lines.append(f"{mine.model} quantkit {mine.row} vs llama.cpp {peer.row}: {len(same)} of {len(matrices)} "
                     f"decoder matrices bit-identical{worst}; {', '.join(outer)}{others}")
    return lines


def fp16_of(a, b) -> bool:
    """Whether F32 tensor `a` holds F32 tensor `b`'s values rounded to float16."""
    import numpy as np

    if a.tensor_type.name != "F32" or b.tensor_type.name != "F32":
        return False
    x, y = np.asarray(a.data), np.asarray(b.data)
    return x.shape == y.shape and bool(np.array_equal(x, y.astype(np.float16).astype(np.float32)))


def differing_share(a, b) -> float:
    """The share of the bytes two tensors of one shape hold that differ (1.0 where their types or sizes differ)."""
    import numpy as np

    x, y = np.asarray(a.data).view(np.uint8).ravel(), np.asarray(b.data).view(np.uint8).ravel()
    return float(np.mean(x != y)) if a.tensor_type == b.tensor_type and x.size == y.size else 1.0


def bench_table(rows: list[Row]) -> str:
    header = ["model", "type", "tool", "row", "file MiB", "embd / output", "decode tokens/s (tg64)"]
    body = [[r.model, r.kind, r.tool, r.row, fmt(r.size / harness.MIB, ".2f"), r.outer_types,
             f"{r.decode_tps:.1f} ± {r.decode_tps_std:.1f}" if r.decode_tps else "FAILED"] for r in rows]
    return harness.markdown_table(header, body, "llllrlr")


def facts(models: dict[str, Path], bin_dir: Path, args: argparse.Namespace) -> dict:
    return {
        "date": date.today().isoformat(), **harness.host_facts(), **harness.versions("torch", "transformers", "gguf"),
        "llama_cpp": llama_cpp_version(bin_dir), "threads": args.threads, "quantkit_commit": bench_rotations.git_head(),
        "models": {m: {"path": str(p), "parameters": harness.parameter_count(p), "training": bench.training_facts(p)}
                   for m, p in models.items()},
        "calibration": f"quantkit: {args.num_samples} x {args.seq_len} tokens of {args.calib_data} (seed 0); "
                       f"llama-imatrix: the first {args.num_samples} chunks of {args.seq_len} tokens of the same file",
        "eval": f"llama-perplexity -c {args.ctx} --chunks {args.chunks} on {args.eval_data}",
        "auto_round": autoround_version(args) if args.autoround else None,
    }


def autoround_version(args: argparse.Namespace) -> str:
    """auto-round's and its torch's versions, as `--autoround-python` imports them."""
    code = "import auto_round, torch; print(auto_round.__version__, 'torch', torch.__version__)"
    proc = subprocess.run([str(args.autoround_python), "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() or f"unknown ({one_line(proc.stderr)})"


# ---------------------------------------------------------------- export time of a 0.84B model

LLAMA_084B = {"hidden_size": 1536, "intermediate_size": 4608, "num_attention_heads": 24, "num_key_value_heads": 24,
              "num_hidden_layers": 24, "vocab_size": 32000, "max_position_embeddings": 4096, "rope_scaling": None,
              "rope_theta": 10000.0}  # over build_large_checkpoint's Llama-3.1-8B config: 0.834B parameters


def large_model(workdir: Path, text: Path, threads: int) -> Path:
    """The 0.84B Llama of random bf16 weights, built once in `workdir` by build_large_checkpoint.py's writer, in a
    child process (a measured command forked from this one would count this process's pages in its peak RSS)."""
    dst = workdir / "llama-0.84b-random"
    if not (dst / "config.json").is_file():
        harness.in_child(_build_large, dst, text, threads, what=f"building {dst}")
    return dst


def _build_large(dst: Path, text: Path, threads: int) -> None:
    import build_large_checkpoint as large

    config = {**large.LLAMA_3_1_8B, **LLAMA_084B}
    tmp = dst.with_name(dst.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    print(f"building {dst} ...", file=sys.stderr)
    large.write_weights(tmp, config, threads, int(5e9))
    large.write_tokenizer_and_configs(tmp, config, text, 8192)  # config.json last: it marks a finished build
    tmp.rename(dst)


def timed(tool: str, kind: str, step: str, cmd: list[str], out: Path, threads: int) -> dict:
    """One measured process of the export-time table (wall and CPU time, peak RSS, the file it wrote, the load
    average over the minute before it ended)."""
    out.unlink(missing_ok=True)
    run = harness.measure(cmd, harness.thread_env(threads))
    load = os.getloadavg()[0]
    print(f"export time: {tool} {kind} {step}: {run.seconds:.1f} s, {run.cpu_seconds:.1f} CPU s, "
          f"{run.peak_rss_mib:.0f} MiB, load {load:.1f}"
          + (f", FAILED: {one_line(run.stderr_tail)}" if run.returncode else ""), file=sys.stderr)
    return {"tool": tool, "type": kind, "step": step, "seconds": run.seconds, "cpu_seconds": run.cpu_seconds,
            "peak_rss_mib": run.peak_rss_mib, "size": out.stat().st_size if out.is_file() else None, "load": load,
            "error": one_line(run.stderr_tail) if run.returncode else ""}


# the round-to-nearest rows of the export-time table: llama-quantize's type, quantkit's recipe
EXPORT_ROWS = {"Q4_0": "gguf-q4-0", "Q4_K_M": "gguf-q4-k-m+rtn", "IQ4_XS": "gguf-iq4-xs+rtn"}


def export_times(bin_dir: Path, runner: Path, args: argparse.Namespace) -> list[dict]:
    """quantkit finalize (round to nearest: EXPORT_ROWS, `--export-types`) against llama.cpp's convert (F16) +
    llama-quantize of the same types, on the 0.84B model or `--export-model`; every file written again (nothing
    reused), the F16 file removed at the end."""
    src = args.export_model or large_model(args.workdir, args.train_text, args.threads)
    folder = args.workdir / "export-time"
    folder.mkdir(exist_ok=True)
    t = args.threads
    f16 = folder / "llama-f16.gguf"
    steps = [timed("llama.cpp", "F16", "convert_hf_to_gguf.py --outtype f16", [
        sys.executable, str(runner), str(src), "--outtype", "f16", "--outfile", str(f16)], f16, t)]
    for kind in args.export_types:
        out = folder / f"llama-{kind}.gguf"
        outer = ["--token-embedding-type", "f16", "--output-tensor-type", "f16"] if kind in UNQUANTIZED_OUTER else []
        cmd = [str(bin_dir / "llama-quantize"), *outer, str(f16), str(out), kind, str(t)]
        steps.append(timed("llama.cpp", kind, "llama-quantize", cmd, out, t))
        out.unlink(missing_ok=True)
    f16.unlink(missing_ok=True)
    for kind in args.export_types:
        out = folder / f"quantkit-{kind}.gguf"
        spec = EXPORT_ROWS[kind]
        cmd = harness.finalize_command(src, out, recipe_for(spec, folder), t, "--format", "gguf", "--dtype", "float16")
        steps.append(timed("quantkit", kind, f"finalize -q {spec}", cmd, out, t))
        out.unlink(missing_ok=True)
    return steps


def export_table(steps: list[dict]) -> str:
    """The measured steps, and per llama.cpp type its total (convert + quantize: wall and CPU times added, peak RSS
    the larger)."""
    convert = next(s for s in steps if s["type"] == "F16")
    rows = []
    for s in steps:
        rows.append([s["tool"], s["type"], s["step"], f"{s['seconds']:.1f}", f"{s.get('cpu_seconds', 0):.1f}",
                     f"{s['peak_rss_mib']:.0f}", fmt(s["size"] and s["size"] / harness.MIB, ".1f"),
                     f"{s.get('load', 0):.1f}", s["error"]])
        if s["tool"] == "llama.cpp" and s["type"] != "F16":
            rows.append([s["tool"], s["type"], "**total: convert + quantize**", f"{convert['seconds'] + s['seconds']:.1f}",
                         f"{convert.get('cpu_seconds', 0) + s.get('cpu_seconds', 0):.1f}",
                         f"{max(convert['peak_rss_mib'], s['peak_rss_mib']):.0f}",
                         fmt(s["size"] and s["size"] / harness.MIB, ".1f"), "", ""])
    return harness.markdown_table(["tool", "type", "step", "wall s", "CPU s", "peak RSS MiB", "file MiB", "load", "error"],
                                  rows, "lllrrrrrl")


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_model_arguments(p)  # --workdir, --model, and the trained model's --hidden, --train-*
    p.add_argument("--intermediate", type=int, help="the trained model's MLP width (default 2.75x hidden; a multiple "
                   "of 256 keeps every matrix whole K super-blocks)")
    p.add_argument("--models", nargs="+", choices=["plain", "outlier"], default=["plain", "outlier"])
    p.add_argument("--outlier-channels", type=int, default=4, help="outlier channels per norm (make_outlier_model.py)")
    p.add_argument("--outlier-factor", type=float, default=64.0, help="their scale (a power of two is exact)")
    p.add_argument("--quantkit", nargs="*", default=QUANTKIT_ROWS, metavar="ROW",
                   help="quantkit's rows: recipe names, with :gN (groups of N), +rot (R1+R2 rotations), +rtn (no "
                        f"calibration), +gptq (GPTQ, calibrated) (default: {' '.join(QUANTKIT_ROWS)})")
    p.add_argument("--llama-types", nargs="+", default=LLAMA_TYPES, metavar="TYPE",
                   help=f"llama-quantize's types, each without and with an imatrix (default: {' '.join(LLAMA_TYPES)})")
    p.add_argument("--autoround", nargs="*", default=AUTOROUND_ROWS, metavar="ROW",
                   help="auto-round's rows: its GGUF scheme, with :iN for N tuning steps a block (default: "
                        f"{' '.join(AUTOROUND_ROWS)}; none: no auto-round rows)")
    p.add_argument("--autoround-python", type=Path, default=AUTOROUND_PYTHON, help="the interpreter of auto-round's "
                   f"venv (default: {AUTOROUND_PYTHON})")
    p.add_argument("--bench-types", nargs="*", default=["Q4_0", "Q4_K_M"], metavar="TYPE",
                   help="types whose files llama-bench times (decode tokens/s), on the first model")
    p.add_argument("--llama-cpp-bin", type=Path, help="folder with llama-quantize, llama-imatrix, llama-perplexity, "
                   "llama-bench (default: what scripts/build_llama_cpp.sh prints)")
    p.add_argument("--calib-data", type=Path, default=WIKITEXT / "valid.txt")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-data", type=Path, default=WIKITEXT / "test.txt")
    p.add_argument("--ctx", type=int, default=512, help="llama-perplexity -c")
    p.add_argument("--chunks", type=int, default=40, help="llama-perplexity --chunks")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-repack", action="store_true", help="llama-perplexity --no-repack, llama-bench --repack 0: "
                   "no repacked weights, no AMX kernels (on a CPU with AMX under a hypervisor that does not give its "
                   "tiles to the process, the AMX kernels of Q4_0, Q4_1, Q8_0, Q4_K-Q6_K and IQ4_XS segfault)")
    p.add_argument("--reuse", action="store_true", help="keep the files (and their recorded times and perplexities) "
                   "an earlier run made in --workdir, and make and measure only the missing ones")
    p.add_argument("--export-time", action="store_true", help="instead of the table: the time and peak RSS to write "
                   "a 0.84B model's GGUF files, quantkit against llama.cpp's convert + quantize")
    p.add_argument("--export-model", type=Path, help="--export-time's model (default: the 0.84B Llama), e.g. "
                   "scripts/build_large_checkpoint.py --shape llama-3.1-8b --layers 4")
    p.add_argument("--export-types", nargs="+", default=list(EXPORT_ROWS), choices=list(EXPORT_ROWS),
                   help="--export-time's types")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def make_rows(models: dict[str, Path], bin_dir: Path, runner: Path, args: argparse.Namespace) -> list[Row]:
    """Every model's files: llama.cpp's F16 and quantized ones, quantkit's, auto-round's."""
    rows = []
    for model, path in models.items():
        folder = args.workdir / "gguf" / (path.parent.name if path.name == "final" else path.name)
        folder.mkdir(parents=True, exist_ok=True)
        f16 = convert_f16(model, path, folder / "f16.gguf", runner, args.threads)
        rows += [f16, *llama_rows(model, bin_dir, f16.path, args)]
        rows += [quantkit_row(model, path, spec, folder, args) for spec in args.quantkit]
        rows += autoround_rows(model, path, folder, args)
    return rows


def measure_rows(rows: list[Row], models: dict[str, Path], bin_dir: Path, args: argparse.Namespace) -> None:
    bases = {r.model: divergence_base(bin_dir, r, args) for r in rows if r.row == "F16" and not r.error}
    for row in rows:
        if not row.error:
            sizes(row, harness.parameter_count(models[row.model]))
            perplexity(bin_dir, row, args)
            if row.row != "F16" and bases.get(row.model):
                divergence(bin_dir, row, bases[row.model], args)
            print(f"{row.model} {row.tool} {row.row}: ppl {fmt(row.ppl, '.3f')} kld {fmt(row.kld, '.6f')} {row.error}",
                  file=sys.stderr)
    for row in bench_rows(rows, args):
        decode_speed(bin_dir, row, args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    bin_dir = llama_cpp_bin(args)
    runner = converter(bin_dir)
    if args.export_time:
        steps = export_times(bin_dir, runner, args)
        print(f"\n{date.today().isoformat()}, {harness.host_facts()['platform']}, {args.threads} threads; "
              f"llama.cpp {llama_cpp_version(bin_dir)}; quantkit {bench_rotations.git_head()}; "
              f"{args.export_model or 'the 0.84B Llama of random bf16 weights'} "
              f"({harness.parameter_count(args.export_model or large_model(args.workdir, args.train_text, args.threads)):,} "
              "parameters)\n")
        print(export_table(steps))
        if args.json:
            args.json.write_text(json.dumps({"quantkit_commit": bench_rotations.git_head(), "export_time": steps},
                                            indent=2) + "\n")
        return
    src = bench.benchmark_model(args)
    models = {"plain": src} if "plain" in args.models else {}
    if "outlier" in args.models:
        models["outlier"] = bench_rotations.outlier_model(src, args.workdir, args)
    rows = make_rows(models, bin_dir, runner, args)
    measure_rows(rows, models, bin_dir, args)
    rows = ordered(rows, args.llama_types)
    known = facts(models, bin_dir, args)
    print(f"\n{known['date']}, {known['platform']}, {known['cpus']} CPUs, {args.threads} threads; "
          f"llama.cpp {known['llama_cpp']}; auto-round {known['auto_round']}; quantkit {known['quantkit_commit']}; "
          f"{known['calibration']}; {known['eval']}\n")
    print(table(rows))
    print(f"\nTargets:\n\n{targets(rows, args.llama_types)}")
    same = twins(rows)
    if same:
        print("\nquantkit's round to nearest against llama-quantize without an imatrix (tensor bytes):\n\n"
              + "\n".join(f"- {line}" for line in same))
    if bench_rows(rows, args):
        print(f"\nllama-bench -p 0 -n 64 -t {args.threads} -r 3 (decode):\n\n{bench_table(bench_rows(rows, args))}")
    if args.json:
        f16 = {r.model: r for r in rows if r.row == "F16"}
        args.json.write_text(json.dumps({"machine": known, "twins": same, "rows": [
            {**asdict(r), "path": str(r.path), "rise": rise(r, f16)} for r in rows]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
