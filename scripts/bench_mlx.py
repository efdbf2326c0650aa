"""Benchmark quantkit's MLX files against mlx-lm's own quantizers, every file judged in mlx against the float model.

    python scripts/bench_mlx.py --reuse --json mlx.json        # mlx-lm in its own venv (`--mlx-python`)

The trained benchmark model of scripts/bench_calibration.py (`--workdir`, shared with bench_gguf.py; `--model` for
another), float32 as trained, and its outlier copy (scripts/make_outlier_model.py) with `--models plain outlier`.
Files are made under `--workdir`/mlx/MODEL; `--reuse` keeps every file an earlier run made there with its recorded
time and measurement, and makes and measures only the missing ones.

1. quantkit's rows (`--quantkit`): `quantkit finalize SRC DST -q RECIPE --format mlx`, calibrated recipes on
   `--num-samples` x `--seq-len` tokens of `--calib-data`. A row is a shipped recipe name with modifiers, each
   making a user recipe file in the work dir: `:bN` N-bit codes (mlx-gptq-4bit-g64:b3 is GPTQ on MLX's affine 3-bit
   grid), `:gN` groups of N, `:nN` N calibration blocks instead of `--num-samples` (mlx-awq-4bit-g64:n16 beside
   mlx-lm's awq:4:n16; no recipe file), `+rot` fused Hadamard rotations R1 + R2 (`transforms: [{type: hadamard,
   rotations: [R1, R2]}]`). A recipe that is not one of the mlx-* ones gets `format: mlx`, `ignore: []` and
   `on_indivisible: skip`, so it quantizes what the MLX rows quantize (every Linear, lm_head and the token embedding): autoround-w4a16:g64 is
   AutoRound on a symmetric 4-bit grid in groups of 64, which MLX's affine layout holds exactly (code q + 8, bias -8
   x scale); AutoRound does not learn on MLX's own affine grid (a float bias per group).
2. mlx-lm's rows (`--mlx-lm`), run under `--mlx-python` (never imported here): `convert:B` (`mlx_lm.convert -q
   --q-bits B --q-group-size 64`), `awq:B` (`mlx_lm.awq --bits B --group-size 64 --embed-bits B --embed-group-size
   64`: the token embedding and lm_head on the same grid as the rest, not its default 4-bit groups of 32),
   `gptq:B` (`mlx_lm.gptq --bits B --fallback-bits B`, groups of 64: its fallback is the token embedding), `dwq:B`
   (mlx_lm.dwq's `dwq_quantize` through DWQ_RUNNER: its CLI reads a Hugging Face dataset through `datasets`, which
   the venv lacks, so the runner hands it the calibration blocks the other quantizers read, with the CLI's
   optimizer, learning rate and batch size), and `dynamic:LOW/HIGH:BPW` (`mlx_lm.dynamic_quant --low-bits LOW
   --high-bits HIGH --target-bpw BPW`). awq, gptq, dynamic_quant and dwq read `~/.cache/mlx-lm/calibration_v5.txt`
   (downloaded when missing): each runs with HOME set to a folder of the work dir whose calibration_v5.txt holds
   quantkit's calibration blocks, decoded (`--num-samples` x `--seq-len` tokens; mlx-lm re-tokenizes and cuts it
   into blocks of `--seq-len`), so every tool calibrates on the same text, and the samples flags ask for all of it;
3. budgets: for each dynamic_quant file, `quantkit finalize --format mlx --target-bpw B -q mlx-gptq-4bit-g64` at
   that file's bits per weight (its tensor bytes x 8 over the float model's parameters), choosing among quantkit's
   MLX candidates (3, 4, 5, 6, 8 bits); `--quantkit budget:BPW` makes one more at BPW (a uniform file's size);
4. the measuring (MEASURE_RUNNER, under `--mlx-python`): each file loaded by `mlx_lm.utils.load`, on the first
   `--chunks` windows of `--ctx` tokens of `--eval-data` (the whole text tokenized once by the model's tokenizer);
   perplexity by mlx_lm.perplexity's `eval_ppl` (its mean cross-entropy and ± by the delta method), and against the
   float model's next-token distributions on the same tokens (float32 log-softmax of both): the mean KL divergence
   with its ± (standard error), its 99th percentile, and the share of tokens whose most likely next token is the
   float model's.

mlx on this Linux CPU (the `mlx[cpu]` wheel): two things made it slow enough to matter, and both are worked around the
same way for every row. The wheel's BLAS is the reference one (20x slower than OpenBLAS for a float32 GEMM here):
every mlx process runs with `--blas` (OpenBLAS, `apt-get install libopenblas0-pthread`) preloaded. mlx's CPU
quantized-matmul kernel runs about 1 GFLOP/s in float32 (40x slower in float16): every mlx process runs with
DENSE_PATCH, which makes `nn.QuantizedLinear` compute `x @ W.T` from W = codes x scales + biases (the codes
unpacked once per weight by `mx.dequantize`), the same function in float32 and differentiable in the scales and
biases as DWQ needs. The measuring checks it: each file's logits on the first 64 tokens with and without the patch,
the largest difference reported. The models stay float32 (as trained), so every tool writes float32 scales and
biases: 4-bit groups of 64 are 5.0 bits per weight here, 4.5 in a 16-bit model.

Every process runs with OMP_NUM_THREADS / MKL_NUM_THREADS / OPENBLAS_NUM_THREADS = `--threads` and
OMP_WAIT_POLICY=PASSIVE; each maker's wall and CPU time (its process and children, os.wait4) and the machine's
1-minute load before and after it are recorded. A row that fails keeps its one-line error in the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import bench_calibration as bench
import bench_rotations
import harness
from harness import WIKITEXT, fmt

MLX_PYTHON = Path.home() / ".cache" / "quantkit" / "mlx-venv" / "bin" / "python"
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
QUANTKIT_ROWS = ["mlx-4bit-g64", "mlx-4bit-g64+rot", "mlx-gptq-4bit-g64", "mlx-gptq-4bit-g64+rot", "mlx-awq-4bit-g64",
                 "autoround-w4a16:g64", "mlx-3bit-g64", "mlx-3bit-g64+rot", "mlx-gptq-4bit-g64:b3",
                 "mlx-gptq-4bit-g64:b3+rot", "mlx-awq-4bit-g64:b3"]
MLX_LM_ROWS = ["convert:4", "awq:4", "gptq:4", "dwq:4", "convert:3", "awq:3", "gptq:3", "dwq:3", "dynamic:3/4:4.5",
               "dynamic:4/5:5.5"]
GROUP = 64

# ---------------------------------------------------------------- mlx-side scripts, written to the work dir

DENSE_PATCH = '''\
"""nn.QuantizedLinear as a dense product of its dequantized weight (scripts/bench_mlx.py): mlx's CPU quantized
matmul runs about 1 GFLOP/s on x86. W = codes x scales + biases per group, the codes unpacked once per weight array by
mx.dequantize (scales 1, biases 0), computed in float32, so the result is the layer's function and its gradient
reaches the scales and biases (DWQ trains them)."""
import mlx.core as mx
import mlx.nn as nn

_codes = {}
_quantized_call = nn.QuantizedLinear.__call__


def _dense_call(self, x):
    if self.mode != "affine":
        return _quantized_call(self, x)
    weight, bits, group = self["weight"], self.bits, self.group_size
    held = _codes.get(id(weight))
    if held is None or held[0] is not weight:
        rows = weight.shape[0]
        groups = weight.shape[-1] * 32 // bits // group
        ones = mx.ones((rows, groups), mx.float32)
        codes = mx.dequantize(weight, ones, mx.zeros_like(ones), group_size=group, bits=bits)
        held = _codes[id(weight)] = (weight, mx.stop_gradient(codes.reshape(rows, groups, group)))
    codes = held[1]
    scales, biases = self["scales"].astype(mx.float32), self["biases"].astype(mx.float32)
    dense = (codes * scales[..., None] + biases[..., None]).reshape(codes.shape[0], -1)
    y = x.astype(mx.float32) @ dense.T
    if "bias" in self:
        y = y + self["bias"]
    return y.astype(x.dtype)


def enable():
    nn.QuantizedLinear.__call__ = _dense_call


def disable():
    nn.QuantizedLinear.__call__ = _quantized_call
'''

LAUNCHER = '''\
"""Run an mlx-lm module's main() as its console script does, with mlx_dense.py's patch (scripts/bench_mlx.py):
python launch.py MODULE ARGS..."""
import importlib, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_dense

mlx_dense.enable()
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
importlib.import_module(module).main()
'''

DWQ_RUNNER = '''\
"""mlx_lm.dwq's main() without its Hugging Face dataset (scripts/bench_mlx.py): the training blocks are mlx-lm's
calibration blocks (mlx_lm.quant.utils.load_data, ~/.cache/mlx-lm/calibration_v5.txt, as awq and gptq read them),
all of them, and the first VALID of them again for its validation loss; the rest is main()'s: the student is
quantize_model of the teacher, Adam at LR with bias correction, its batch size. The scales and biases it learns are
kept in the model's dtype (main() casts them to dwq_quantize's default, bfloat16: for a float32 model that makes a
smaller file than every other row's, float32 scales, rounded after training).

    python dwq_runner.py SRC DST BITS GROUP SAMPLES SEQ_LEN LR BATCH VALID SEED
"""
import copy, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_dense

mlx_dense.enable()
import mlx.core as mx
import mlx.optimizers as optimizers
import numpy as np
from mlx_lm.quant.dwq import dwq_quantize
from mlx_lm.quant.utils import load_data
from mlx.utils import tree_flatten
from mlx_lm.utils import load, quantize_model, save

src, dst, bits, group, samples, seq_len, lr, batch, valid, seed = sys.argv[1:11]
np.random.seed(int(seed))
mx.random.seed(int(seed))
model, tokenizer, config = load(src, return_config=True, lazy=True)
blocks = load_data(tokenizer, int(samples), int(seq_len)).tolist()
train = [(b, 0) for b in blocks]
print(f"dwq_runner: {len(train)} blocks of {int(seq_len)} tokens", file=sys.stderr)
q_model = copy.deepcopy(model)
_, config = quantize_model(q_model, config, group_size=int(group), bits=int(bits))
opt = optimizers.Adam(learning_rate=float(lr), bias_correction=True)
dtype = next(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
dwq_quantize(q_model, lambda batch, idx, split: model(batch), opt, train, train[: int(valid)], batch_size=int(batch),
             max_seq_length=int(seq_len), seed=int(seed), dtype=dtype)
save(dst, src, q_model, tokenizer, config)
'''

MEASURE_RUNNER = '''\
"""The measuring of scripts/bench_mlx.py, in mlx: python measure_runner.py REF TEXT CTX CHUNKS OUT.json MODEL...

Each model loaded by mlx_lm.utils.load (float32), on the first CHUNKS windows of CTX tokens of TEXT: perplexity by
mlx_lm.perplexity's eval_ppl, and the KL divergence of its next-token distributions from REF's on the same tokens,
with the share of tokens whose top next token is REF's. Quantized layers run as mlx_dense.py's dense product; the
largest logit difference from mlx's own quantized matmul on the first 64 tokens is reported as `dense_check`."""
import json, math, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_dense
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.perplexity import eval_ppl
from mlx_lm.utils import load

ref_dir, text, ctx, chunks, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
mlx_dense.enable()
reference, tokenizer = load(ref_dir)
reference.set_dtype(mx.float32)
ids = tokenizer.encode(Path(text).read_text(encoding="utf-8"))
if len(ids) < chunks * ctx:
    raise SystemExit(f"{text}: {len(ids)} tokens, fewer than {chunks} x {ctx}")
data = mx.array(ids[: chunks * ctx]).reshape(chunks, ctx)


class Recorded:
    """The model, calling `seen` with each batch's logits (eval_ppl calls model(batch[:, :-1]))."""

    def __init__(self, model, seen):
        self.model, self.seen = model, seen

    def __call__(self, x):
        logits = self.model(x)
        self.seen(logits)
        return logits


ref_lp = []


def keep(logits):
    lp = nn.log_softmax(logits.astype(mx.float32), axis=-1)
    mx.eval(lp)
    ref_lp.append(lp)


began = time.perf_counter()
ppl, ppl_se = eval_ppl(Recorded(reference, keep), data)
results = {"reference": {"path": ref_dir, "ppl": ppl, "ppl_se": ppl_se, "tokens": chunks * (ctx - 1),
                         "seconds": time.perf_counter() - began}}
print(f"reference {ppl:.3f}", file=sys.stderr, flush=True)
for path in sys.argv[6:]:
    began = time.perf_counter()
    try:
        model, _ = load(path)
        model.set_dtype(mx.float32)
        probe = data[:1, :64]
        dense = model(probe)
        mlx_dense.disable()
        quantized = model(probe)
        mlx_dense.enable()
        check = mx.abs(dense - quantized).max().item() / max(mx.abs(quantized).max().item(), 1e-30)
        kl, same = [], []

        def compare(logits):
            lq = nn.log_softmax(logits.astype(mx.float32), axis=-1)
            lr = ref_lp[len(kl)]
            k = (mx.exp(lr) * (lr - lq)).sum(axis=-1)
            top = lr.argmax(axis=-1) == lq.argmax(axis=-1)
            mx.eval(k, top)
            kl.append(np.array(k).ravel())
            same.append(np.array(top).ravel())

        p, s = eval_ppl(Recorded(model, compare), data)
        k, t = np.concatenate(kl).astype(np.float64), np.concatenate(same)
        results[path] = {"ppl": p, "ppl_se": s, "kld": float(k.mean()), "kld_se": float(k.std(ddof=1) / math.sqrt(k.size)),
                         "kld_p99": float(np.percentile(k, 99)), "same_top": float(t.mean()), "tokens": int(k.size),
                         "dense_check": check, "seconds": time.perf_counter() - began}
    except Exception as error:  # one file mlx-lm cannot load or run: its row says so
        results[path] = {"error": f"{type(error).__name__}: {error}"[:300]}
    print(path, results[path], file=sys.stderr, flush=True)
    Path(out).write_text(json.dumps(results, indent=1))
Path(out).write_text(json.dumps(results, indent=1))
'''


# ---------------------------------------------------------------- rows


@dataclass
class Row:
    model: str
    tool: str
    row: str
    path: Path
    bits: str = ""  # the size class: "4-bit", "3-bit", "budget", "float"
    seconds: float | None = None
    cpu_seconds: float | None = None
    load: str = ""
    error: str = ""
    file_bytes: int | None = None
    tensor_bytes: int | None = None
    bpw: float | None = None
    layout: str = ""
    ppl: float | None = None
    ppl_se: float | None = None
    kld: float | None = None
    kld_se: float | None = None
    kld_p99: float | None = None
    same_top: float | None = None
    dense_check: float | None = None


def one_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line or "assert" in line.lower()]
    return (errors[-1] if errors else lines[-1] if lines else "failed")[:240]


def slug(spec: str) -> str:
    return spec.replace(":", "-").replace("+", "-").replace("/", "-")


def mlx_env(args: argparse.Namespace, home: Path | None = None) -> dict[str, str]:
    env = {**harness.thread_env(args.threads), "OPENBLAS_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE"}
    if args.blas and Path(args.blas).is_file():
        env["LD_PRELOAD"] = str(args.blas)
    if home is not None:
        env["HOME"] = str(home)
    return env


def made(row: Row, cmd: list[str], env: dict[str, str], args: argparse.Namespace, cwd: Path | None = None) -> None:
    """Run `cmd`, which writes the directory `row.path`, timed; with `--reuse` an earlier run's directory and its
    recorded times are kept (PATH.timing.json beside it)."""
    timing = row.path.with_name(row.path.name + ".timing.json")
    failed = row.path.with_name(row.path.name + ".error.txt")
    if args.reuse and (row.path / "config.json").is_file() and timing.is_file():
        recorded = json.loads(timing.read_text())
        row.seconds, row.cpu_seconds, row.load = recorded["seconds"], recorded["cpu_seconds"], recorded["load"]
        return
    if args.reuse and failed.is_file():
        row.error = failed.read_text().strip()
        return
    timing.unlink(missing_ok=True)
    failed.unlink(missing_ok=True)
    shutil.rmtree(row.path, ignore_errors=True)
    log = row.path.with_name(row.path.name + ".log")
    before = os.getloadavg()[0]
    if cwd is None:
        run, _ = harness.measure_logged(cmd, env, log)
    else:
        with tempfile.TemporaryFile() as out, open(log, "wb") as err:
            previous = os.getcwd()
            os.chdir(cwd)
            try:
                run = harness.run_timed(cmd, env, out, err)
            finally:
                os.chdir(previous)
        run.stderr_tail = log.read_text(errors="replace")[-3000:] if run.returncode else ""
    load = f"{before:.1f}-{os.getloadavg()[0]:.1f}"
    if run.returncode or not (row.path / "config.json").is_file():
        row.error = one_line(run.stderr_tail or log.read_text(errors="replace")) or f"exit {run.returncode}"
        failed.write_text(row.error + "\n")
        return
    row.seconds, row.cpu_seconds, row.load = run.seconds, run.cpu_seconds, load
    timing.write_text(json.dumps({"seconds": run.seconds, "cpu_seconds": run.cpu_seconds, "load": load}) + "\n")


def recipe_for(spec: str, folder: Path) -> tuple[str, str]:
    """(recipe name or file, size class) of a quantkit row spec NAME[:bN][:gN][:nN][+rot] (see the module docstring)."""
    import yaml

    from quantkit.quant.registry import resolve

    base, *modifiers = spec.split("+")
    name, *options = base.split(":")
    unknown = set(modifiers) - {"rot"}
    if unknown:
        raise ValueError(f"row {spec!r}: unknown modifier(s) {sorted(unknown)}; known: +rot (R1+R2 rotations)")
    recipe = yaml.safe_load(Path(resolve(name).source).read_text())
    weights = recipe["scheme"]["weights"]
    options = [option for option in options if not (option[:1] == "n" and option[1:].isdigit())]  # quantkit_row's
    for option in options:
        if len(option) < 2 or option[0] not in "bg" or not option[1:].isdigit():
            raise ValueError(f"row {spec!r}: options are :bN (N-bit codes), :gN (groups of N), :nN (N blocks)")
        if option[0] == "b":
            weights["dtype"] = f"int{option[1:]}"
        else:
            weights["group_size"] = int(option[1:])
    if "rot" in modifiers:
        recipe["transforms"] = [{"type": "hadamard", "rotations": ["R1", "R2"]}]
    if not name.startswith("mlx-"):
        recipe.update(format="mlx", ignore=[], on_indivisible="skip")
    bits = f"{weights['dtype'].removeprefix('int')}-bit"
    if not options and not modifiers and name.startswith("mlx-"):
        return name, bits
    path = folder / f"{slug(spec)}.yaml"
    path.write_text(f"# {spec}: {name}, modified by scripts/bench_mlx.py\n" + yaml.safe_dump(recipe, sort_keys=False))
    return str(path), bits


def quantkit_row(model: str, src: Path, spec: str, folder: Path, args: argparse.Namespace) -> Row:
    from quantkit.quant.registry import resolve

    if spec.startswith("budget:"):  # budget:BPW, a plan at a size of one's choosing (a uniform file's bits per weight)
        target = float(spec.partition(":")[2])
        return budget_row(model, src, target, "as asked", folder, args)
    row = Row(model, "quantkit", spec, folder / f"quantkit-{slug(spec)}")
    try:
        recipe, row.bits = recipe_for(spec, folder)
        calibrated = resolve(recipe).needs_calibration
    except Exception as error:  # an unknown recipe or spec: the row says so
        row.error = one_line(str(error))
        return row
    blocks = [int(o[1:]) for o in spec.split("+")[0].split(":")[1:] if o[:1] == "n" and o[1:].isdigit()]
    samples = blocks[-1] if blocks else args.num_samples  # :nN, as mlx-lm's awq:4:n16: N calibration blocks
    calibration = harness.calibration_options(args.calib_data, samples, args.seq_len) if calibrated else []
    cmd = harness.finalize_command(src, row.path, recipe, args.threads, "--format", "mlx", *calibration)
    made(row, cmd, mlx_env(args), args)
    print(f"{model} quantkit {spec}: {row.error or f'{row.seconds:.0f} s'}", file=sys.stderr)
    return row


def budget_row(model: str, src: Path, target: float, label: str, folder: Path, args: argparse.Namespace) -> Row:
    row = Row(model, "quantkit", f"--target-bpw {target:.3f} ({label})", folder / f"quantkit-budget-{target:.4f}",
              bits="budget")
    cmd = harness.finalize_command(src, row.path, "mlx-gptq-4bit-g64", args.threads, "--format", "mlx",
                                   "--target-bpw", f"{target:.4f}",
                                   *harness.calibration_options(args.calib_data, args.num_samples, args.seq_len))
    made(row, cmd, mlx_env(args), args)
    print(f"{model} quantkit budget {target:.3f}: {row.error or f'{row.seconds:.0f} s'}", file=sys.stderr)
    return row


def mlx_home(src: Path, folder: Path, args: argparse.Namespace) -> Path:
    """A HOME for mlx-lm's quantizers whose .cache/mlx-lm/calibration_v5.txt is quantkit's calibration blocks, decoded
    by the model's tokenizer, one block a line."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    home = folder / "mlx-home"
    text = home / ".cache" / "mlx-lm" / "calibration_v5.txt"
    calib = folder / f"calib-{args.num_samples}x{args.seq_len}.safetensors"
    if not calib.is_file():
        harness.write_calibration(src, args.calib_data, args.num_samples, args.seq_len, folder)
    if not text.is_file() or not args.reuse:
        blocks = load_file(str(calib))["input_ids"]
        tokenizer = AutoTokenizer.from_pretrained(src)
        text.parent.mkdir(parents=True, exist_ok=True)
        text.write_text("\n".join(tokenizer.decode(block) for block in blocks.tolist()) + "\n", encoding="utf-8")
    return home


def mlx_lm_row(model: str, src: Path, spec: str, folder: Path, home: Path, args: argparse.Namespace) -> Row:
    """One mlx-lm file: convert:B, awq:B, gptq:B, dwq:B (`:nN` after B: N calibration blocks, not `--num-samples`),
    dynamic:LOW/HIGH:BPW."""
    tool, _, rest = spec.partition(":")
    row = Row(model, "mlx-lm", spec, folder / f"mlx-lm-{slug(spec)}")
    launch = [str(args.mlx_python), str(folder.parent / "launch.py")]
    samples = ["--num-samples", str(args.num_samples), "--sequence-length", str(args.seq_len)]
    if tool == "dynamic":
        low, high = rest.split(":")[0].split("/")
        row.bits = "budget"
        cmd = [*launch, "mlx_lm.quant.dynamic_quant", "--model", str(src), "--mlx-path", str(row.path), "--low-bits", low,
               "--high-bits", high, "--low-group-size", str(GROUP), "--high-group-size", str(GROUP),
               "--target-bpw", rest.split(":")[1]]
    else:
        bits, *more = rest.split(":")
        if more and more[0][:1] == "n" and more[0][1:].isdigit():  # awq:4:n16: fewer calibration blocks
            samples[1] = more[0][1:]
        row.bits = f"{bits}-bit"
        cmd = {
            "convert": [*launch, "mlx_lm.convert", "--hf-path", str(src), "--mlx-path", str(row.path), "-q", "--q-bits",
                        bits, "--q-group-size", str(GROUP)],
            "awq": [*launch, "mlx_lm.quant.awq", "--model", str(src), "--mlx-path", str(row.path), "--bits", bits,
                    "--group-size", str(GROUP), "--embed-bits", bits, "--embed-group-size", str(GROUP), *samples],
            "gptq": [*launch, "mlx_lm.quant.gptq", "--model", str(src), "--mlx-path", str(row.path), "--bits", bits,
                     "--group-size", str(GROUP), "--fallback-bits", bits, "--fallback-group-size", str(GROUP), *samples],
            "dwq": [str(args.mlx_python), str(folder.parent / "dwq_runner.py"), str(src), str(row.path), bits,
                    str(GROUP), str(args.num_samples), str(args.seq_len), str(args.dwq_lr), str(args.dwq_batch),
                    str(args.dwq_valid), "123"],
        }.get(tool)
        if cmd is None:
            row.error = f"row {spec!r}: tools are convert, awq, gptq, dwq (:BITS) and dynamic (:LOW/HIGH:BPW)"
            return row
    made(row, cmd, mlx_env(args, home), args, cwd=folder)  # dynamic_quant writes its sensitivities to the cwd
    print(f"{model} mlx-lm {spec}: {row.error or f'{row.seconds:.0f} s'}", file=sys.stderr)
    return row


# ---------------------------------------------------------------- sizes and measuring


def safetensors_header_bytes(folder: Path) -> int:
    total = 0
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as f:
            total += 8 + struct.unpack("<Q", f.read(8))[0]
    return total


def layout(folder: Path) -> str:
    """What config.json's quantization says: the default bits, and the layers given other bits; the scales' dtype."""
    config = json.loads((folder / "config.json").read_text())
    q = config.get("quantization")
    if not q:
        return "float"
    bits = {}
    for key, value in q.items():
        if isinstance(value, dict) and "bits" in value:  # (mlx_lm.awq also lists the norms, as False)
            bits[value["bits"]] = bits.get(value["bits"], 0) + 1
    dtypes = set()
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        dtypes |= {v["dtype"] for k, v in header.items() if k.endswith(".scales")}
    others = ", ".join(f"{n} at {b}" for b, n in sorted(bits.items(), key=str) if b != q.get("bits"))
    return f"{q.get('bits')}-bit g{q.get('group_size')}" + (f" ({others})" if others else "") + \
        f", scales {'/'.join(sorted(dtypes))}"


def sizes(row: Row, parameters: int) -> None:
    row.file_bytes = harness.safetensors_bytes(row.path)
    row.tensor_bytes = row.file_bytes - safetensors_header_bytes(row.path)
    row.bpw = 8 * row.tensor_bytes / parameters
    row.layout = layout(row.path)


def measure(rows: list[Row], src: Path, folder: Path, args: argparse.Namespace) -> None:
    """Every file's perplexity and divergence from `src`, cached per file (PATH.measure.json, keyed by the windows)."""
    key = f"{args.eval_data}|{args.ctx}|{args.chunks}|{src}"
    todo = []
    for row in rows:
        if row.error:
            continue
        cache = row.path.with_name(row.path.name + ".measure.json")
        timing = row.path.with_name(row.path.name + ".timing.json")
        fresh = cache.is_file() and timing.is_file() and cache.stat().st_mtime >= timing.stat().st_mtime
        if not (args.reuse and fresh and json.loads(cache.read_text()).get("key") == key):
            todo.append(row)
    if todo:
        out = folder / "measure.json"
        cmd = [str(args.mlx_python), str(folder.parent / "measure_runner.py"), str(src), str(args.eval_data),
               str(args.ctx), str(args.chunks), str(out), *[str(r.path) for r in todo]]
        print(f"measuring {len(todo)} files in mlx ...", file=sys.stderr)
        proc = subprocess.run(cmd, env=mlx_env(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        found = json.loads(out.read_text()) if out.is_file() else {}
        if proc.returncode and not found:
            sys.exit(f"measure_runner.py failed:\n{proc.stderr[-3000:]}")
        (folder / "reference.measure.json").write_text(json.dumps({"key": key, **found.get("reference", {})}))
        for row in todo:
            result = found.get(str(row.path), {"error": "not measured: " + one_line(proc.stderr)})
            row.path.with_name(row.path.name + ".measure.json").write_text(json.dumps({"key": key, **result}))
    for row in rows:
        cache = row.path.with_name(row.path.name + ".measure.json")
        if row.error or not cache.is_file():
            continue
        result = json.loads(cache.read_text())
        if "error" in result:
            row.error = result["error"]
            continue
        for name in ("ppl", "ppl_se", "kld", "kld_se", "kld_p99", "same_top", "dense_check"):
            setattr(row, name, result.get(name))


def reference_row(model: str, src: Path, folder: Path, parameters: int) -> Row:
    row = Row(model, "float", "float32 (reference)", src, bits="float")
    row.file_bytes = harness.safetensors_bytes(src)
    row.tensor_bytes = row.file_bytes - safetensors_header_bytes(src)
    row.bpw = 8 * row.tensor_bytes / parameters
    row.layout = "float32"
    cache = folder / "reference.measure.json"
    if cache.is_file():
        found = json.loads(cache.read_text())
        row.ppl, row.ppl_se = found.get("ppl"), found.get("ppl_se")
    return row


# ---------------------------------------------------------------- the table and the targets

ORDER = {"float": 0, "4-bit": 1, "3-bit": 2, "budget": 3}


def table(rows: list[Row]) -> str:
    header = ["model", "size", "tool", "row", "layout (config.json)", "safetensors bytes", "bits/weight", "perplexity",
              "mean KLD", "KLD p99", "same top", "make wall s", "make CPU s", "load"]
    lines = []
    for r in sorted(rows, key=lambda r: (r.model, ORDER.get(r.bits, 9), r.bits, r.tensor_bytes or 0, r.tool != "mlx-lm")):
        kld = f"{r.kld:.5f} ± {r.kld_se:.5f}" if r.kld is not None else (r.error[:90] if r.error else "")
        ppl = f"{r.ppl:.2f} ± {r.ppl_se:.2f}" if r.ppl is not None else ""
        lines.append([r.model, r.bits, r.tool, r.row, r.layout, f"{r.file_bytes:,}" if r.file_bytes else "",
                      fmt(r.bpw, ".3f"), ppl, kld, fmt(r.kld_p99, ".4f"),
                      "" if r.same_top is None else f"{100 * r.same_top:.2f}%", fmt(r.seconds, ".1f"),
                      fmt(r.cpu_seconds, ".1f"), r.load])
    return harness.markdown_table(header, lines, "lllllrrrrrrrrl")


def best(rows: list[Row], tool: str, bits: str, model: str, key: str) -> Row | None:
    found = [r for r in rows if r.tool == tool and r.bits == bits and r.model == model and getattr(r, key) is not None]
    return min(found, key=lambda r: getattr(r, key), default=None)


def targets(rows: list[Row]) -> list[str]:
    """Per model and size class, quantkit's best file against mlx-lm's best (KLD, and perplexity), no larger; per
    dynamic_quant file, the budget row made at its size."""
    lines = []
    for model in sorted({r.model for r in rows}):
        for bits in ("4-bit", "3-bit"):
            for key, name in (("kld", "mean KLD"), ("ppl", "perplexity")):
                ours, theirs = best(rows, "quantkit", bits, model, key), best(rows, "mlx-lm", bits, model, key)
                if not ours or not theirs:
                    continue
                a, b = getattr(ours, key), getattr(theirs, key)
                met = a <= b and ours.tensor_bytes <= theirs.tensor_bytes
                lines.append(f"{model} {bits}, {name}: quantkit {ours.row} {a:.5g} ({ours.file_bytes:,} B) against mlx-lm "
                             f"{theirs.row} {b:.5g} ({theirs.file_bytes:,} B), {100 * (a / b - 1):+.1f}%: "
                             f"{'met' if met else 'not met'}")
        for peer in [r for r in rows if r.model == model and r.tool == "mlx-lm" and r.row.startswith("dynamic")]:
            ours = next((r for r in rows if r.model == model and r.tool == "quantkit" and r.row.endswith(f"({peer.row})")), None)
            if ours is None or ours.kld is None or peer.kld is None:
                continue
            met = ours.kld <= peer.kld and ours.tensor_bytes <= peer.tensor_bytes
            lines.append(f"{model} at {peer.row}'s size: quantkit budget KLD {ours.kld:.5f}, PPL {ours.ppl:.2f} "
                         f"({ours.tensor_bytes:,} B tensors) against dynamic_quant KLD {peer.kld:.5f}, PPL {peer.ppl:.2f} "
                         f"({peer.tensor_bytes:,} B), {100 * (ours.kld / peer.kld - 1):+.1f}% KLD: {'met' if met else 'not met'}")
    return lines


def mlx_versions(python: Path) -> str:
    proc = subprocess.run([str(python), "-c", "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__)"],
                          capture_output=True, text=True)
    return "mlx {} / mlx-lm {}".format(*proc.stdout.split()) if proc.returncode == 0 else f"not found ({python})"


# ---------------------------------------------------------------- main


def rows_of(model: str, src: Path, args: argparse.Namespace) -> list[Row]:
    folder = args.workdir / "mlx" / (src.parent.name if src.name == "final" else src.name)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("mlx_dense.py", DENSE_PATCH), ("launch.py", LAUNCHER), ("dwq_runner.py", DWQ_RUNNER),
                       ("measure_runner.py", MEASURE_RUNNER)):
        (folder.parent / name).write_text(text)
    parameters = harness.parameter_count(src)
    home = mlx_home(src, folder, args)
    rows = [quantkit_row(model, src, spec, folder, args) for spec in args.quantkit]
    rows += [mlx_lm_row(model, src, spec, folder, home, args) for spec in args.mlx_lm]
    for peer in [r for r in rows if r.tool == "mlx-lm" and r.row.startswith("dynamic") and not r.error]:
        sizes(peer, parameters)
        rows.append(budget_row(model, src, peer.bpw, peer.row, folder, args))
    for row in rows:
        if not row.error:
            sizes(row, parameters)
    if not args.make_only:
        measure(rows, src, folder, args)
    return [reference_row(model, src, folder, parameters), *rows]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_model_arguments(p)
    p.add_argument("--intermediate", type=int, default=1536)
    p.set_defaults(train_steps=200)  # the trained model of bench_gguf.py
    p.add_argument("--models", nargs="+", choices=["plain", "outlier"], default=["plain"])
    p.add_argument("--outlier-channels", type=int, default=4)
    p.add_argument("--outlier-factor", type=float, default=64.0)
    p.add_argument("--quantkit", nargs="*", default=QUANTKIT_ROWS, metavar="ROW")
    p.add_argument("--mlx-lm", nargs="*", default=MLX_LM_ROWS, metavar="ROW")
    p.add_argument("--mlx-python", type=Path, default=MLX_PYTHON, help="a Python with mlx and mlx-lm")
    p.add_argument("--blas", default=str(OPENBLAS), help="a BLAS preloaded into every mlx process ('' for none)")
    p.add_argument("--dwq-lr", type=float, default=1e-6, help="mlx_lm.dwq's default")
    p.add_argument("--dwq-batch", type=int, default=4, help="mlx_lm.dwq's default")
    p.add_argument("--dwq-valid", type=int, default=8, help="blocks for DWQ's validation loss")
    p.add_argument("--calib-data", type=Path, default=WIKITEXT / "valid.txt")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-data", type=Path, default=WIKITEXT / "test.txt")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--make-only", action="store_true", help="make the files, measure nothing (runs of disjoint rows "
                   "side by side; a later --reuse run measures them)")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = bench.benchmark_model(args)
    models = {"plain": src} if "plain" in args.models else {}
    if "outlier" in args.models:
        models["outlier"] = bench_rotations.outlier_model(src, args.workdir, args)
    rows = [row for model, path in models.items() for row in rows_of(model, path, args)]
    facts = {"date": date.today().isoformat(), **harness.host_facts(), "threads": args.threads,
             "mlx": mlx_versions(args.mlx_python), "blas": args.blas or "mlx-cpu's own",
             "quantkit": bench_rotations.git_head(), **harness.versions("torch", "transformers"),
             "parameters": {m: harness.parameter_count(p) for m, p in models.items()},
             "calibration": f"{args.num_samples} x {args.seq_len} tokens of {args.calib_data}",
             "eval": f"{args.chunks} x {args.ctx} tokens of {args.eval_data}"}
    print("\n" + ", ".join(f"{k} {v}" for k, v in facts.items()) + "\n")
    print(table(rows))
    lines = targets(rows)
    print("\nTargets:\n\n" + "\n".join(f"- {line}" for line in lines))
    if args.json:
        args.json.write_text(json.dumps({"facts": facts, "rows": [{**asdict(r), "path": str(r.path)} for r in rows],
                                         "targets": lines}, indent=2) + "\n")


if __name__ == "__main__":
    main()
