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
    check_mixture_data(request.recipe)
    check_importance(request.recipe)
    return shard_bytes


# llama.cpp's types it refuses to write without an importance matrix (llama-quant.cpp: "Please do not use IQ1_S,
# IQ1_M, IQ2_S, IQ2_XXS, IQ2_XS or Q2_K_S quantization without an importance matrix")
NEEDS_IMPORTANCE = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S")


def check_importance(recipe: Recipe) -> None:
    """A type of NEEDS_IMPORTANCE, the recipe's or a per-tensor one, is refused from a recipe that reads no
    calibration data (a calibrated one without --calib-data is refused by `checks.prepare`)."""
    from quantkit.quant.tensor_types import Override

    types = [recipe.scheme.weights.codebook_type] + [Override.parse(text).type.upper() for text in recipe.tensor_types]
    needing = next((t for t in types if t in NEEDS_IMPORTANCE), None)
    if needing and not recipe.needs_calibration_without_kv:
        raise UsageError(f"llama.cpp's {needing} needs an importance matrix, and recipe '{recipe.name}' reads no data: "
                         f"use a calibrated one (gguf-{needing.lower().replace('_', '-')}) and pass --calib-data FILE")


def check_mixture_data(recipe: Recipe) -> None:
    """A llama.cpp mixture that llama.cpp refuses to write without an importance matrix (Q2_K_S) is refused from a
    recipe that reads no calibration data (a calibrated one without --calib-data is refused by `checks.prepare`)."""
    from quantkit.quant.gguf_mixtures import NEEDS_DATA

    if recipe.mixture in NEEDS_DATA and not recipe.needs_calibration_without_kv:
        raise UsageError(f"llama.cpp's {recipe.mixture} needs an importance matrix, and recipe '{recipe.name}' reads no "
                         f"data: use a calibrated one (gguf-{recipe.mixture.lower().replace('_', '-')}) and pass "
                         "--calib-data FILE")


def check_tensor_types(recipe: Recipe, fmt: Format) -> None:
    """Per-tensor types (`--tensor-type`, a recipe's `tensor_types`) are the format's: GGML types in a GGUF file,
    recipes' schemes in a compressed-tensors artifact (`float` in both); other formats take one scheme."""
    from quantkit.export import FORMATS, GGML
    from quantkit.quant.gguf_types import FLOAT
    from quantkit.quant.tensor_types import Override, is_ggml

    if not recipe.tensor_types:
        return
    kind = FORMATS[fmt].tensor_types
    if kind is None:
        raise UsageError(f"per-tensor types ({recipe.tensor_types[0]}, ...) are for --format {per_tensor_formats()}; a "
                         f"{fmt.value} artifact takes one scheme per recipe")
    for override in map(Override.parse, recipe.tensor_types):
        if kind != GGML and _recipe_too(override.type):
            continue
        if override.type != FLOAT and is_ggml(override.type) != (kind == GGML):
            holder = next(f.value for f, r in FORMATS.items() if r.tensor_types and (r.tensor_types == GGML) == is_ggml(override.type))
            raise UsageError(f"tensor type {override}: {types_of(fmt)}; {override.type} is not one (use --format {holder} "
                             "for it)")


def _recipe_too(name: str) -> bool:
    """Whether GGML type `name` is also a recipe's name whose weights are the type's grid (MXFP4: recipe `mxfp4`), so
    that a format taking recipes per tensor takes it as that recipe (the grid is the same)."""
    from quantkit.quant import gguf_types, registry
    from quantkit.quant.tensor_types import is_ggml

    if not is_ggml(name) or name == gguf_types.FLOAT:
        return False
    try:
        return registry.resolve(name.lower()).scheme.weights == gguf_types.spec(name)
    except UsageError:  # no such recipe
        return False


def per_tensor_formats() -> str:
    """The formats that hold a type per tensor, for messages."""
    from quantkit.export import FORMATS

    return " or ".join(f.value for f, registration in FORMATS.items() if registration.tensor_types)


def types_of(fmt: Format) -> str:
    """What a per-tensor type is in `fmt`, for messages."""
    from quantkit.export import FORMATS, GGML

    if FORMATS[fmt].tensor_types == GGML:
        return f"a {fmt.value} artifact holds GGML types (q4_k, q6_k, q8_0, ... or float)"
    return f"a {fmt.value} artifact takes recipes' schemes per tensor (e.g. {FORMATS[fmt].budget_candidates[-1]}, or float)"


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
