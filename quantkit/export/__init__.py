"""Exporters: one module per output format, each implementing `Exporter`. They write a `QuantizedModel`; they
never quantize (that is `finalize`'s and `calibration`'s work) and import nothing from `algorithms` or
`calibration`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from quantkit.errors import FormatError
from quantkit.quant.registry import Format, Recipe

if TYPE_CHECKING:  # this package's __init__ stays light: metadata.py is read without torch
    from torch import nn

    from quantkit.quant.plan import ModulePlan
    from quantkit.quant.quantized_model import QuantizedModel


class Exporter(Protocol):
    def unsupported(self, recipe: Recipe) -> str | None:
        """Why this format cannot express the recipe's scheme, or None."""

    def as_loaded(self, quantized: QuantizedModel) -> nn.Module:
        """The model computing exactly as plain transformers will compute the written artifact."""

    def weight_bytes(self, entry: ModulePlan, element_size: int) -> int:
        """Bytes a quantized Linear's weight takes in the written files (grid, scales, zero points; for
        `--dry-run`'s output size), given the bytes per element of the model's dtype."""

    def write(self, quantized: QuantizedModel, out_dir: Path, max_shard_size: int | None = None) -> None:
        """Write the weights (in safetensors shards of at most `max_shard_size` bytes, with an index file when there
        are several; default: transformers') and config.json (with `quantization_config`) into `out_dir`."""


def exporter(fmt: Format) -> Exporter:
    if fmt is Format.COMPRESSED_TENSORS:
        from quantkit.export import compressed_tensors as module
    elif fmt is Format.GGUF:
        from quantkit.export import gguf as module
    else:
        from quantkit.export import torchao as module
    return module


SINGLE_FILES = {Format.GGUF: "model.gguf"}  # formats whose artifact is one file: its name in the temporary directory


def single_file(fmt: Format) -> str | None:
    """The one file an artifact of this format is (its name inside the temporary directory), or None for a
    directory of files. Read without importing the exporter (the CLI checks DST before torch is imported)."""
    return SINGLE_FILES.get(fmt)


def for_format(recipe: Recipe, fmt: Format) -> Recipe:
    """The recipe as it quantizes for `fmt`: GGUF chooses integer grids' scales on fp16, the dtype it stores."""
    if fmt is Format.GGUF:
        from quantkit.export.gguf import for_gguf
        return for_gguf(recipe)
    return recipe


def check_destination_name(dst: Path, fmt: Format) -> None:
    """A GGUF is one file named *.gguf; a directory artifact is not named so (a user who meant GGUF forgot the
    format)."""
    from quantkit.errors import UsageError

    if fmt is Format.GGUF and Path(dst).suffix != ".gguf":
        raise UsageError(f"a GGUF artifact is one file: name DST with .gguf (e.g. {Path(dst).name}.gguf)")
    if fmt is not Format.GGUF and Path(dst).suffix == ".gguf":
        raise UsageError(f"{dst} ends in .gguf but the format is {fmt.value}: pass --format gguf (or a gguf-* recipe)")


def check_supported(recipe: Recipe, fmt: Format) -> None:
    """Refuse (before loading anything) a scheme the format cannot express, naming the format that can."""
    reason = exporter(fmt).unsupported(recipe)
    if reason is None:  # the other formats' exporters (and their imports) are only needed for the hint
        return
    others = [f.value for f in Format if f is not fmt and exporter(f).unsupported(recipe) is None]
    hint = f"; use --format {others[0]}" if others else ""
    raise FormatError(f"recipe '{recipe.name}' cannot be written as {fmt.value}: {reason}{hint}")
