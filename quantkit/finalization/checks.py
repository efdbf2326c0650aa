"""Every check `finalize` makes, in one pass before any weight is read (`prepare`), and what they decide.

A new check goes here, or, where the command line and the recipe alone decide it, in `request.check_request`, which
`prepare` calls first (the CLI too, before torch loads). `prepare` calls each in turn, cheapest first (the request:
DST, the options, the device; the format and the hardware its kernels need, the source, the QAT recipe, the model's
module tree, the dtype, the calibration data), and
returns a `Prepared`: the plan, how the model will be held (streamed or whole), the dtype. `finalize`, `--dry-run`
and `eval -q` all start with it, so the path after it reads quantize -> write.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quantkit.errors import FormatError, HardwareError, UsageError
from quantkit.export import atomic, check_supported, exporter, for_format, metadata
from quantkit.finalization.request import Request, check_request
from quantkit.models import loading as models
from quantkit.models import moe, sources
from quantkit.quant import registry
from quantkit.quant.plan import ModulePlan, coverage, plan_model
from quantkit.quant.registry import Format, Recipe
from quantkit.runtime import hardware

CHECKPOINT_EVERY = 600.0  # seconds between the resume state's checkpoints, by default: at most this much work is lost


@dataclass(frozen=True)
class CalibrationOptions:
    """Where calibration samples come from; None fields take the recipe's `calibration` defaults."""

    data: str | None = None
    num_samples: int | None = None
    seq_len: int | None = None
    seed: int = 0
    batch_size: int = 8
    device: str = "cpu"
    checkpoint_every: float = CHECKPOINT_EVERY  # seconds between the resume state's checkpoints (0: every layer)
    max_device_bytes: int | None = None  # --max-gpu-memory: the GPU memory calibration keeps within (None: what is free)
    text_field: str = "text"  # --text-field: the field (a .jsonl key, a parquet or datasets column) holding the text
    seq_len_flag: str = "--seq-len"  # the option messages name for seq_len: finalize's --seq-len, eval's --calib-seq-len

    def __post_init__(self):
        """The limits the CLI's options state (--num-samples >= 1, --seq-len >= 2), for the Python API too."""
        check_at_least("--num-samples", self.num_samples, 1)
        check_at_least(self.seq_len_flag, self.seq_len, 2)

    def sizes(self, recipe: Recipe) -> tuple[int, int]:
        """(num_samples, seq_len): the ones given, else the recipe's `calibration` defaults."""
        calibration = recipe.calibration
        return (calibration.num_samples if self.num_samples is None else self.num_samples,
                calibration.seq_len if self.seq_len is None else self.seq_len)

    def given(self) -> list[str]:
        """The calibration options given (their flags), for a recipe that reads no data to say it ignores them."""
        return [flag for flag, value in (("--calib-data", self.data), ("--num-samples", self.num_samples),
                                         (self.seq_len_flag, self.seq_len)) if value is not None]


@dataclass
class Prepared:
    src: Path
    format: Format
    plan: list[ModulePlan]
    coverage: dict | None = None  # plan.coverage: parameters quantized, tensors left in full precision and why
    calibration: dict | None = None  # filled by quantize_model for calibrated recipes: errors, timings, samples
    work_dir: Path | None = None  # calibrated finalize: where each finished layer is saved (`calibration.resume`)
    resume: bool = False  # continue the interrupted run saved in work_dir
    resumable: object | None = None  # the run's `calibration.resume.Resumable`, once calibration starts
    loading: str | None = None  # how finalize held the model: streamed layer by layer, or whole (and why)
    dtype: str = "auto"  # the dtype to quantize in (`artifact_dtype`)
    shard_bytes: int | None = None  # --max-shard-size, parsed
    rotator: object | None = None  # the recipe's rotations for this model (`quant.rotations.Rotator`)
    source_fingerprint: object | None = None  # SRC's sha256 (`models.fingerprint`), computing meanwhile: a Future
    recipe: Recipe | None = None  # the recipe that runs: a QAT model's convert step (`convert_recipe`), else the one given
    offloaded: bool = False  # the calibration hidden states wait in CPU memory (`preflight.device_plan`)
    samples: torch.Tensor | None = None  # the calibration blocks [num_samples, seq_len] the checks cut from the data
    samples_options: CalibrationOptions | None = None  # ... under these options (`samples_for` reuses them for these)

    def samples_for(self, options: CalibrationOptions) -> torch.Tensor | None:
        """The calibration blocks `prepare` cut, if it cut them under `options`."""
        return self.samples if self.samples_options == options else None


def prepare(
    src: str | Path, recipe: Recipe, fmt: Format | None = None, trust_remote_code: bool = False, force_recipe: bool = False,
    revision: str | None = None, in_memory: bool = False, *, dst: str | Path | None = None, overwrite: bool = False,
    resume: bool = False, max_shard_size: str | None = None, calibration: CalibrationOptions | None = None,
    dtype: str = "auto",
) -> Prepared:
    """Every check of a finalize, in one pass, before any weight is read: DST (when writing), the device, the
    format and the hardware its kernels need, the source (a directory or a hub id), the QAT recipe, the model
    (MoE in torchao, the KV cache, the plan), the dtype, the calibration data; and the decisions they lead to:
    the plan, whether the model streams layer by layer (`Prepared.loading`: None) or loads whole, the dtype.
    `eval -q` and `--dry-run` call it without `dst`."""
    fmt = fmt or recipe.format
    options = calibration or CalibrationOptions()
    src = sources.resolve_source(src, revision)
    shard_bytes = check_request(Request(src, recipe, fmt, None if dst is None else Path(dst), overwrite, resume,
                                        max_shard_size, dtype))
    hardware.check_device(options.device)
    check_supported(recipe, fmt)
    check_hardware(recipe, fmt)
    models.check_full_precision(src)
    trained = check_qat_recipe(src, recipe, fmt, force_recipe)
    recipe = convert_recipe(recipe, trained)
    config = models.load_config(src, trust_remote_code)
    skeleton = moe.linearize(models.meta_model(config, trust_remote_code))
    exporter(fmt).check_model(src, config, skeleton)
    plan = exporter(fmt).adapt_plan(_check_model(src, skeleton, recipe), recipe, config)
    rotator = _check_rotations(skeleton, recipe, trained)
    report = coverage(skeleton, plan, exporter(fmt).quantized_tensors(skeleton, plan, recipe))
    report["notes"] = (exporter(fmt).notes(skeleton, recipe) + unused_calibration(recipe, options) + unmatched_ignore(plan, recipe)
                       + unmatched_tensor_types(plan, recipe))
    prepared = Prepared(src=src, format=fmt, plan=plan, coverage=report, shard_bytes=shard_bytes, rotator=rotator,
                        recipe=recipe)
    prepared.loading = _whole_model_reason(src, fmt, skeleton, in_memory, rotator is not None,
                                           rotator is not None and rotator.learning is not None)
    prepared.dtype = artifact_dtype(prepared, recipe, dtype, trust_remote_code)
    if trained is not None and not force_recipe:
        check_qat_dtype(prepared, recipe, dtype, trust_remote_code)
    if recipe.needs_samples and (dst is not None or calibration is not None):
        prepared.samples = calibration_samples(src, recipe, options, trust_remote_code, config)
        prepared.samples_options = options
    if dst is not None:
        if recipe.needs_calibration:
            prepared.work_dir, prepared.resume = atomic.work_dir(Path(dst)), resume
        atomic.check_work_dir(Path(dst), resume)
    return prepared


def check_at_least(flag: str, value: int | None, least: int, otherwise: str = "") -> None:
    """A size the command's option bounds (`flag`), given through the Python API, where it is given."""
    if value is not None and value < least:
        raise UsageError(f"{flag} {value}: pass {least} or more{otherwise}")


def check_threads(threads: int | None) -> None:
    """--threads, where given, is 1 or more (None: the cores available)."""
    check_at_least("--threads", threads, 1, ", or leave it out for the cores available")


def unused_calibration(recipe: Recipe, options: CalibrationOptions) -> list[str]:
    """The summary's note for calibration options a recipe that reads no data ignores (scripts pass them to every
    recipe alike: a note, not a refusal)."""
    given = options.given()
    if recipe.needs_samples or not given:
        return []
    return [f"{recipe.name} rounds to nearest: {', '.join(given)} {'is' if len(given) == 1 else 'are'} not used"]


def _check_model(src: Path, skeleton: nn.Module, recipe: Recipe) -> list[ModulePlan]:
    """What the model's module tree allows: a KV cache scheme, a plan that quantizes something. Returns the plan."""
    if recipe.kv_cache is not None:
        from quantkit.quant import kv_cache
        kv_cache.check_model(skeleton, models.decoder_layers(skeleton))
    plan = plan_model(skeleton, recipe)
    if plan and not any(entry.quantized for entry in plan):
        raise UsageError(
            f"recipe '{recipe.name}' quantizes none of the {len(plan)} Linear modules of {src} ({plan[0].name}: {plan[0].note}); "
            "use a recipe with a smaller group size or per-channel weights"
        )
    return plan


def _check_rotations(skeleton: nn.Module, recipe: Recipe, trained: dict | None):
    """The recipe's fused rotations for this model (None without, or where QAT trained the rotated model: `trained`
    is its recipe), or a refusal: a layer a rotation would not leave computing the same, a width with no Hadamard
    matrix."""
    if not recipe.transforms:
        return None
    if (trained or {}).get("transforms") == recipe.to_dict()["transforms"]:
        return None  # QAT trained the rotated model (`training.loop.setup`): its weights are rotated already
    from quantkit.quant.rotations import Rotator  # the torchao format refused them already (`check_supported`)

    rotator = Rotator.of(recipe, skeleton.config)
    rotator.check(skeleton)
    activations = recipe.scheme.activations
    if rotator.learning is not None and activations is not None and not activations.dynamic:
        raise UsageError(f"recipe '{recipe.name}': learned rotations train against dynamic activations, and this scheme's "
                         "are static (calibrated scales); learn them with a dynamic-activation scheme, or drop `learn`")
    return rotator


def check_qat_recipe(src: Path, recipe: Recipe, fmt: Format, force: bool = False) -> dict | None:
    """A QAT-trained SRC is converted with the recipe it was trained for (another recipe needs `force`), into a
    format that keeps its trained grid exactly. Returns the QAT recipe (as quantkit.json holds it), or None for a
    model trained without QAT."""
    trained = (metadata.read(src) or {}).get("qat")
    if not trained:
        return None
    recorded, name = trained["recipe"], _trained_recipe_arg(trained["recipe"])
    trained = {**recorded, "scheme": quantized_scheme(recorded["scheme"], recipe, fmt)}
    if trained["scheme"] != recipe.to_dict()["scheme"] and not force:
        raise UsageError(
            f"{src} was trained with --qat-recipe {name}; finalize it with --quantize {name}, "
            f"or pass --force-recipe to quantize it under {recipe.name} anyway"
        )
    own = Format(recorded.get("format", fmt.value))
    if own is not fmt and not force and quantized_scheme(recorded["scheme"], recipe, own) != trained["scheme"]:
        raise FormatError(  # e.g. int4 g128 trained for compressed-tensors, written as GGUF's Q4_0 (fp16 scales, g32)
            f"{src} was trained with QAT on {name}'s grid in format {own.value}, and {fmt.value} writes another grid: "
            f"the weights would not be the trained ones; write --format {own.value}, train with a {fmt.value} recipe "
            f"(quantkit recipes list), or pass --force-recipe to accept the difference")
    if mismatch := exporter(fmt).qat_mismatch(recipe.scheme):
        keeping = [f.value for f in Format if f is not fmt and exporter(f).unsupported(recipe) is None
                   and exporter(f).qat_mismatch(recipe.scheme) is None]
        hint = f": use --format {keeping[0]}, which keeps the trained weights exactly" if keeping else ""
        raise FormatError(f"{src} was trained with QAT on the scheme's grid, which {mismatch}{hint}")
    return trained


def _trained_recipe_arg(recorded: dict) -> str:
    """What to pass as --quantize to convert a model QAT trained under `recorded` (quantkit.json's recipe): its name
    when that is the shipped recipe it trained with, else the file it was read from."""
    name, source = recorded["name"], recorded.get("source") or ""
    if name in registry.recipe_names() and registry.resolve(name).to_dict()["scheme"] == recorded["scheme"]:
        return name
    return source or name


def check_qat_dtype(prepared: Prepared, recipe: Recipe, dtype: str, trust_remote_code: bool = False) -> None:
    """A QAT model converts exactly in the dtype `--dtype auto` gives; another re-rounds the weights it trained."""
    if dtype == "auto":
        return
    exact = artifact_dtype(prepared, recipe, "auto", trust_remote_code)
    if dtype == (str(_source_dtype(prepared, trust_remote_code)).removeprefix("torch.") if exact == "auto" else exact):
        return
    raise UsageError(f"--dtype {dtype} re-rounds the weights {prepared.src} was QAT-trained in, so the artifact would "
                     "not be the trained model; leave --dtype auto to convert them exactly, or pass --force-recipe "
                     "to accept the difference")


def quantized_scheme(scheme: dict, recipe: Recipe, fmt: Format) -> dict:
    """A recorded scheme (quantkit.json's QAT recipe) as `fmt` quantizes it (`export.for_format`), the way `recipe`,
    which finalize runs, already is: a GGUF recipe's model-dtype scales are fp16 scales in either, whether training
    recorded its recipe before or after that step."""
    from dataclasses import replace

    from quantkit.grids.schemes import SchemeError

    try:
        parsed = registry.scheme_from_dict(scheme)
    except SchemeError:  # recorded by a quantkit that spelt schemes otherwise: compared as it is
        return scheme
    return for_format(replace(recipe, scheme=parsed), fmt).to_dict()["scheme"]


def unmatched_ignore(plan: list[ModulePlan], recipe: Recipe) -> list[str]:
    """A note for each `ignore` entry that leaves no Linear of this model out (a misspelt `lm_hed` quantized
    lm_head without a word)."""
    from quantkit.quant.plan import is_ignored

    return [f"ignore: {entry!r} matches no Linear of this model, so it leaves nothing in full precision"
            for entry in recipe.ignore if not any(is_ignored(module.name, (entry,)) for module in plan)]


def unmatched_tensor_types(plan: list[ModulePlan], recipe: Recipe) -> list[str]:
    """A note for each per-tensor override that matches no tensor of this model (most often a typo)."""
    from quantkit.quant import tensor_types

    tensors = [tensor_types.names_of(entry.name) for entry in plan] + [tensor_types.EMBEDDING_NAMES]
    return [f"tensor type {text} matches no tensor of this model, so it changes nothing"
            for text in tensor_types.unmatched(recipe.tensor_types, tensors)]


def convert_recipe(recipe: Recipe, trained: dict | None) -> Recipe:
    """The recipe `finalize` runs on a model QAT trained under `recipe`'s scheme (`trained`: its QAT recipe, or
    None): the convert step QAT trained for (the format's `qat_recipe`: a GGUF K recipe rounds to nearest on its
    K grids instead of running GPTQ, so the file holds the grid training saw, and needs no calibration data).
    A model trained without QAT, or forced under another scheme, is quantized by `recipe` itself."""
    if trained is None or trained["scheme"] != recipe.to_dict()["scheme"]:
        return recipe
    return exporter(recipe.format).qat_recipe(recipe)


def _whole_model_reason(src: Path, fmt: Format, skeleton: nn.Module, in_memory: bool, rotated: bool = False,
                        learned: bool = False) -> str | None:
    """Why finalize must load this model whole instead of streaming it layer by layer, or None."""
    from quantkit.models.streaming import checkpoint_keys, layout_mismatch

    if in_memory:
        return "whole model in memory (--in-memory)"
    if learned:
        return "whole model in memory: the rotations are learned on the whole model"
    if exporter(fmt).StreamWriter is None:
        return f"whole model in memory: {exporter(fmt).WHOLE_MODEL}"
    if rotated and skeleton.get_output_embeddings() is not None and \
            skeleton.get_output_embeddings().weight is skeleton.get_input_embeddings().weight:
        return "whole model in memory: the rotations untie the tied embeddings and lm_head"
    files = sources.tensor_files(src)
    reason = layout_mismatch(skeleton, files, checkpoint_keys(skeleton, files))
    return f"whole model in memory: {reason}" if reason else None


def check_calibration_data(recipe: Recipe, options: CalibrationOptions | None) -> None:
    if not ((options and options.data) or recipe.calibration.dataset):
        if recipe.kv_cache is not None and not recipe.needs_calibration_without_kv:
            raise UsageError("the KV cache's scales are measured on data: pass --calib-data FILE (a .txt/.jsonl/.parquet file or a datasets spec)")
        raise UsageError(f"recipe '{recipe.name}' calibrates on data: pass --calib-data FILE (a .txt/.jsonl/.parquet file or a datasets spec)")


def calibration_samples(src: Path, recipe: Recipe, options: CalibrationOptions, trust_remote_code: bool = False,
                        config=None) -> torch.Tensor:
    """Token blocks [num_samples, seq_len], taken deterministically from the calibration data with the tokenizer
    alone; refused in one line where there is no data, the blocks are longer than the model's positions, the data
    is not text, or it holds fewer tokens than the blocks need (`data.sample_blocks`)."""
    from quantkit import data

    check_calibration_data(recipe, options)
    num_samples, seq_len = options.sizes(recipe)
    check_seq_len(src, config or models.load_config(src, trust_remote_code), seq_len,
                  None if options.seq_len is not None else recipe.name, options.seq_len_flag)
    spec = options.data or recipe.calibration.dataset
    tokenizer = models.load_tokenizer(src, trust_remote_code, fix="calibration tokenizes its data with the model's "
                                      "own tokenizer: copy its tokenizer files (tokenizer.json, tokenizer_config.json) into SRC")
    ids = data.tokenize(tokenizer, data.load_texts(spec, options.text_field, field_advice="pass --text-field NAME"))
    return data.sample_blocks(ids, num_samples, seq_len, seed=options.seed, source=f"the calibration data {spec}",
                              seq_len_flag=options.seq_len_flag)


def check_seq_len(src: Path, config, seq_len: int, recipe_name: str | None = None, flag: str = "--seq-len") -> None:
    """Calibration blocks no longer than the model's positions (config.json's max_position_embeddings): a longer
    one computes for minutes on positions the model never learned. `recipe_name`: the length is the recipe's;
    `flag`: the option that sets it."""
    limit = models.max_positions(config)
    if limit is None or seq_len <= limit:
        return
    asked = f"recipe '{recipe_name}' calibrates on {seq_len}-token samples," if recipe_name else f"{flag} {seq_len} is"
    raise UsageError(f"{asked} longer than the {limit} positions of {src} (max_position_embeddings in config.json); "
                     f"pass {flag} {limit} or less")


def artifact_dtype(prepared: Prepared, recipe: Recipe, dtype: str, trust_remote_code: bool = False) -> str:
    """The dtype to quantize in. A format may hold the recipe's weights in one dtype only (`required_dtype`:
    torchao's FP8, FP4 and MX tensors take bfloat16). Otherwise FP4 and MX artifacts are 16-bit: compressed-tensors
    decompresses their weights to bfloat16 (a float32 model then fails in plain transformers) and vLLM's FP4 / MX
    kernels take 16-bit activations, so a float32 source becomes a bfloat16 artifact (noted in the summary)."""
    if required := exporter(prepared.format).required_dtype(recipe):
        return _required_dtype(prepared, recipe, dtype, *required, trust_remote_code)
    if not recipe.scheme.weights.sixteen_bit:
        return dtype
    if dtype == "float32":
        raise UsageError(f"recipe '{recipe.name}' writes FP4 / MX weights, which load and run in 16 bits; "
                         "pass --dtype bfloat16 (or float16), or leave --dtype auto")
    if dtype != "auto":
        return dtype
    if _source_dtype(prepared, trust_remote_code) in (torch.bfloat16, torch.float16):
        return dtype
    prepared.coverage.setdefault("notes", []).append(
        "a float32 model: the artifact is bfloat16 (FP4 / MX weights load and run in 16 bits)")
    return "bfloat16"


def _required_dtype(prepared: Prepared, recipe: Recipe, dtype: str, required: str, why: str,
                    trust_remote_code: bool) -> str:
    if dtype not in ("auto", required):
        raise UsageError(f"recipe '{recipe.name}' in format {prepared.format.value}: {why}; "
                         f"pass --dtype {required}, or leave --dtype auto")
    source = _source_dtype(prepared, trust_remote_code)
    if dtype == "auto" and source is not getattr(torch, required):
        prepared.coverage.setdefault("notes", []).append(
            f"a {str(source).removeprefix('torch.')} model: the {prepared.format.value} artifact is {required} ({why})")
    return required


def _source_dtype(prepared: Prepared, trust_remote_code: bool) -> torch.dtype:
    from quantkit.models.streaming import model_dtype

    return model_dtype(prepared.src, models.load_config(prepared.src, trust_remote_code), "auto")


# ------------------------------------------------- the hardware a recipe's kernels need in a format


def needed_capability(recipe: Recipe, fmt: Format) -> str | None:
    """The CUDA compute capability `recipe` needs in `fmt`: the recipe's `requires`, or what the format's kernels
    need for the scheme (`cuda_capability`: a user recipe without `requires` is checked too), whichever is higher."""
    needs = [need for need in (recipe.requirement(fmt).cuda_capability, exporter(fmt).cuda_capability(recipe.scheme))
             if need]
    return max(needs, key=_version) if needs else None


def _version(capability: str) -> tuple[int, ...]:
    return tuple(int(x) for x in capability.split("."))


def missing_requirement(recipe: Recipe, fmt: Format) -> str | None:
    """What this machine lacks for `recipe` in `fmt`, or None."""
    req = recipe.requirement(fmt)
    need = needed_capability(recipe, fmt)
    if need:
        have = hardware.cuda_capability()
        if have is None:
            return f"a CUDA GPU with compute capability {need}+ (this machine has no CUDA GPU)"
        if have < _version(need):
            return f"a CUDA GPU with compute capability {need}+ (this one is {have[0]}.{have[1]})"
    for package in req.packages:
        if importlib.util.find_spec(package) is None:
            return f"the '{package}' package (pip install {package})"
    return None


def check_hardware(recipe: Recipe, fmt: Format) -> None:
    """The format's kernels can run here (a CUDA capability, a package), or a one-line refusal naming a format that can."""
    missing = missing_requirement(recipe, fmt)
    if missing is None:
        return
    working = [f.value for f in Format if f is not fmt and missing_requirement(recipe, f) is None]
    hint = f"; use --format {working[0]}, which runs here" if working else ""
    raise HardwareError(f"recipe '{recipe.name}' in format {fmt.value} needs {missing}{hint}")
