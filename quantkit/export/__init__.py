"""Exporters: one per output format. Each turns a planned model into an in-memory quantized model
(`quantize`) and writes it as a safetensors directory plain `transformers` loads (`save`)."""

from __future__ import annotations

from types import ModuleType

from quantkit.errors import FormatError
from quantkit.registry import Format, Recipe


def exporter(fmt: Format) -> ModuleType:
    if fmt is Format.COMPRESSED_TENSORS:
        from quantkit.export import compressed_tensors as module
    else:
        from quantkit.export import torchao as module
    return module


def check_supported(recipe: Recipe, fmt: Format) -> None:
    """Refuse (before loading anything) a scheme the format cannot express, naming the format that can."""
    reason = exporter(fmt).unsupported(recipe)
    if reason is None:  # the other formats' exporters (and their imports) are only needed for the hint
        return
    others = [f.value for f in Format if f is not fmt and exporter(f).unsupported(recipe) is None]
    hint = f"; use --format {others[0]}" if others else ""
    raise FormatError(f"recipe '{recipe.name}' cannot be written as {fmt.value}: {reason}{hint}")
