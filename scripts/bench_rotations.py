"""Benchmark Hadamard rotations (QuaRot / SpinQuant R1+R2, fused) against llm-compressor's SpinQuantModifier and
QuIPModifier: perplexity rise over the float model, with and without rotations, on a trained model and on the same
model with activation outliers, in one run.

The same machinery as scripts/bench_calibration.py (read its docstring for the llm-compressor venv, the thread
pinning and the trained benchmark model, shared through `--workdir`):

    python scripts/bench_rotations.py --llmc-python /tmp/stack/bin/python --json rotations.json

What it does (everything cached under `--workdir`):

1. the trained benchmark model of bench_calibration.py (or `--model`), and its outlier copy made by
   scripts/make_outlier_model.py (`--outlier-channels` channels of every decoder layer's two norms scaled by
   `--outlier-factor`, the Linears reading them divided back: the same float function, x64 outlier channels in
   the inputs of q/k/v and gate/up). The plain model is the control. A third model, "folded", is the outlier
   model with each decoder norm's weight folded into the Linears it feeds (R1's first step, no rotation): R1 folds
   the norms before it rotates, which undoes this outlier construction exactly (the rotated rows of the outlier
   model equal the plain model's), so its unrotated rows show how much of the rotated gain is the fold alone;
2. the calibration blocks (harness.write_calibration) and the evaluation windows (the token ids and windows
   `quantkit eval` scores: quantkit.data.tokenize + eval_windows, seq_len 256, `--eval-samples` windows), saved
   for the llm-compressor runner;
3. for each model and scheme: quantkit's recipe without rotations and with R1+R2 Hadamard rotations (the shipped
   `quarot-*` recipe when this checkout has it with the same grid and steps, else a user recipe file: the shipped
   recipe's YAML plus `transforms: [{type: hadamard, rotations: [R1, R2]}]`), and llm-compressor 0.14's
   QuantizationModifier with the same quantizer alone, after SpinQuantModifier(rotations=[R1, R2],
   transform_type="hadamard"), and after QuIPModifier() (its defaults: online random-Hadamard on every Linear's
   input, the inverse fused into the weight). Schemes: NVFP4 W4A4 (`nvfp4`; preset NVFP4), W4A8-FP8
   (`w4a8-fp8`; preset W4AFP8), W4A8 int (`int8-dynamic-act-int4-weight --format compressed-tensors`; the preset
   W4A8 has groups of 128 and symmetric activations, so the peer gets quantkit's grid as config_groups: int4
   symmetric groups of 32, int8 asymmetric dynamic per token), and GPTQ W4A16 with and without rotations
   (`gptq-w4a16`, `spinquant-gptq-w4a16`) on quantkit's side as a weight-only control;
4. one `quantkit eval` call for the two float models, every quantkit artifact, and llm-compressor's artifacts
   that plain transformers loads (no transform, SpinQuant: R1/R2 are fused weight edits). Every llm-compressor
   row is ALSO evaluated in its own process, in memory right after `oneshot` (before saving), on the same token
   windows: QuIP's online transforms are not applied by transformers (its artifact computes garbage there), so
   that is the only way to measure it. The in-memory model runs compressed-tensors' quantized forward (status
   frozen: weights and activations fake-quantized; the runner counts the Linears that quantize activations and
   the report shows it). The float models are evaluated in the peer's process too, to show the two routes agree,
   and after each of the peer's transforms alone (no quantizer), to show which of them keep the float function;
5. prints a table (which route evaluated each row), the rise with / without rotations per scheme, the time and
   memory rotations add (quantkit.json's `transforms.seconds`, and wall / peak RSS with against without), and
   the targets: on the outlier model, NVFP4 rotations cut quantkit's rise by at least half, and quantkit's
   rotated rise is <= the peer's rotated rises; fused rotations take <= 10% of the run.

`--learned STEPS` adds quantkit rows with R1+R2 learned from the Hadamard matrices (SpinQuant's Cayley SGD,
`learn: {steps: STEPS, learning_rate: --learning-rate}`) on the same calibration data; llm-compressor 0.14 has
no learned rotations, so its rows stay the Hadamard ones. A learned row takes about 200 s here (100 steps).

llm-compressor's SpinQuant centres the embeddings (E - mean over hidden), which is exact for LayerNorm models but
changes an RMSNorm model's function; its rows are reported as it ships, beside rows with `center_embeddings`
patched out (`--no-spinquant-nocenter` leaves those out). The rotated weights of the latter are the ones quantkit
computes (quantkit's rotation math is bit-identical to SpinQuant's without the centring).

A full run (two models x four schemes, both tools, 64 windows) took 18-20 minutes on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import bench_calibration as bench
import harness
from harness import fmt, median

HADAMARD_R1_R2 = "transforms: [{type: hadamard, rotations: [R1, R2]}]\n"
RANDOM_HADAMARD_R1_R2 = "transforms: [{type: random-hadamard, rotations: [R1, R2], seed: 0}]\n"
RANDOM_HADAMARD_R1_R2_R4 = ("transforms: [{type: random-hadamard, rotations: [R1, R2], seed: 0}, "
                            "{type: random-hadamard, rotations: [R4], seed: 0, online: true}]\n")



def learned_r1_r2(steps: int, rate: float) -> str:
    """R1+R2 learned from the Hadamard matrices (SpinQuant's Cayley SGD, `--learned`)."""
    return f"transforms: [{{type: hadamard, rotations: [R1, R2], learn: {{steps: {steps}, learning_rate: {rate}}}}}]\n"


@dataclass(frozen=True)
class Scheme:
    row: str
    recipe: str  # quantkit's recipe without rotations
    rotated: str  # quantkit's shipped recipe with R1+R2, when it exists
    peer: str | None  # the runner's quantizer (None: quantkit only)
    options: tuple[str, ...] = ()  # extra `quantkit finalize` options for both quantkit rows


SCHEMES = [
    Scheme("NVFP4 (W4A4)", "nvfp4", "quarot-nvfp4", "NVFP4"),
    Scheme("W4A8-FP8", "w4a8-fp8", "quarot-w4a8-fp8", "W4AFP8"),
    Scheme("W4A8 int", "int8-dynamic-act-int4-weight", "quarot-w4a8", "W4A8-G32-ASYM",
           ("--format", "compressed-tensors")),
    Scheme("GPTQ W4A16 (weight-only control)", "gptq-w4a16", "spinquant-gptq-w4a16", None),
]
# the peer's transform variants: (runner name, row label)
PEER_TRANSFORMS = [("none", "none"), ("spinquant", "SpinQuant R1+R2 hadamard"),
                   ("spinquant-nocenter", "SpinQuant R1+R2 hadamard, embeddings not centred"),
                   ("quip", "QuIP v (online random-hadamard)")]
LOADABLE = {"none", "spinquant", "spinquant-nocenter", "spinquant-r4"}  # what `quantkit eval` computes: fused
# transforms (plain transformers computes them too) and SpinQuant's online R4 (quantkit's loader applies it)
R4_PEER = ("spinquant-r4", "SpinQuant R1+R2+R4 random-hadamard, not centred")

LLMC_ROTATIONS_RUNNER = '''\
"""llm-compressor side of scripts/bench_rotations.py (written there): oneshot() with a transform modifier before a
QuantizationModifier, then perplexity in this process on the given windows, then save_pretrained (unless DST is -);
prints one JSON line."""
import argparse, json, math, time

start = time.perf_counter()
p = argparse.ArgumentParser()
for name in ("src", "dst", "calib", "windows", "quantizer", "transform"):
    p.add_argument(name)
p.add_argument("threads", type=int)
args = p.parse_args()

import torch
import torch.nn.functional as F
torch.set_num_threads(args.threads)
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform import QuIPModifier, SpinQuantModifier

if args.transform in ("spinquant-nocenter", "spinquant-r4"):  # E - mean(E) changes an RMSNorm model's function
    import llmcompressor.modifiers.transform.spinquant.base as spinquant_base
    spinquant_base.center_embeddings = lambda embedding: None

common = dict(targets="Linear", ignore=["lm_head"])
# quantkit's int8-dynamic-act-int4-weight grid (the preset W4A8 has groups of 128 and symmetric activations)
w4a8_g32_asym = {"group_0": {"targets": ["Linear"],
    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "token", "dynamic": True}}}
quantizer = {
    "NVFP4": lambda: QuantizationModifier(scheme="NVFP4", **common),
    "W4AFP8": lambda: QuantizationModifier(scheme="W4AFP8", **common),
    "W4A8-G32-ASYM": lambda: QuantizationModifier(config_groups=w4a8_g32_asym, ignore=["lm_head"]),
    "float": lambda: None,
}[args.quantizer]()
transform = {
    "none": lambda: None,
    "spinquant": lambda: SpinQuantModifier(rotations=["R1", "R2"], transform_type="hadamard"),
    "spinquant-nocenter": lambda: SpinQuantModifier(rotations=["R1", "R2"], transform_type="hadamard"),
    "quip": lambda: QuIPModifier(),  # rotations=["v"], random-hadamard, targets Linear, ignore lm_head
    "spinquant-r4": lambda: SpinQuantModifier(rotations=["R1", "R2", "R4"], transform_type="random-hadamard"),
}[args.transform]()
recipe = [m for m in (transform, quantizer) if m is not None]
imported = time.perf_counter()

model = AutoModelForCausalLM.from_pretrained(args.src, dtype="auto")
tokenizer = AutoTokenizer.from_pretrained(args.src)
loaded = time.perf_counter()
if recipe:
    ids = load_file(args.calib)["input_ids"]
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    oneshot(model=model, dataset=dataset, recipe=recipe, max_seq_length=ids.shape[1],
            num_calibration_samples=ids.shape[0], shuffle_calibration_samples=False)
calibrated = time.perf_counter()

def quantizes_activations(module):
    scheme = getattr(module, "quantization_scheme", None)
    return (getattr(module, "quantization_enabled", True) and scheme is not None and scheme.input_activations is not None
            and getattr(module, "quantization_status", None) is not None)

linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
status = sorted({str(getattr(m, "quantization_status", None)) for m in linears})
act_quantized = sum(map(quantizes_activations, linears))
hooks = sum(len(m._forward_pre_hooks) for m in linears)

# quantkit.evaluation.evaluate.perplexity, batch size 1: windows (begin, end, target_begin); tokens before
# target_begin are context only
saved_eval = load_file(args.windows)
eval_ids, windows = saved_eval["input_ids"], saved_eval["windows"].tolist()
nll, scored = 0.0, 0
model.eval()
with torch.inference_mode():
    for begin, end, target_begin in windows:
        inputs = eval_ids[begin:end][None]
        labels = inputs.clone()
        labels[0, : target_begin - begin] = -100
        logits = model(input_ids=inputs, use_cache=False).logits[:, :-1].float()
        targets = labels[:, 1:]
        nll += F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100,
                               reduction="sum").item()
        scored += int((targets != -100).sum())
evaluated = time.perf_counter()

if args.dst != "-" and recipe:
    model.save_pretrained(args.dst, save_compressed=True)
    tokenizer.save_pretrained(args.dst)
saved = time.perf_counter()
print(json.dumps({"import_s": imported - start, "load_s": loaded - imported, "oneshot_s": calibrated - loaded,
                  "eval_s": evaluated - calibrated, "save_s": saved - evaluated, "threads": torch.get_num_threads(),
                  "perplexity": math.exp(nll / scored), "tokens": scored, "windows": len(windows),
                  "linears": len(linears), "linears_quantizing_activations": act_quantized,
                  "quantization_status": status, "linear_forward_pre_hooks": hooks}))
'''


@dataclass
class Row:
    """One artifact (or one in-memory peer model): which model, scheme, tool and rotation, and what it measured."""

    model: str  # "plain", "outlier" or "folded"
    scheme: str
    tool: str
    rotation: str  # "none", or the rotation's label
    recipe: str  # quantkit's recipe name or file; the peer's modifiers
    dst: Path
    cmd: list[str]
    seconds: list[float] = field(default_factory=list)
    peak_rss_mib: list[float] = field(default_factory=list)
    returncode: int = 0
    error: str = ""
    reported: dict = field(default_factory=dict)  # the runner's JSON line; quantkit.json's calibration phases
    ppl_artifact: float | None = None  # the written artifact, by `quantkit eval`
    ppl_in_process: float | None = None  # the peer's in-memory model after oneshot, in its own process
    loadable: bool = True  # whether `quantkit eval` can evaluate the written artifact

    @property
    def ppl(self) -> float | None:
        return self.ppl_artifact if self.ppl_artifact is not None else self.ppl_in_process

    @property
    def evaluated_by(self) -> str:
        if self.ppl_artifact is not None and self.ppl_in_process is not None:
            return "quantkit eval (in-process: " + fmt(self.ppl_in_process, ".3f") + ")"
        if self.ppl_artifact is not None:
            return "quantkit eval"
        return "in the peer's process" if self.ppl_in_process is not None else "-"

    @property
    def rotated(self) -> bool:
        return self.rotation != "none"


# ---------------------------------------------------------------- models, tokens


def outlier_model(src: Path, workdir: Path, args: argparse.Namespace) -> Path:
    """scripts/make_outlier_model.py's copy of `src`, made once (its printout kept beside it)."""
    name = src.parent.name if src.name == "final" else src.name  # a trained model is OUTPUT/final
    dst = workdir / f"{name}-outlier-c{args.outlier_channels}-f{args.outlier_factor:g}"
    if (dst / "config.json").is_file():
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    cmd = [sys.executable, str(harness.REPO / "scripts" / "make_outlier_model.py"), str(src), str(dst),
           "--channels", str(args.outlier_channels), "--factor", str(args.outlier_factor)]
    proc = subprocess.run(cmd, env=harness.thread_env(args.threads), capture_output=True, text=True)
    (workdir / f"{dst.name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        sys.exit(f"make_outlier_model.py failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return dst


def folded_model(outlier: Path, workdir: Path, args: argparse.Namespace) -> Path:
    """The outlier model with every decoder layer's norm weights folded into the Linears reading them (in float64;
    norms set to 1), nothing rotated: R1's first step alone. With a power-of-two factor this undoes
    make_outlier_model.py exactly, so its unrotated rows say how much of the rotated recipes' gain is the fold."""
    dst = workdir / f"{outlier.name}-folded"
    if (dst / "config.json").is_file():
        return dst
    harness.in_child(_fold_norms, outlier, dst, args.threads, what=f"folding the norms of {outlier}")
    return dst


def _fold_norms(src: Path, dst: Path, threads: int) -> None:
    import torch
    from make_outlier_model import TOKENIZER_FILES, norm_readers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for norm, linears in norm_readers(model).values():
            for linear in linears:
                linear.weight.copy_(linear.weight.double() * norm.weight.double())
            norm.weight.fill_(1.0)
    tmp = dst.with_name(dst.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    tmp.rename(dst)


def outlier_summary(path: Path, workdir: Path) -> list[str]:
    """make_outlier_model.py's per-norm lines and its logit check, from the log kept beside the model."""
    log = workdir / f"{path.name}.log"
    lines = log.read_text().splitlines() if log.is_file() else []
    return [line for line in lines if "→" in line or line.startswith("largest logit change")]


def write_eval_windows(src: Path, args: argparse.Namespace) -> Path:
    """The token ids and windows `quantkit eval --seq-len 256 --max-samples N` scores, for the peer's process."""
    import torch
    from safetensors.torch import save_file

    from quantkit.data import eval_windows, load_texts, tokenize
    from quantkit.models.loading import load_tokenizer

    ids = tokenize(load_tokenizer(src), load_texts(str(args.eval_data)))
    windows = eval_windows(ids.numel(), 256, None, args.eval_samples)
    path = args.workdir / f"eval-windows-{args.eval_samples}x256.safetensors"
    save_file({"input_ids": ids[: windows[-1][1]].contiguous(), "windows": torch.tensor(windows)}, str(path))
    return path


# ---------------------------------------------------------------- jobs


def rotated_recipe(scheme: Scheme, folder: Path, kind: str = HADAMARD_R1_R2) -> tuple[str, str]:
    """(recipe, why): the shipped rotated recipe when it has the unrotated one's grid and steps, else a user recipe
    file, the unrotated recipe's YAML plus a `transforms:` key."""
    from quantkit.quant.registry import resolve

    base = resolve(scheme.recipe)
    if kind == HADAMARD_R1_R2 and bench.has_recipe(scheme.rotated):
        shipped = resolve(scheme.rotated)
        if shipped.scheme == base.scheme and shipped.steps == base.steps:
            return scheme.rotated, "shipped"
        note = f"shipped {scheme.rotated} differs from {scheme.recipe} (grid or steps): a user recipe file instead"
    else:
        note = "user recipe file"
    name = {HADAMARD_R1_R2: f"{scheme.recipe}-hadamard-r1r2.yaml", RANDOM_HADAMARD_R1_R2: f"{scheme.recipe}-rh-r1r2.yaml",
            RANDOM_HADAMARD_R1_R2_R4: f"{scheme.recipe}-rh-r1r2r4.yaml"}.get(kind, f"{scheme.recipe}-learned-r1r2.yaml")
    path = folder / name
    path.write_text(Path(base.source).read_text().rstrip("\n") + "\n" + kind)
    return str(path), note


def quantkit_row(model: str, src: Path, scheme: Scheme, recipe: str, rotation: str, out: Path,
                 args: argparse.Namespace) -> Row:
    from quantkit.quant.registry import resolve

    calibrated = resolve(recipe).needs_samples  # calibrates, or learns its rotations on the calibration data
    calibration = harness.calibration_options(args.calib_data, args.num_samples, args.seq_len) if calibrated else []
    label = Path(recipe).stem if recipe.endswith(".yaml") else recipe
    dst = out / model / f"quantkit-{label}"
    cmd = harness.finalize_command(src, dst, recipe, args.threads, *scheme.options, *calibration)
    return Row(model, scheme.row, "quantkit", rotation, recipe, dst, cmd)


def peer_row(model: str, src: Path, scheme: Scheme, transform: str, label: str, out: Path, calib: Path,
             windows: Path, runner: Path, args: argparse.Namespace) -> Row:
    """The runner's job; it saves the artifact only when plain transformers computes it (fused transforms)."""
    dst = out / model / f"llmc-{scheme.peer}-{transform}"
    save = transform in LOADABLE and scheme.peer != "float"
    cmd = [str(args.llmc_python), str(runner), str(src), str(dst) if save else "-", str(calib), str(windows),
           scheme.peer, transform, str(args.threads)]
    recipe = ("" if transform == "none" else f"{transform} + ") + f"QuantizationModifier {scheme.peer}"
    recipe = "float (no oneshot)" if scheme.peer == "float" else recipe
    return Row(model, scheme.row, "llm-compressor", "none" if transform == "none" else label, recipe, dst, cmd,
               loadable=save)


def make_rows(models: dict[str, Path], calib: Path, windows: Path, args: argparse.Namespace) -> tuple[list[Row], dict]:
    """Every job, quantkit's and the peer's alternating scheme by scheme; and how each rotated recipe was chosen."""
    out = args.workdir / "out-rotations"
    for model in models:
        (out / model).mkdir(parents=True, exist_ok=True)
    runner = args.workdir / "llmc_rotations_runner.py"
    runner.write_text(LLMC_ROTATIONS_RUNNER)
    peer_transforms = [(t, label) for t, label in PEER_TRANSFORMS if t != "spinquant-nocenter" or args.spinquant_nocenter]
    peer_transforms += [R4_PEER] if args.r4 else []
    if args.peer_transforms:
        peer_transforms = [(t, label) for t, label in peer_transforms if t in args.peer_transforms]
    rows, chosen = [], {}
    for model, src in models.items():
        if args.llmc_python and model != "folded":
            # the float model in the peer's process (the two evaluation routes must agree), and after each transform
            # alone (whether it keeps the float model's function: SpinQuant's centring does not)
            float_scheme = Scheme("float", "", "", "float")
            rows += [peer_row(model, src, float_scheme, t, label, out, calib, windows, runner, args)
                     for t, label in [("none", "none"), *[x for x in peer_transforms if x[0] != "none"]]]
        for scheme in SCHEMES:
            if args.only and scheme.recipe not in args.only:
                continue
            rows.append(quantkit_row(model, src, scheme, scheme.recipe, "none", out, args))
            if model == "folded":  # the fold alone: rotating it would give the rotated rows of the other two
                continue
            rotated, chosen[scheme.recipe] = rotated_recipe(scheme, out)
            rows.append(quantkit_row(model, src, scheme, rotated, "R1+R2 hadamard", out, args))
            if args.random_hadamard or args.r4:
                random_rotated, _ = rotated_recipe(scheme, out, RANDOM_HADAMARD_R1_R2)
                rows.append(quantkit_row(model, src, scheme, random_rotated, "R1+R2 random-hadamard", out, args))
            if args.r4:
                r4, _ = rotated_recipe(scheme, out, RANDOM_HADAMARD_R1_R2_R4)
                rows.append(quantkit_row(model, src, scheme, r4, "R1+R2+R4 random-hadamard", out, args))
            if args.learned:
                learned, _ = rotated_recipe(scheme, out, learned_r1_r2(args.learned, args.learning_rate))
                rows.append(quantkit_row(model, src, scheme, learned, f"R1+R2 learned ({args.learned} steps, lr "
                                         f"{args.learning_rate})", out, args))
            if args.llmc_python and scheme.peer:
                rows += [peer_row(model, src, scheme, t, label, out, calib, windows, runner, args)
                         for t, label in peer_transforms]
    return rows, chosen


# ---------------------------------------------------------------- measuring


def run_rows(rows: list[Row], repeats: int, threads: int, logs: Path) -> None:
    """`repeats` rounds over all rows, interleaved; quantkit.json's calibration phases and the runner's JSON kept."""
    env = harness.thread_env(threads)
    for round_no in range(1, repeats + 1):
        for row in rows:
            if row.returncode:
                continue
            shutil.rmtree(row.dst, ignore_errors=True)
            run, printed = harness.measure_logged(row.cmd, env, logs / f"{row.model}-{row.dst.name}.log")
            row.returncode, row.error = run.returncode, run.stderr_tail
            if not run.returncode:
                row.seconds.append(run.seconds)
                row.peak_rss_mib.append(run.peak_rss_mib)
                row.reported = harness.last_json_line(printed) or quantkit_phases(row.dst)
                if "perplexity" in row.reported:
                    row.ppl_in_process = row.reported["perplexity"]
            state = f"{run.seconds:.1f}s" if not run.returncode else f"FAILED (rc {run.returncode})"
            print(f"round {round_no}/{repeats} {row.model} {row.tool} {row.scheme} [{row.rotation}]: {state}",
                  file=sys.stderr)


def quantkit_phases(dst: Path) -> dict:
    """quantkit.json's calibration phases and its `transforms` record (the rotations' own seconds among them)."""
    path = dst / "quantkit.json"
    if not path.is_file():
        return {}
    info = json.loads(path.read_text())
    return {"calibration": info.get("calibration"), "transforms": info.get("transforms")}


def rotate_seconds(row: Row) -> float | None:
    """The rotations' own seconds, from quantkit.json's `transforms` (None: not rotated, or not reported): fusing
    them, and learning them where they are learned."""
    transforms = row.reported.get("transforms") or {}
    seconds = transforms.get("seconds")
    if not isinstance(seconds, (int, float)):
        return None
    return float(seconds) + float((transforms.get("learned") or {}).get("seconds", 0.0))


def evaluate(rows: list[Row], models: dict[str, Path], args: argparse.Namespace) -> tuple[dict[str, float], dict]:
    """One `quantkit eval` over the float models and every loadable artifact; each row's ppl_artifact set."""
    paths = list(models.values()) + [r.dst for r in rows if not r.returncode and r.loadable]
    ppl, errors = bench.perplexities(paths, args, args.workdir)
    for row in rows:
        row.ppl_artifact = ppl.get(str(row.dst)) if row.loadable and not row.returncode else None
    return {model: ppl.get(str(path)) for model, path in models.items()}, errors


# ---------------------------------------------------------------- reporting


def rise(row: Row, float_ppl: dict[str, float | None]) -> float | None:
    base = float_ppl.get(row.model)
    return row.ppl / base - 1 if row.ppl and base else None


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.2f}%"


HEADER = ["model", "scheme", "tool", "rotation", "recipe / modifiers", "wall s", "peak RSS MiB", "ppl", "rise vs float",
          "evaluated by", "rotate s (share)"]


def table(rows: list[Row], float_ppl: dict[str, float | None]) -> str:
    out = []
    for row in rows:
        if row.scheme == "float":
            continue
        seconds = median(row.seconds)
        rot = rotate_seconds(row)
        share = f"{rot:.2f} ({100 * rot / seconds:.1f}%)" if rot is not None and seconds else "-"
        recipe = Path(row.recipe).name if row.recipe.endswith(".yaml") else row.recipe
        out.append([row.model, row.scheme, row.tool, row.rotation, recipe,
                    "FAILED" if row.returncode else fmt(seconds, ".1f"), fmt(median(row.peak_rss_mib), ".0f"),
                    fmt(row.ppl, ".3f"), pct(rise(row, float_ppl)), row.evaluated_by, share])
    return harness.markdown_table(HEADER, out, "lllllrrrrlr")


def find(rows: list[Row], model: str, scheme: str, tool: str, rotation: str) -> Row | None:
    return next((r for r in rows if (r.model, r.scheme, r.tool, r.rotation) == (model, scheme, tool, rotation)
                 and not r.returncode), None)


def comparisons(rows: list[Row], float_ppl: dict[str, float | None]) -> list[dict]:
    """Per model and scheme: each tool's rise without and with each rotation, and whether rotations pay."""
    out = []
    for model in dict.fromkeys(r.model for r in rows):
        for scheme in dict.fromkeys(r.scheme for r in rows if r.model == model and r.scheme != "float"):
            entry = {"model": model, "scheme": scheme}
            for tool in ("quantkit", "llm-compressor"):
                variants = [r for r in rows if (r.model, r.scheme, r.tool) == (model, scheme, tool) and not r.returncode]
                if not variants:
                    continue
                rises = {r.rotation: rise(r, float_ppl) for r in variants}
                plain = rises.get("none")
                entry[tool] = {rotation: {"rise": value,
                                          "pays": None if rotation == "none" or value is None or plain is None
                                          else value < plain,
                                          "rise_cut": None if rotation == "none" or value is None or not plain or plain <= 0
                                          else 1 - value / plain}
                               for rotation, value in rises.items()}
            out.append(entry)
    return out


def cost(rows: list[Row]) -> list[dict]:
    """Per quantkit rotated row: its rotate phase (when reported), and wall time and peak RSS against the same
    scheme without rotations (the same model)."""
    out = []
    for row in rows:
        if row.tool != "quantkit" or not row.rotated or row.returncode:
            continue
        plain = find(rows, row.model, row.scheme, "quantkit", "none")
        wall, rot = median(row.seconds), rotate_seconds(row)
        entry = {"model": row.model, "scheme": row.scheme, "rotation": row.rotation, "wall_s": wall, "rotate_s": rot,
                 "rotate_share": rot / wall if rot is not None and wall else None}
        if plain:
            entry |= {"wall_without_s": median(plain.seconds), "rss_mib": median(row.peak_rss_mib),
                      "rss_without_mib": median(plain.peak_rss_mib),
                      "added_wall_share": (wall - median(plain.seconds)) / wall,
                      "added_rss_share": median(row.peak_rss_mib) / median(plain.peak_rss_mib) - 1}
        share = entry["rotate_share"] if entry["rotate_share"] is not None else entry.get("added_wall_share")
        entry["met"] = None if share is None or "learned" in row.rotation else share <= 0.10  # the target: fused ones
        entry["basis"] = "quantkit.json transforms.seconds" if entry["rotate_share"] is not None else "wall with - without"
        out.append(entry)
    return out


def targets(rows: list[Row], float_ppl: dict[str, float | None]) -> dict:
    """The issue's targets on the outlier model's NVFP4 rows (and the same numbers for the plain model)."""
    found = {}
    for model in ("outlier", "plain"):
        without = find(rows, model, SCHEMES[0].row, "quantkit", "none")
        with_rot = find(rows, model, SCHEMES[0].row, "quantkit", "R1+R2 hadamard")
        if not (without and with_rot):
            continue
        r0, r1 = rise(without, float_ppl), rise(with_rot, float_ppl)
        key = f"{model}: NVFP4 rotations cut quantkit's rise by >= half"
        found[key] = {"rise_without": r0, "rise_with": r1,
                      "met": None if r0 is None or r1 is None or r0 <= 0 else r1 <= 0.5 * r0,
                      "target": model == "outlier"}
        for transform, label in PEER_TRANSFORMS[1:]:
            peer = find(rows, model, SCHEMES[0].row, "llm-compressor", label)
            if peer and r1 is not None and rise(peer, float_ppl) is not None:
                found[f"{model}: NVFP4 quantkit rotated <= llm-compressor {transform}"] = {
                    "quantkit_rise": r1, "peer_rise": rise(peer, float_ppl), "met": r1 <= rise(peer, float_ppl) + 1e-12,
                    "target": model == "outlier"}
    return found


def route_offsets(rows: list[Row]) -> list[dict]:
    """The peer's rows evaluated both ways (artifact by `quantkit eval`, in memory in its own process): how far the
    two routes differ. compressed-tensors 0.20 decompresses FP4 weights in bfloat16 (value x scale rounded), while the
    in-memory model fake-quantizes in float32, so NVFP4 reads differently; the int4 schemes should agree exactly."""
    return [{"model": r.model, "scheme": r.scheme, "rotation": r.rotation, "artifact": r.ppl_artifact,
             "in_process": r.ppl_in_process, "artifact_over_in_process": r.ppl_artifact / r.ppl_in_process - 1}
            for r in rows if r.ppl_artifact is not None and r.ppl_in_process is not None]


def same_as_plain(rows: list[Row]) -> list[str]:
    """The outlier model's rows whose perplexity equals the plain model's row: rotations that fold the norms into
    the Linears (R1) undo make_outlier_model.py's rescale exactly (norm weight x f, Linear columns / f)."""
    found = []
    for row in rows:
        outlier = row.model == "outlier" and row.scheme != "float"
        twin = find(rows, "plain", row.scheme, row.tool, row.rotation) if outlier else None
        if twin and row.ppl is not None and twin.ppl is not None and abs(row.ppl / twin.ppl - 1) < 1e-9:
            found.append(f"{row.tool} {row.scheme} [{row.rotation}]")
    return found


def fold_share(rows: list[Row], float_ppl: dict[str, float | None]) -> list[dict]:
    """Per scheme, quantkit's rise on the outlier model unrotated, with its norms folded only, and rotated (R1+R2):
    which part of the rotated recipe's gain the norm fold alone gives."""
    out = []
    for scheme in dict.fromkeys(r.scheme for r in rows if r.model == "folded"):
        none, folded, rotated = (find(rows, model, scheme, "quantkit", rotation) for model, rotation in
                                 (("outlier", "none"), ("folded", "none"), ("outlier", "R1+R2 hadamard")))
        if not (none and folded and rotated) or None in (none.ppl, folded.ppl, rotated.ppl):
            continue
        r_none, r_fold, r_rot = rise(none, float_ppl), rise(folded, float_ppl), rise(rotated, float_ppl)
        gain = r_none - r_rot
        out.append({"scheme": scheme, "outlier_none": r_none, "outlier_norms_folded": r_fold, "outlier_rotated": r_rot,
                    "fold_share_of_gain": (r_none - r_fold) / gain if gain > 0 else None})
    return out


def print_report(facts: dict, rows: list[Row], float_ppl: dict, chosen: dict, errors: dict) -> None:
    print(f"- python {facts['python']}, {facts['cpus']} CPUs, threads {facts['threads']}, repeats {facts['repeats']}; "
          f"quantkit side: torch {facts['torch']}, transformers {facts['transformers']}, "
          f"compressed-tensors {facts['compressed-tensors']}; quantkit at {facts['quantkit_commit']}")
    print(f"- llm-compressor side: {facts['llmc'] or 'skipped (pass --llmc-python)'}")
    for model, info in facts["models"].items():
        peer = next((r for r in rows if r.model == model and r.scheme == "float"), None)
        in_process = f"; in the peer's process {fmt(peer.ppl_in_process, '.3f')}" if peer else ""
        print(f"- {model} model: {info['path']}; float perplexity {fmt(float_ppl.get(model), '.3f')} (quantkit eval)"
              f"{in_process}")
    for line in facts["outlier_log"]:
        print(f"    {line}")
    print(f"- calibration: {facts['calibration']}; perplexity: {facts['eval']}")
    print("- quantkit's rotated recipes: " + "; ".join(f"{k}: {v}" for k, v in chosen.items()))
    print()
    print(table(rows, float_ppl))
    print("\nllm-compressor's wall time includes its in-process perplexity and its save (the JSON's reported "
          "oneshot_s / eval_s / save_s split it); quantkit's is `quantkit finalize` alone.")
    print()
    for entry in comparisons(rows, float_ppl):
        parts = []
        for tool in ("quantkit", "llm-compressor"):
            for rotation, v in entry.get(tool, {}).items():
                pays = "" if v["pays"] is None else (" pays" if v["pays"] else " does NOT pay")
                parts.append(f"{tool} {rotation}: {pct(v['rise'])}{pays}")
        print(f"- {entry['model']} / {entry['scheme']}: " + "; ".join(parts))
    print()
    for entry in cost(rows):
        added = (f", wall {entry['wall_s']:.1f} s vs {entry['wall_without_s']:.1f} s without "
                 f"({100 * entry['added_wall_share']:+.1f}% of the run), peak RSS {entry['rss_mib']:.0f} vs "
                 f"{entry['rss_without_mib']:.0f} MiB ({100 * entry['added_rss_share']:+.1f}%)") if "wall_without_s" in entry else ""
        rot = f"rotations {entry['rotate_s']:.2f} s ({100 * entry['rotate_share']:.1f}% of the run)" \
            if entry["rotate_s"] is not None else "no transforms.seconds in quantkit.json"
        met = "n/a" if entry["met"] is None else ("met" if entry["met"] else "NOT met")
        print(f"- cost, {entry['model']} / {entry['scheme']} [{entry['rotation']}]: {rot}{added}; "
              f"target <= 10% ({entry['basis']}): {met}")
    for key, value in targets(rows, float_ppl).items():
        met = "n/a" if value["met"] is None else ("met" if value["met"] else "NOT met")
        kind = "target" if value["target"] else "control (not a target)"
        numbers = ", ".join(f"{k} {pct(v)}" for k, v in value.items() if k.endswith("rise") or k.startswith("rise"))
        print(f"- {kind}: {key}: {numbers}: {met}")
    for row in rows:
        if row.tool == "llm-compressor" and row.scheme == "float" and row.rotated and row.ppl_in_process:
            base = float_ppl.get(row.model)
            change = f" ({pct(row.ppl_in_process / base - 1)} vs the float model)" if base else ""
            print(f"- {row.model} float model after llm-compressor's {row.rotation} alone (no quantizer), in its "
                  f"process: {row.ppl_in_process:.3f}{change}")
    states = {}
    for row in rows:
        if row.tool == "llm-compressor" and row.reported and row.scheme != "float":
            r = row.reported
            key = (f"{r.get('linears_quantizing_activations')} of {r.get('linears')} Linears quantize their inputs, "
                   f"status {'/'.join(r.get('quantization_status', []))}, {r.get('linear_forward_pre_hooks')} online "
                   "transform hooks")
            states.setdefault(key, []).append(f"{row.model} {row.scheme} [{row.rotation}]")
    for state, where in states.items():
        print(f"- llm-compressor in memory after oneshot: {state}: {len(where)} rows"
              + (f" ({'; '.join(where)})" if len(states) > 1 and len(where) < 8 else ""))
    for entry in route_offsets(rows):
        print(f"- evaluation routes, {entry['model']} / {entry['scheme']} llm-compressor [{entry['rotation']}]: artifact "
              f"{entry['artifact']:.3f} (quantkit eval) vs in memory {entry['in_process']:.3f} "
              f"({100 * entry['artifact_over_in_process']:+.3f}%)")
    for entry in fold_share(rows, float_ppl):
        share = entry["fold_share_of_gain"]
        print(f"- the norm fold alone, outlier / {entry['scheme']}: quantkit unrotated {pct(entry['outlier_none'])}, "
              f"norms folded (no rotation) {pct(entry['outlier_norms_folded'])}, R1+R2 {pct(entry['outlier_rotated'])}"
              + ("" if share is None else f": the fold gives {100 * share:.0f}% of the gain"))
    twins = same_as_plain(rows)
    if twins:
        print("- outlier rows equal to the plain model's, to the last digit (the norm fold undoes the outlier "
              "rescale): " + "; ".join(twins))
    for row in rows:
        if row.returncode:
            print(f"- FAILED {row.model} {row.tool} {row.scheme} [{row.rotation}] (rc {row.returncode}):\n```\n"
                  f"{row.error.strip()[-1500:]}\n```")
    for path, error in errors.items():
        print(f"- `quantkit eval` could not evaluate {path}:\n```\n{error}\n```")


def git_head() -> str:
    """This checkout's commit, and whether the quantkit that ran is its (possibly modified) tree or another copy."""
    import quantkit

    proc = subprocess.run(["git", "-C", str(harness.REPO), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    used = Path(quantkit.__file__).resolve().parent.parent
    if used != harness.REPO:
        return f"{proc.stdout.strip()[:80]} (quantkit imported from {used})"
    dirty = subprocess.run(["git", "-C", str(harness.REPO), "status", "--porcelain", "--", "quantkit"],
                           capture_output=True, text=True).stdout.strip()
    return proc.stdout.strip()[:80] + (" (quantkit/ has uncommitted changes)" if dirty else "")


def machine_facts(models: dict[str, Path], args: argparse.Namespace) -> dict:
    return {
        **harness.host_facts(), **harness.versions("torch", "transformers", "compressed-tensors"),
        "threads": args.threads, "repeats": args.repeats, "llmc": harness.llmc_versions(args.llmc_python),
        "quantkit_commit": git_head(),
        "models": {m: {"path": str(p), "parameters": harness.parameter_count(p), "training": bench.training_facts(p)}
                   for m, p in models.items()},
        "outlier": {"channels": args.outlier_channels, "factor": args.outlier_factor},
        "outlier_log": outlier_summary(models["outlier"], args.workdir) if "outlier" in models else [],
        "calibration": f"{args.num_samples} x {args.seq_len} tokens of {args.calib_data} (seed 0)",
        "eval": f"{args.eval_data}, seq_len 256, {args.eval_samples} windows",
    }


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_model_arguments(p)  # --workdir, --model, and the trained model's --hidden, --train-*
    p.add_argument("--llmc-python", type=Path, help="python of a venv with llmcompressor 0.14; without it only quantkit runs")
    p.add_argument("--only", nargs="+", metavar="RECIPE", help="only these unrotated quantkit recipes (and their rows): "
                   + " ".join(s.recipe for s in SCHEMES))
    p.add_argument("--models", nargs="+", choices=["plain", "outlier", "folded"], default=["plain", "outlier", "folded"],
                   help="folded: the outlier model with its norms folded into the Linears, quantized unrotated")
    p.add_argument("--outlier-channels", type=int, default=4, help="outlier channels per norm (make_outlier_model.py)")
    p.add_argument("--outlier-factor", type=float, default=64.0, help="their scale (a power of two is exact)")
    p.add_argument("--spinquant-nocenter", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the peer's SpinQuant with center_embeddings patched out (default: yes)")
    p.add_argument("--random-hadamard", action="store_true",
                   help="also quantkit's rows with `type: random-hadamard, seed: 0` (a user recipe file)")
    bench.add_run_arguments(p)  # --calib-data, --num-samples, --seq-len, --eval-*, --threads, --repeats
    p.add_argument("--r4", action="store_true",
                   help="add the online R4 rows: quantkit's R1+R2 and R1+R2+R4 with type random-hadamard, and "
                        "SpinQuantModifier(rotations=[R1, R2, R4], transform_type='random-hadamard'), not centred")
    p.add_argument("--peer-transforms", nargs="+", metavar="NAME",
                   help="only these of the peer's transforms (none, spinquant, spinquant-nocenter, quip, spinquant-r4)")
    p.add_argument("--learned", type=int, metavar="STEPS",
                   help="also quantkit's R1+R2 learned from the Hadamard matrices in STEPS Cayley SGD steps (SpinQuant; "
                        "llm-compressor 0.14 has no learned rotations)")
    p.add_argument("--learning-rate", type=float, default=1.5, help="the learned rows' learning rate (SpinQuant's 1.5)")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = bench.benchmark_model(args)
    models = {"plain": src, "outlier": outlier_model(src, args.workdir, args)}
    if "folded" in args.models:
        models["folded"] = folded_model(models["outlier"], args.workdir, args)
    models = {name: path for name, path in models.items() if name in args.models}
    commit = git_head()
    calib = harness.write_calibration(src, args.calib_data, args.num_samples, args.seq_len, args.workdir)
    windows = write_eval_windows(src, args)
    rows, chosen = make_rows(models, calib, windows, args)
    logs = args.workdir / "logs"
    logs.mkdir(exist_ok=True)
    run_rows(rows, args.repeats, args.threads, logs)
    float_ppl, errors = evaluate(rows, models, args)
    facts = machine_facts(models, args)
    if facts["quantkit_commit"] != commit:
        facts["quantkit_commit"] = f"{commit} at the start; {facts['quantkit_commit']} at the end"
    print_report(facts, rows, float_ppl, chosen, errors)
    if args.json:
        args.json.write_text(json.dumps({
            "machine": facts, "float_perplexity": float_ppl, "rotated_recipes": chosen,
            "rows": [{**asdict(r), "dst": str(r.dst), "ppl": r.ppl, "rise": rise(r, float_ppl),
                      "evaluated_by": r.evaluated_by, "rotate_s": rotate_seconds(r)} for r in rows],
            "comparisons": comparisons(rows, float_ppl), "cost": cost(rows), "targets": targets(rows, float_ppl),
            "route_offsets": route_offsets(rows), "outlier_rows_equal_to_plain": same_as_plain(rows),
            "norm_fold_alone": fold_share(rows, float_ppl),
            "eval_errors": errors}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
