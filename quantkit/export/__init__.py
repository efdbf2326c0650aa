"""Exporters: one module per output format, each implementing `Exporter`. They write a `QuantizedModel`; they
never quantize (that is `finalize`'s and `calibration`'s work) and import nothing from `algorithms` or
`calibration`.

A format is a plug-in: a `Format` member (quant/registry.py: the name recipes and `--format` use), its entry in
FORMATS below (the module, and what is known without importing it), and the module itself, which defines what
`Exporter` requires and may define any of `Hooks`. Nothing outside the module branches on the format: the checks,
the preflight, QAT and the writers ask the plug-in (`exporter(fmt)`).

Its reading side is a second, torch-free module beside it (`<format>_reader.py`, named in its Registration): `detect`
(what `Reader` requires) and any of `ReaderHooks`: how `eval` loads it (plain transformers, with what runs around
`from_pretrained`, or the engine that runs it: llama.cpp for GGUF), whether `eval --tp` shards it, what is refused
before it loads, what eval's table says of its rows. `reader_for(path)` is the one lookup: evaluation, tensor-parallel
evaluation, `models.loading.load_model` and the CLI ask it, and name no format; a directory no format detects is read
as plain transformers reads it (`transformers_reader.py`: full precision, or quantized by another tool)."""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass
from functools import cache
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager, Protocol

from quantkit.errors import FormatError, SourceModelError, UsageError
from quantkit.quant.registry import Format, Recipe

if TYPE_CHECKING:  # this package's __init__ stays light: metadata.py is read without torch
    from torch import nn

    from quantkit.quant.plan import ModulePlan
    from quantkit.quant.quantized_model import QuantizedModel
    from quantkit.grids.schemes import QuantScheme, WeightSpec


@dataclass(frozen=True)
class Registration:
    module: str  # quantkit.export.<module>, imported when the format is first used
    # the artifact is one file (a DST named with its suffix), this its name inside the temporary directory; None: a
    # directory of files. Known without importing the module: the CLI checks DST before torch is imported.
    single_file: str | None = None
    # quantkit.export.<reader>: the torch-free module that detects and reads the format's artifacts (`Reader`); None:
    # they are read as the plain transformers directories they are
    reader: str | None = None
    # what a per-tensor type names in this format (`--tensor-type`, budget plans): GGML (a GGML type, e.g. Q6_K) or
    # RECIPE (a recipe whose scheme the tensor takes, each its own config group); None: one scheme per artifact
    tensor_types: str | None = None
    budget_candidates: tuple[str, ...] = ()  # the types a budget plan (`--target-bpw`) chooses from by default
    vectors_float32: bool = False  # 1-D tensors (norms, biases) and MoE routers are stored in float32, whatever the dtype
    # the recipe whose algorithm and calibration a budget plan uses when `-q` is not given (GPTQ on the format's grids)
    budget_recipe: str = "gguf-q4-k-m"
    # a tied token embedding is stored on lm_head's grid when lm_head takes a type of its own (MLX); else as the
    # format stores an embedding
    tied_embedding_on_output_grid: bool = False
    # the engine runs kernel-fused siblings (q/k/v, gate/up: `architectures.KERNEL_FUSED`; an MoE layer's experts) as
    # one layer of one scheme (vLLM's merged Linears): a budget plan gives them one type together
    fused_siblings_share_a_type: bool = False


GGML, RECIPE = "ggml", "recipe"  # Registration.tensor_types
FORMATS = {
    Format.COMPRESSED_TENSORS: Registration("compressed_tensors", reader="compressed_tensors_reader", tensor_types=RECIPE,
                                            budget_candidates=("gptq-w4a16", "gptq-w8a16"),
                                            fused_siblings_share_a_type=True),
    Format.TORCHAO: Registration("torchao", reader="torchao_reader"),
    Format.GGUF: Registration("gguf", single_file="model.gguf", reader="gguf_reader", tensor_types=GGML,
                              budget_candidates=("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0"), vectors_float32=True),
    Format.MLX: Registration("mlx", reader="mlx_reader", tensor_types=RECIPE,
                             budget_candidates=("mlx-3bit-g64", "mlx-4bit-g64", "mlx-5bit-g64", "mlx-6bit-g64", "mlx-8bit-g64"),
                             budget_recipe="mlx-gptq-4bit-g64", tied_embedding_on_output_grid=True),
}
PLAIN_READER = "transformers_reader"  # what no format detects: a Hugging Face directory, read by plain transformers


class Exporter(Protocol):
    """What every format module defines."""

    def unsupported(self, recipe: Recipe) -> str | None:
        """Why this format cannot express the recipe's scheme, or None."""

    def as_loaded(self, quantized: QuantizedModel) -> nn.Module:
        """The model computing exactly as plain transformers will compute the written artifact."""

    def weight_bytes(self, entry: ModulePlan, element_size: int) -> int:
        """Bytes a quantized Linear's weight takes in the written files (grid, scales, zero points; for
        `--dry-run`'s output size), given the bytes per element of the model's dtype."""

    def write(self, quantized: QuantizedModel, out_dir: Path, max_shard_size: int | None = None) -> None:
        """Write the whole quantized model into `out_dir` (safetensors formats: shards of at most `max_shard_size`
        bytes with an index file when there are several, and config.json with `quantization_config`)."""


class Hooks:
    """What a format module may define, and what holds where it does not (`exporter` fills these in)."""

    # A class that writes the model decoder layer by decoder layer as calibration or rounding finishes each:
    # StreamWriter(model, plan, recipe, out_dir, shard_bytes, expected_bytes), .add(layer_name, module), .finish().
    # Without one, finalize loads the model whole (and WHOLE_MODEL says why, in the summary).
    StreamWriter = None
    WHOLE_MODEL = "the format writes whole models"
    # The peak of a whole-model finalize, in copies of the model's bytes (the preflight's RAM estimate).
    LOAD_AND_WRITE_COPIES = 2.3

    @staticmethod
    def for_format(recipe: Recipe) -> Recipe:
        """The recipe as it quantizes for this format (GGUF: integer grids' scales chosen on fp16, as it stores them)."""
        return recipe

    @staticmethod
    def check_model(src: Path, config, skeleton: nn.Module) -> None:
        """Refuse, before any weight is read, a model this format cannot describe (an architecture, a tokenizer,
        MoE experts); `skeleton` is the model on the meta device, its experts split into Linears."""

    @staticmethod
    def adapt_plan(plan: list[ModulePlan], recipe: Recipe, config) -> list[ModulePlan]:
        """The plan as this format holds it (GGUF: a mixture's per-tensor types, llama.cpp's fallbacks)."""
        return plan

    @staticmethod
    def embedding_weights(recipe: Recipe, config) -> WeightSpec | None:
        """The grid this format quantizes the token embedding on (GGUF: a mixture's type for token_embd), which QAT
        then trains it on; None: kept in the model's dtype."""
        return None

    @staticmethod
    def quantized_tensors(skeleton: nn.Module, plan: list[ModulePlan], recipe: Recipe) -> dict[str, str]:
        """Parameters outside the plan that this format stores quantized, by name, with the type (GGUF: a mixture's
        token embedding); `plan.coverage` counts them as quantized."""
        return {}

    @staticmethod
    def notes(skeleton: nn.Module, recipe: Recipe) -> list[str]:
        """Caveats for the summary (what plain transformers cannot load of what this recipe writes, ...)."""
        return []

    @staticmethod
    def required_dtype(recipe: Recipe) -> tuple[str, str] | None:
        """(dtype, why) where this format holds the recipe's weights in one dtype only (torchao's FP8, FP4 and MX
        tensors: bfloat16), or None."""
        return None

    @staticmethod
    def cuda_capability(scheme: QuantScheme) -> str | None:
        """The CUDA compute capability this format's kernels need to write the scheme, or None."""
        return None

    @staticmethod
    def load_quantized(src: Path, plan: list[ModulePlan], dtype: str = "auto", trust_remote_code: bool = False):
        """A format whose load is its quantization (torchao: transformers converts while loading) returns the
        converted model; None: finalize quantizes the loaded model itself."""
        return None

    @staticmethod
    def qat_mismatch(scheme: QuantScheme) -> str | None:
        """Why this format's conversion would not give back the weights QAT trained on the scheme's grid, or None."""
        return None

    @staticmethod
    def qat_recipe(recipe: Recipe) -> Recipe:
        """The recipe QAT trains under and `finalize` converts a QAT model with (GGUF: a K recipe calibrated by
        GPTQ alone rounds to nearest on its K grids)."""
        return recipe


class _Plugin:
    """A format module, with `Hooks`' defaults for what it does not define."""

    def __init__(self, fmt: Format, module):
        self.format, self.module = fmt, module

    def __getattr__(self, name: str):
        found = getattr(self.module, name, None)
        return found if found is not None or not hasattr(Hooks, name) else getattr(Hooks, name)

    def __repr__(self) -> str:
        return f"<exporter {self.format.value}: {self.module.__name__}>"


@cache
def exporter(fmt: Format) -> Exporter | Hooks:
    return _Plugin(fmt, import_module(f"{__name__}.{FORMATS[fmt].module}"))


def single_file(fmt: Format) -> str | None:
    """The one file an artifact of this format is (its name inside the temporary directory), or None for a
    directory of files. Read without importing the exporter (the CLI checks DST before torch is imported)."""
    return FORMATS[fmt].single_file


def for_format(recipe: Recipe, fmt: Format) -> Recipe:
    """The recipe as it quantizes for `fmt` (`Hooks.for_format`)."""
    return exporter(fmt).for_format(recipe)


def check_destination_name(dst: Path, fmt: Format) -> None:
    """A one-file artifact is named with its suffix, in any case (model.gguf: *.gguf, *.GGUF); a directory artifact
    is not named with a one-file format's suffix (a user who meant that format forgot to say so)."""
    suffix = Path(dst).suffix.lower()
    if (name := single_file(fmt)) and suffix != Path(name).suffix:
        kind = Path(name).suffix.lstrip(".").upper()
        raise UsageError(f"a {kind} artifact is one file: name DST with {Path(name).suffix} "
                         f"(e.g. {Path(dst).name}{Path(name).suffix})")
    meant = [f for f, reg in FORMATS.items() if f is not fmt and reg.single_file and Path(reg.single_file).suffix == suffix]
    if suffix and meant and not single_file(fmt):
        raise UsageError(f"{dst} ends in {Path(dst).suffix} but the format is {fmt.value}: pass --format {meant[0].value} "
                         f"(or a {meant[0].value}-* recipe)")


def check_supported(recipe: Recipe, fmt: Format) -> None:
    """Refuse (before loading anything) a scheme the format cannot express, naming the format that can."""
    reason = exporter(fmt).unsupported(recipe)
    if reason is None:  # the other formats' exporters (and their imports) are only needed for the hint
        return
    others = [f.value for f in Format if f is not fmt and exporter(f).unsupported(recipe) is None]
    hint = f"; use --format {others[0]}" if others else ""
    raise FormatError(f"recipe '{recipe.name}' cannot be written as {fmt.value}: {reason}{hint}")


# ---------------------------------------------------------------- the reading side


class Reader(Protocol):
    """What every format's reader module defines. Reader modules import no torch at module level (the CLI detects
    each MODEL before torch loads); what they need of torch or the format's library they import when called."""

    def detect(self, path: Path) -> bool:
        """The artifact at `path` is this format's: cheap, from what the path says of itself (a directory's quantkit.json
        `format` or config.json `quant_method`, a file's suffix or first bytes); False for a path that does not exist
        (a one-file format may go by the suffix alone, and say what is wrong with the path when it is run)."""


class ReaderHooks:
    """What a reader module may define, and what holds where it does not (`reader_for` fills these in)."""

    # Where `eval` runs the artifact. None: plain transformers (`models.loading.load_model`, with `loading` and `loaded`
    # around `from_pretrained`). Else the module of quantkit.evaluation that runs it, named and not imported (evaluation
    # sits above export), torch-free at import and defining `check_options(models, tp, max_acc_drop, device)` (its
    # files among `models`, and the options they cannot take, checked before anything loads), `positions(path)` (the
    # longest window it takes or None, and where that is recorded) and `measure(label, texts, reference, seq_len=,
    # stride=, max_samples=, threads=, device=, progress=) -> ModelReport` (its perplexity on quantkit's windows,
    # `reference` the (ids, whose) the transformers rows are scored on, or None).
    ENGINE: str | None = None
    # `eval --tp` shards the format's artifacts (transformers' tensor-parallel plan); where False, `unsharded` says so.
    TENSOR_PARALLEL = True
    # The plan shards the model as transformers reads the checkpoint (`from_pretrained(..., distributed_config)`); False:
    # it is loaded whole, `before_sharding`, then sharded.
    SHARDS_WHILE_LOADING = True

    @staticmethod
    def quantized(path: Path) -> str | None:
        """What the artifact is quantized as, for the message that `eval -q` previews full-precision models only; None
        for a full-precision model. (A format's reader: the format's name.)"""

    @staticmethod
    def unsharded(path: Path) -> str | None:
        """Why `eval --tp` cannot shard the artifact (the whole message), or None. (TENSOR_PARALLEL False: its format's
        artifacts do not shard, `not_sharded`.)"""

    @staticmethod
    def check_load(path: Path) -> None:
        """Refuse, before anything of it loads, an artifact transformers cannot run (compressed-tensors' MoE experts of
        some formats)."""

    @staticmethod
    def check_device(path: Path, device: str) -> None:
        """Refuse, before its weights load, a device the artifact's kernels cannot run on (torchao's FP8 on the CPU)."""

    @staticmethod
    def loading() -> ContextManager:
        """What holds while transformers loads the artifact (compressed-tensors: its packed zero points sized right)."""
        return nullcontext()

    @staticmethod
    def loaded(model: nn.Module, path: Path) -> nn.Module:
        """The model transformers loaded, with what it ignores of the artifact restored (compressed-tensors: KV cache
        scales, online rotations)."""
        return model

    @staticmethod
    def before_sharding(model: nn.Module) -> None:
        """The whole loaded model made shardable (SHARDS_WHILE_LOADING False: compressed-tensors decompresses)."""

    @staticmethod
    def legend(runtimes: list[str], tasks: bool) -> str | None:
        """What eval's table says under it of this format's rows (how they computed, where they ran), given the
        runtimes they ran in and whether the table has task scores; None: nothing."""
        return None


class _Reading:
    """A reader module, with `ReaderHooks`' defaults for what it does not define."""

    def __init__(self, fmt: Format | None, module):
        self.format, self.module = fmt, module
        self.single_file = single_file(fmt) if fmt is not None else None  # one file, given by its path (no hub id)

    def __getattr__(self, name: str):
        found = getattr(self.module, name, None)
        return found if found is not None or not hasattr(ReaderHooks, name) else getattr(ReaderHooks, name)

    def quantized(self, path: Path) -> str | None:
        own = getattr(self.module, "quantized", None)
        return own(path) if own is not None else self.format.value

    def unsharded(self, path: Path) -> str | None:
        own = getattr(self.module, "unsharded", None)
        if own is not None:
            return own(path)
        return None if self.TENSOR_PARALLEL else not_sharded(path, self.format.value)

    def __repr__(self) -> str:
        return f"<reader {self.format.value if self.format else 'plain'}: {self.module.__name__}>"


@cache
def _reader(fmt: Format | None) -> Reader | ReaderHooks | None:
    name = PLAIN_READER if fmt is None else FORMATS[fmt].reader
    return _Reading(fmt, import_module(f"{__name__}.{name}")) if name else None


def readers() -> list[Reader | ReaderHooks]:
    """Every reader, in FORMATS' order, the plain transformers reader last."""
    return [found for found in map(_reader, [*FORMATS, None]) if found is not None]


def reader_for(path: str | Path) -> Reader | ReaderHooks:
    """The reader of the artifact at `path` (a directory, a file, or a hub id not yet resolved): the first format whose
    reader detects it, else the plain transformers reader. Torch-free."""
    return next(found for found in readers() if found.format is None or found.detect(Path(path)))


def reader_named(name: str | None) -> Reader | ReaderHooks:
    """The reader of the format a report names (`ModelReport.format`: a format, or a format and its type such as
    "gguf Q8_0"), else the plain transformers reader (None, or another tool's quant_method)."""
    first = (name or "").split(" ")[0]
    fmt = next((f for f in FORMATS if f.value == first), None)
    return _reader(fmt) or _reader(None)


def made_as(path: str | Path) -> str | None:
    """The format a model directory says it was made in: its quantkit.json `format`, else config.json's
    quantization_config `quant_method`; None for a file, a missing path or a full-precision directory. SourceModelError
    where config.json is not JSON."""
    from quantkit.export import metadata

    path = Path(path)
    if not path.is_dir():
        return None
    recorded = (metadata.read(path) or {}).get("format")
    return recorded or (config_json(path).get("quantization_config") or {}).get("quant_method")


def config_json(path: str | Path) -> dict[str, Any]:
    """A directory's config.json ({} where it has none), read without transformers."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise SourceModelError(f"{path}/config.json is not valid JSON ({exc.msg})") from exc


def not_sharded(path: str | Path, kind: str) -> str:
    """`eval --tp`'s refusal of an artifact of `kind` (a format, or another tool's quant_method), naming the format
    whose artifacts do shard."""
    sharded = next(f.value for f in FORMATS if _reader(f) is not None and _reader(f).TENSOR_PARALLEL)
    return (f"{path}: {kind} artifacts do not shard (their quantized tensors lack the operations transformers' tensor "
            f"parallelism splits them with); evaluate it without --tp, or finalize with --format {sharded}")
