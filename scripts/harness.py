"""What the benchmarks in scripts/ share: commands, measuring, the benchmark models, llm-compressor, tables.

The benchmarks run as `python scripts/bench_X.py`, so this folder is sys.path[0] and `import harness` finds this
file; it is not a package and is not installed.

* commands: the `quantkit` console script beside this interpreter, `quantkit finalize` command lines, and an
  environment that pins OMP_NUM_THREADS / MKL_NUM_THREADS;
* measuring: one subprocess, its wall time (perf_counter around it) and peak RSS and CPU time (os.wait4);
* models: the benchmark Llamas, built once with `quantkit.models.tiny.build_tiny_llama` and cached in a work dir;
* llm-compressor: the peer tool runs in its own virtualenv (`--llmc-python`), through a runner script written
  to the work dir, on calibration token ids saved by quantkit;
* reporting: medians, "n/a"-aware formatting, markdown tables, the machine and package versions.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from math import prod
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parent.parent
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2"
MIB = 1024 * 1024


# ---------------------------------------------------------------- commands


def quantkit_executable() -> str:
    """The `quantkit` console script of this interpreter's environment (else the one on PATH); exits when there is none."""
    beside = Path(sys.executable).parent / "quantkit"
    found = str(beside) if beside.is_file() else shutil.which("quantkit")
    if not found:
        sys.exit("the `quantkit` console script is not installed (pip install -e .)")
    return found


def quantkit_command(*args: object) -> list[str]:
    """`quantkit ARGS...`, every argument as a string."""
    return [quantkit_executable(), *map(str, args)]


def finalize_command(src: Path, dst: Path, recipe: str, threads: int, *options: object) -> list[str]:
    """`quantkit finalize SRC DST -q RECIPE [OPTIONS] --threads T --quiet --overwrite`."""
    common = ("--threads", threads, "--quiet", "--overwrite")
    return quantkit_command("finalize", src, dst, "-q", recipe, *options, *common)


def calibration_options(data: Path, num_samples: int, seq_len: int) -> list[str]:
    """The `quantkit finalize` options that choose the calibration tokens."""
    return ["--calib-data", str(data), "--num-samples", str(num_samples), "--seq-len", str(seq_len)]


def thread_env(threads: int, mkl: bool = True) -> dict[str, str]:
    """This environment with OMP_NUM_THREADS (and, unless `mkl` is false, MKL_NUM_THREADS) set to `threads`."""
    pinned = {"OMP_NUM_THREADS": str(threads)} | ({"MKL_NUM_THREADS": str(threads)} if mkl else {})
    return {**os.environ, **pinned}


# ---------------------------------------------------------------- measuring


@dataclass
class Run:
    """One measured subprocess."""

    seconds: float
    peak_rss_kib: int
    cpu_seconds: float
    returncode: int
    stderr_tail: str = ""

    @property
    def peak_rss_mib(self) -> float:
        return self.peak_rss_kib / 1024


def run_timed(cmd: list[str], env: dict[str, str], stdout: IO | int, stderr: IO | int) -> Run:
    """Run `cmd` to its end: wall time by perf_counter around it; peak RSS and CPU time from os.wait4's rusage."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here; keep Popen from waiting again
    return Run(seconds, usage.ru_maxrss, usage.ru_utime + usage.ru_stime, proc.returncode)


def measure(cmd: list[str], env: dict[str, str], tail: int = 2000) -> Run:
    """One measured subprocess; stdout dropped, the last `tail` characters of stderr kept when it fails."""
    with tempfile.TemporaryFile() as err:
        run = run_timed(cmd, env, subprocess.DEVNULL, err)
        err.seek(0)
        run.stderr_tail = err.read().decode(errors="replace")[-tail:] if run.returncode else ""
    return run


def measure_logged(cmd: list[str], env: dict[str, str], log: Path, tail: int = 3000) -> tuple[Run, str]:
    """One measured subprocess and what it printed; stderr written to `log` (its tail kept when it fails)."""
    with tempfile.TemporaryFile() as out, open(log, "wb") as err:
        run = run_timed(cmd, env, out, err)
        out.seek(0)
        printed = out.read().decode(errors="replace")
    if run.returncode:
        run.stderr_tail = log.read_text(errors="replace")[-tail:]
    return run, printed


# ---------------------------------------------------------------- the benchmark models


def in_child(target, *args, what: str) -> None:
    """`target(*args)` in a forked child process (its memory gone when it ends, so that commands measured later from
    this process do not count its pages); exit naming `what` if it fails."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=target, args=args)
    child.start()
    child.join()
    if child.exitcode:
        sys.exit(f"{what} failed (exit {child.exitcode})")


def llama_shape(hidden: int = 1024, kv_heads: int | None = None) -> dict[str, int]:
    """4 layers, MLP 2.75x hidden, head_dim 64, vocab 8192; hidden 1024 is the ~70M-parameter shape."""
    heads = hidden // 64
    return dict(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=4,
                num_attention_heads=heads, num_key_value_heads=heads if kv_heads is None else kv_heads, vocab_size=8192,
                max_position_embeddings=2048)


def tokenizer_text(path: Path, generate_if_missing: bool = False) -> str:
    """The tokenizer's training text; with `generate_if_missing`, generated text when the file is missing."""
    if path.is_file() or not generate_if_missing:
        return path.read_text(encoding="utf-8")
    print(f"note: {path} not found; training the tokenizer on generated text", file=sys.stderr)
    words = [f"w{i}{chr(97 + i % 26)}" for i in range(4000)]
    return "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(20000))


def build_llama(dst: Path, text: Path, dtype: str, generate_if_missing: bool = False, max_shard_size: str | None = None,
                model_type: str = "llama", **shape: int) -> Path:
    """A Llama (or another `model_type` of transformers' configs) of random weights (seed 0) with a tokenizer trained
    on `text`, built once at `dst` (into a temp dir, then renamed); see `tokenizer_text` for `generate_if_missing`.
    Built in a child process: a measured command forked from this one would otherwise count this process's memory in
    its peak RSS (Linux's ru_maxrss includes the pages held at fork; the 1.7 GB model of bench_streaming.py made the
    tiny model's finalize read 3696 MiB)."""
    if (dst / "config.json").is_file() and list(dst.glob("*.safetensors")):
        return dst
    import multiprocessing

    from quantkit.models.tiny import build_tiny_model

    tmp = dst.with_name(f"{dst.name}.building")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"building {dst} ...", file=sys.stderr)
    child = multiprocessing.get_context("fork").Process(
        target=build_tiny_model, args=(tmp, tokenizer_text(text, generate_if_missing), model_type),
        kwargs=dict(seed=0, dtype=dtype, max_shard_size=max_shard_size, **shape))
    child.start()
    child.join()
    if child.exitcode:
        sys.exit(f"building {dst} failed (exit {child.exitcode})")
    tmp.rename(dst)
    return dst


def llama_70m(workdir: Path, text: Path, dtype: str = "bfloat16", kv_heads: int = 16) -> Path:
    """The ~70M-parameter Llama (hidden 1024) of bench_finalize.py and bench_distributed.py, cached in `workdir`."""
    dst = workdir / f"llama70m-{dtype}-kv{kv_heads}"
    return build_llama(dst, text, dtype, generate_if_missing=True, **llama_shape(1024, kv_heads))


def safetensors_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def parameter_count(folder: Path) -> int:
    """Parameters stored in the *.safetensors files, read from their JSON headers (no tensors loaded)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")
    return total


# ---------------------------------------------------------------- llm-compressor, in its own virtualenv

LLMC_RUNNER = '''\
"""llm-compressor side of scripts/bench_calibration.py (written there): one oneshot() run; prints one JSON line."""
import argparse, json, os, time

start = time.perf_counter()
p = argparse.ArgumentParser()
for name in ("src", "dst", "calib", "recipe", "actorder"):
    p.add_argument(name)
p.add_argument("threads", type=int)
p.add_argument("iters", type=int, nargs="?", default=200)  # AutoRound's steps per layer
p.add_argument("seed", type=int, nargs="?", default=42)  # AutoRound's seed (auto-round's default: 42)
args = p.parse_args()

import torch
torch.set_num_threads(args.threads)
import torch.distributed as dist
rank = int(os.environ.get("RANK", "0"))
if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: llm-compressor's distributed oneshot, gloo on CPU
    # (compressed_tensors.offload.init_dist needs an accelerator; this is what it does, with gloo)
    dist.init_process_group(backend="gloo", init_method="env://")
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.autoround import AutoRoundModifier
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

if args.seed != 42:  # AutoRoundModifier passes no seed to auto-round's AutoRound (its batches' draws): give it one
    import functools
    import llmcompressor.modifiers.autoround.base as autoround_base
    autoround_base.AutoRound = functools.partial(autoround_base.AutoRound, seed=args.seed)
if not torch.accelerator.is_available():
    # llm-compressor 0.14's AWQ pins its activation cache for host-to-device copies; pinning needs an accelerator
    from llmcompressor.pipelines.cache import IntermediatesCache
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None

common = dict(targets="Linear", ignore=["lm_head"])
gptq = dict(common, **({} if args.actorder == "default" else {"actorder": None}))
# quantkit's int2 grid (int2-weight-only, autoround-w2a16): symmetric int2 in groups of 32 (W2A16's groups are 128)
w2g32 = dict(ignore=["lm_head"], config_groups={"group_0": {"targets": ["Linear"], "weights": {
    "num_bits": 2, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}})
recipe = {
    "rtn-w4a16": lambda: [QuantizationModifier(scheme="W4A16", **common)],
    "rtn-w2a16": lambda: [QuantizationModifier(**w2g32)],
    "gptq-w4a16": lambda: [GPTQModifier(scheme="W4A16", **gptq)],
    "smoothquant-gptq-w8a8": lambda: [SmoothQuantModifier(smoothing_strength=0.8), GPTQModifier(scheme="W8A8", **gptq)],
    "awq-w4a16": lambda: [AWQModifier(), QuantizationModifier(scheme="W4A16", **common)],  # AWQ only rescales
    # auto-round's defaults (batch 8, lr 1 / iters); torch.compile off: on CPU it compiles for minutes, or not at all
    "autoround-w4a16": lambda: [AutoRoundModifier(scheme="W4A16", iters=args.iters, batch_size=8,
                                                  enable_torch_compile=False, **common)],
    "autoround-w2a16": lambda: [AutoRoundModifier(iters=args.iters, batch_size=8, enable_torch_compile=False, **w2g32)],
    # today's schemes (scripts/bench_schemes.py): compressed-tensors' presets
    "rtn-nvfp4a16": lambda: [QuantizationModifier(scheme="NVFP4A16", **common)],
    "rtn-nvfp4": lambda: [QuantizationModifier(scheme="NVFP4", **common)],
    "gptq-nvfp4a16": lambda: [GPTQModifier(scheme="NVFP4A16", **gptq)],
    "awq-nvfp4a16": lambda: [AWQModifier(), QuantizationModifier(scheme="NVFP4A16", **common)],
    "rtn-mxfp4a16": lambda: [QuantizationModifier(scheme="MXFP4A16", **common)],
    "rtn-mxfp4": lambda: [QuantizationModifier(scheme="MXFP4", **common)],
    "rtn-mxfp8": lambda: [QuantizationModifier(scheme="MXFP8", **common)],
    "rtn-fp8-block": lambda: [QuantizationModifier(scheme="FP8_BLOCK", **common)],
    "rtn-w4a16-asym": lambda: [QuantizationModifier(scheme="W4A16_ASYM", **common)],
    "gptq-w4a16-asym": lambda: [GPTQModifier(scheme="W4A16_ASYM", **gptq)],
    "awq-w4a16-asym": lambda: [AWQModifier(), QuantizationModifier(scheme="W4A16_ASYM", **common)],
    "rtn-w4afp8": lambda: [QuantizationModifier(scheme="W4AFP8", **common)],
    # static FP8 KV cache scales per tensor (quantkit's `kv_cache: fp8`)
    "rtn-fp8-block-kv-fp8": lambda: [QuantizationModifier(scheme="FP8_BLOCK", kv_cache_scheme=dict(
        num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True), **common)],
}[args.recipe]()
imported = time.perf_counter()

ids = load_file(args.calib)["input_ids"]
dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
model = AutoModelForCausalLM.from_pretrained(args.src, dtype="auto")
tokenizer = AutoTokenizer.from_pretrained(args.src)
loaded = time.perf_counter()
oneshot(model=model, dataset=dataset, recipe=recipe, max_seq_length=ids.shape[1], num_calibration_samples=ids.shape[0],
        shuffle_calibration_samples=False)
calibrated = time.perf_counter()
# every rank calls save_pretrained: llm-compressor compresses module-parallel there, and writes on rank 0 only
model.save_pretrained(args.dst, save_compressed=True)
if rank == 0:
    tokenizer.save_pretrained(args.dst)
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
saved = time.perf_counter()
if rank != 0:
    raise SystemExit(0)
print(json.dumps({"import_s": imported - start, "load_s": loaded - imported, "oneshot_s": calibrated - loaded,
                  "save_s": saved - calibrated, "threads": torch.get_num_threads()}))
'''


def write_llmc_runner(folder: Path) -> Path:
    """LLMC_RUNNER written to `folder`/llmc_runner.py, for the llm-compressor venv's python to run."""
    runner = folder / "llmc_runner.py"
    runner.write_text(LLMC_RUNNER)
    return runner


def llmc_command(python: Path, runner: Path, src: Path, dst: Path, ids: Path, recipe: str, actorder: str,
                 threads: int, ranks: int = 1, iters: int = 200, seed: int = 42) -> list[str]:
    """The runner under `python`; with `ranks` > 1 under `torch.distributed.run` (llm-compressor's distributed
    oneshot). `recipe` is one of the runner's (rtn-w4a16, rtn-w2a16, gptq-w4a16, smoothquant-gptq-w8a8, awq-w4a16,
    autoround-w4a16, autoround-w2a16: `iters` steps a layer, auto-round seeded with `seed`)."""
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1 else []
    return [str(python), *launch, str(runner), str(src), str(dst), str(ids), recipe, actorder, str(threads), str(iters),
            str(seed)]


def last_json_line(text: str) -> dict | None:
    """The last line of `text` that starts with "{", parsed (what the runner prints last)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


def llmc_versions(python: Path | None) -> str | None:
    """llm-compressor's, torch's, transformers' and compressed-tensors' versions in the venv of `python`."""
    if not python:
        return None
    code = ("from importlib.metadata import version as v; "
            "print(', '.join(f'{p} {v(p)}' for p in ('llmcompressor', 'torch', 'transformers', 'compressed-tensors')))")
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else f"unknown ({proc.stderr.strip()[-200:]})"


def write_calibration(src: Path, data: Path, num_samples: int, seq_len: int, workdir: Path) -> Path:
    """quantkit's calibration blocks for these options, saved for the llm-compressor runner."""
    import torch
    from safetensors.torch import save_file

    from quantkit.finalization.finalize import CalibrationOptions, calibration_samples
    from quantkit.quant.registry import resolve

    options = CalibrationOptions(data=str(data), num_samples=num_samples, seq_len=seq_len)
    blocks = calibration_samples(src, resolve("gptq-w4a16"), options)
    # the blocks depend on the options only, not on the recipe: smoothquant-w8a8 calibrates on the same ones
    assert torch.equal(blocks, calibration_samples(src, resolve("smoothquant-w8a8"), options))
    path = workdir / f"calib-{num_samples}x{seq_len}.safetensors"
    save_file({"input_ids": blocks.contiguous()}, str(path))
    return path


# ---------------------------------------------------------------- reporting


def median(values: list[float]) -> float | None:
    """The median, or None for no values."""
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str) -> str:
    """`value` formatted with `spec`, or "n/a" for None."""
    return "n/a" if value is None else format(value, spec)


def markdown_table(header: list[str], rows: list[list[str]], align: str = "") -> str:
    """A markdown table; `align` has one letter a column, l or r (default: all l). An empty cell is "| |"."""
    separator = "|" + "".join("---:|" if a == "r" else "---|" for a in align or "l" * len(header))
    return "\n".join([_markdown_row(header), separator, *map(_markdown_row, rows)])


def _markdown_row(cells: list[str]) -> str:
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


def host_facts() -> dict:
    """Python's version, the platform and the CPU count."""
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}


def versions(*packages: str) -> dict[str, str]:
    """{package: its installed version}, in the order given."""
    return {package: version(package) for package in packages}


def log_chart(lines: dict[str, list[tuple[float, float]]], path: Path, xlabel: str, ylabel: str,
              dashed: set[str] = frozenset(), labels: dict[str, list[tuple[float, float, str]]] | None = None) -> None:
    """A self-contained SVG: one polyline per entry of `lines` (its points sorted by x), y on a log scale, a legend;
    lines named in `dashed` dashed, and `labels` text beside given points (a type's name)."""
    import math

    xs = [x for line in lines.values() for x, _ in line]
    ys = [math.log10(y) for line in lines.values() for _, y in line if y > 0]
    if not xs or not ys:
        return
    w, h, pad = 760, 460, 60
    x0, x1, y0, y1 = min(xs) - 0.1, max(xs) + 0.1, math.floor(min(ys)), math.ceil(max(ys))
    def px(x): return pad + (x - x0) / (x1 - x0) * (w - 2 * pad)
    def py(y): return h - pad - (math.log10(y) - y0) / (y1 - y0) * (h - 2 * pad)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf",
              "#bcbd22"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
             f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">{xlabel}</text>',
             f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" text-anchor="middle">{ylabel}</text>']
    for e in range(y0, y1 + 1):
        parts.append(f'<text x="{pad - 5}" y="{py(10 ** e) + 4}" text-anchor="end">1e{e}</text>')
    for b in range(math.ceil(x0), math.floor(x1) + 1):
        parts.append(f'<text x="{px(b)}" y="{h - pad + 16}" text-anchor="middle">{b}</text>')
    for i, (name, line) in enumerate(sorted(lines.items())):
        color, line = colors[i % len(colors)], sorted(p for p in line if p[1] > 0)
        dash = ' stroke-dasharray="5,3"' if name in dashed else ""
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in line)
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>' for x, y in line]
        parts += [f'<text x="{px(x) + 4:.1f}" y="{py(y) - 5:.1f}" font-size="9" fill="{color}">{text}</text>'
                  for x, y, text in (labels or {}).get(name, [])]
        parts.append(f'<text x="{w - pad - 230}" y="{pad + 16 * i}" fill="{color}">{name}</text>')
    path.write_text("\n".join(parts + ["</svg>"]) + "\n")
