"""The request check: every refusal of a finalize that the command line and the recipe decide, without torch and
without reading a weight (what the machine decides, the device and its GPUs, is `runtime.hardware`'s). The CLI calls it before torch is imported and before ranks are launched (a mistake is
reported at once); `checks.prepare` calls it first, so the Python API refuses the same things the same way. What
needs the model's config or its module tree (the format's architecture checks, the plan) comes after, in `prepare`.

The recipe itself was checked when it was read (`quant.registry`: its fields, and each algorithm's `refusal` of
the scheme); what is left is the request around it: the destination, the options, the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import UsageError
from quantkit.export import atomic, check_destination_name, single_file
from quantkit.models import sources
from quantkit.quant.registry import Format, Recipe

DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype (`models.loading.DTYPES` maps them to torch's)


@dataclass(frozen=True)
class Request:
    """A finalize as asked: SRC (resolved: a directory), DST (None: `--dry-run` and `eval -q`, which write nothing)."""

    src: Path
    recipe: Recipe
    fmt: Format
    dst: Path | None = None
    overwrite: bool = False
    resume: bool = False
    max_shard_size: str | None = None
    dtype: str = "auto"


def check_request(request: Request) -> int | None:
    """Refuse what the request decides, cheapest first; returns --max-shard-size in bytes (None: not given)."""
    if request.dst is not None:
        check_destination_name(request.dst, request.fmt)
        atomic.check_destination(request.dst, request.overwrite, single_file(request.fmt) is not None)
        atomic.check_not_source(request.dst, request.src)
    shard_bytes = check_shard_size(request.max_shard_size, request.fmt)
    check_dtype(request.dtype)
    check_tensor_types(request.recipe, request.fmt)
    return shard_bytes


def check_tensor_types(recipe: Recipe, fmt: Format) -> None:
    """Per-tensor types (`--tensor-type`, a recipe's `tensor_types`) are GGML types: a GGUF file's."""
    if recipe.tensor_types and fmt is not Format.GGUF:
        raise UsageError(f"per-tensor types ({recipe.tensor_types[0]}, ...) are GGML types, which a GGUF file holds; "
                         f"use --format gguf (a {fmt.value} artifact takes one scheme per recipe)")


def check_shard_size(max_shard_size: str | None, fmt: Format) -> int | None:
    """--max-shard-size in bytes (None: not given); refused for a one-file format, which it would not split."""
    if not max_shard_size:
        return None
    if single_file(fmt):
        raise UsageError(f"--max-shard-size applies to safetensors formats; a {fmt.value} artifact is one file: drop "
                         "--max-shard-size")
    return sources.parse_size(max_shard_size)


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
