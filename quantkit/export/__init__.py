"""Exporters: one module per output format, each implementing `Exporter`. They write a `QuantizedModel`; they
never quantize (that is `finalize`'s and `calibration`'s work) and import nothing from `algorithms` or
`calibration`.

A format is a plug-in: a `Format` member (quant/registry.py: the name recipes and `--format` use), its entry in
FORMATS below (the module, and what is known without importing it), and the module itself, which defines what
`Exporter` requires and may define any of `Hooks`. Nothing outside the module branches on the format: the checks,
the preflight, QAT and the writers ask the plug-in (`exporter(fmt)`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from quantkit.errors import FormatError, UsageError
from quantkit.quant.registry import Format, Recipe

if TYPE_CHECKING:  # this package's __init__ stays light: metadata.py is read without torch
    from torch import nn

    from quantkit.quant.plan import ModulePlan
    from quantkit.quant.quantized_model import QuantizedModel
    from quantkit.quant.schemes import QuantScheme, WeightSpec


@dataclass(frozen=True)
class Registration:
    module: str  # quantkit.export.<module>, imported when the format is first used
    # the artifact is one file (a DST named with its suffix), this its name inside the temporary directory; None: a
    # directory of files. Known without importing the module: the CLI checks DST before torch is imported.
    single_file: str | None = None


FORMATS = {
    Format.COMPRESSED_TENSORS: Registration("compressed_tensors"),
    Format.TORCHAO: Registration("torchao"),
    Format.GGUF: Registration("gguf", single_file="model.gguf"),
}


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
