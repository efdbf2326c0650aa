"""quantkit: quantize large language models, from training to a deployable artifact.

The commands' work, from Python (a notebook, another tool); each call is what the command of the same name does:

    import quantkit

    quantkit.recipes.names()                                   # the shipped recipes
    result = quantkit.finalize("./my-model", "./my-model-w4a16", "gptq-w4a16", calib_data="train.txt", device="cuda")
    reports = quantkit.evaluate(["./my-model", "./my-model-w4a16"], data="test.txt")
    print(reports[1].perplexity.perplexity, result.output_bytes)

Errors a user can cause raise `quantkit.errors.QuantkitError` subclasses whose message says what to do. Importing
this package is cheap: torch and the model libraries are imported by the calls that need them.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from quantkit.version import __version__  # written in quantkit/version.py only
__all__ = ["__version__", "evaluate", "finalize", "recipes"]

if TYPE_CHECKING:
    from quantkit.evaluation.evaluate import ModelReport
    from quantkit.finalization.finalize import FinalizeResult
    from quantkit.quant.registry import Recipe


def finalize(
    src: str | Path,
    dst: str | Path,
    recipe: str | Path | Recipe,
    *,
    format: str | None = None,
    calib_data: str | None = None,
    text_field: str = "text",
    num_samples: int | None = None,
    seq_len: int | None = None,
    device: str = "cpu",
    overwrite: bool = False,
    dtype: str = "auto",
    threads: int | None = None,
    kv_cache: str | None = None,
    trust_remote_code: bool = False,
    progress: bool = False,
) -> FinalizeResult:
    """`quantkit finalize SRC DST -q RECIPE`: quantize the model at `src` (a directory or a hub id) under
    `recipe` (a name, a recipe file, or a `Recipe`) and write the artifact to `dst`, in one process (the
    command's `--nproc-per-node` launches ranks; under torchrun this runs as one of them). Returns what the
    command's summary shows: the plan, sizes, time, calibration statistics."""
    from quantkit.finalization.checks import CalibrationOptions
    from quantkit.finalization.finalize import finalize as run
    from quantkit.quant.registry import Format, resolve, with_kv_cache
    from quantkit.runtime.progress import QUIET, Progress

    from quantkit.errors import FormatError

    if format is not None and format not in {f.value for f in Format}:
        raise FormatError(f"format '{format}' is not one quantkit writes; use {' or '.join(f.value for f in Format)}")
    chosen = with_kv_cache(recipe if not isinstance(recipe, (str, Path)) else resolve(str(recipe)), kv_cache)
    calibration = CalibrationOptions(data=calib_data, num_samples=num_samples, seq_len=seq_len, device=device,
                                     text_field=text_field)
    return run(src, dst, chosen, Format(format) if format else None, overwrite=overwrite, dtype=dtype, threads=threads,
               trust_remote_code=trust_remote_code, calibration=calibration, progress=Progress() if progress else QUIET)


def evaluate(
    models: str | Path | Sequence[str | Path],
    data: str,
    *,
    quantize: str | Sequence[str] = (),
    seq_len: int | None = None,
    stride: int | None = None,
    max_samples: int | None = None,
    batch_size: int = 1,
    device: str = "auto",
    calib_data: str | None = None,
    threads: int | None = None,
    trust_remote_code: bool = False,
    text_field: str = "text",
    kl_divergence: bool = False,
) -> list[ModelReport]:
    """`quantkit eval MODEL ... --data DATA`: each model's perplexity on `data` (a local file or a `datasets`
    spec), and for each recipe in `quantize` (one, or several), each full-precision model quantized in memory as
    `finalize` would; one `ModelReport` per row of the command's table, in the same order. `models`: one model (a path or
    a hub id) or several; `device`: auto, as the command's, is a GPU when there is one, else the CPU; `kl_divergence`:
    every row after the first gets its `kl_divergence` from the first's next-token distributions (`--kl-divergence`)."""
    from quantkit.evaluation.evaluate import compare
    from quantkit.finalization.checks import CalibrationOptions, check_at_least, check_threads
    from quantkit.runtime.hardware import eval_device

    models = [models] if isinstance(models, (str, Path)) else list(models)
    quantize = [quantize] if isinstance(quantize, (str, Path)) else list(quantize)
    if not models:
        from quantkit.errors import UsageError

        raise UsageError("evaluate needs at least one model")
    check_at_least("--seq-len", seq_len, 2)  # eval's limits, which the command's options state
    for flag, value in (("--stride", stride), ("--max-samples", max_samples), ("--batch-size", batch_size)):
        check_at_least(flag, value, 1)
    check_threads(threads)
    device = eval_device(device)
    calibration = CalibrationOptions(data=calib_data, device=device, text_field=text_field) if calib_data else None
    return compare([str(m) for m in models], data, quantize, seq_len=seq_len, stride=stride, max_samples=max_samples,
                   batch_size=batch_size, threads=threads, trust_remote_code=trust_remote_code, calibration=calibration,
                   device=device, text_field=text_field, kl_divergence=kl_divergence)


def __getattr__(name: str):
    if name == "recipes":  # the shipped recipes' package (recipes/), imported on first use
        return importlib.import_module("quantkit.recipes")
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
