"""`finalize`: turn a model directory into a quantized artifact (post-training quantization).

prepare (`checks.py`: every check, before any weight is read) -> quantize (streamed: each decoder layer read,
rounded or calibrated, and written in turn; or the whole model loaded, quantized into a `QuantizedModel`) ->
write (the format's exporter, atomically, with quantkit.json).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quantkit import algorithms
from quantkit.errors import ExportError, InterruptedRunError, QuantkitError
from quantkit.export import atomic, exporter, for_format, metadata, single_file
from quantkit.finalization.checks import CalibrationOptions, Prepared, calibration_samples, check_threads, prepare
from quantkit.models import loading as models
from quantkit.models import moe
from quantkit.models.architectures import kernel_fused_groups
from quantkit.quant.plan import ModulePlan
from quantkit.grids.qparams import QParams, fused_global_scales
from quantkit.quant.quantized_model import QuantizedModel
from quantkit.quant.registry import AlgorithmStep, Format, Recipe
from quantkit.runtime import placement
from quantkit.runtime import environment as runtime
from quantkit.runtime.progress import QUIET, Progress


@dataclass
class FinalizeResult:
    dst: Path
    recipe: Recipe
    format: Format
    plan: list[ModulePlan]
    seconds: float
    source_bytes: int
    output_bytes: int
    threads: int
    calibration: dict | None = None
    coverage: dict | None = None
    preflight: dict | None = None  # the estimate made before loading (`preflight.estimate`)
    peak_ram_bytes: int | None = None  # measured: this process's peak resident size
    loading: str | None = None  # streamed layer by layer, or the whole model in memory (and why)
    transforms: dict | None = None  # the rotations applied (`Rotator.describe`), as quantkit.json records them


def prepared_samples(prepared: Prepared, recipe: Recipe, options: CalibrationOptions, trust_remote_code: bool = False):
    """The calibration blocks `prepare` cut and checked, or, where it cut none for these options (a caller of
    `prepare` without them), the same blocks cut now; None for a recipe that reads no data."""
    if not recipe.needs_samples:
        return None
    found = prepared.samples_for(options)
    return found if found is not None else calibration_samples(prepared.src, recipe, options, trust_remote_code)


def calibration_summary(result, samples, options: CalibrationOptions, recipe: Recipe, ctx=None,
                        offloaded: bool = False) -> dict:
    """What calibration did, the same on every rank (a collective: every rank calls it)."""
    from quantkit.finalization.preflight import peak_resident_bytes
    from quantkit.runtime import distributed

    errors = result.errors
    world = ctx.world_size if ctx is not None else 1
    return {
        "ranks": world,
        "peak_rss_per_rank": distributed.all_gather_int(peak_resident_bytes(), ctx),  # bytes, up to calibration's end
        "gptq_rows_per_rank": result.gptq_rows,  # distributed GPTQ: weight rows each rank solved
        "data": options.data or recipe.calibration.dataset,
        "num_samples": samples.shape[0],
        "seq_len": samples.shape[1],
        "seed": options.seed,
        "device": options.device,
        "seconds": {phase: round(value, 3) for phase, value in result.seconds.items()},
        "wall_seconds": round(result.wall_seconds, 3),  # the phases, and what none of them counts
        **recipe.quantizer.algorithm.summary(result),  # what the quantizer reports of itself (GPTQ's column order, ...)
        "peak_device_bytes": result.peak_device_bytes,
        "peak_device_reserved_bytes": result.peak_device_reserved_bytes or None,  # GPU: the allocator's cache included
        "device_outside_allocator_bytes": result.device_outside_allocator_bytes or None,  # GPU: context, libraries
        "hidden_states": "offloaded to CPU memory" if offloaded else "on the device",  # `preflight.device_plan`
        "skipped": result.skipped,
        "routed_tokens": result.routed_tokens or None,  # MoE: tokens the router sent to each expert, all ranks
        "kv_cache": _kv_cache_summary(result.kv_ranges, recipe),
        "relative_error": {"mean": sum(errors.values()) / max(1, len(errors)), "max": max(errors.values(), default=0.0),
                           "per_module": errors},
    }


def _kv_cache_summary(ranges: dict[str, float], recipe: Recipe) -> dict | None:
    """The KV cache's scheme and the largest key and value magnitudes seen (scale = magnitude / 448)."""
    if recipe.kv_cache is None:
        return None
    keys = [v for n, v in ranges.items() if n.endswith(".k_scale")]
    values = [v for n, v in ranges.items() if n.endswith(".v_scale")]
    return {"scheme": recipe.kv_cache.describe(), "attention_modules": len(keys),
            "max_abs_key": max(keys, default=0.0), "max_abs_value": max(values, default=0.0)}


def quantize(
    prepared: Prepared, recipe: Recipe, trust_remote_code: bool = False, progress: Progress = QUIET,
    calibration: CalibrationOptions | None = None, ctx=None,
) -> QuantizedModel:
    """Load SRC and quantize it: calibrated layer by layer, or rounded to nearest module by module. With a
    distributed `ctx` (`distributed.Context`), calibration is data-parallel and every rank ends with the same model."""
    options = calibration or CalibrationOptions()
    samples = prepared_samples(prepared, recipe, options, trust_remote_code)
    plan, dtype = prepared.plan, prepared.dtype
    with progress.task(f"Quantizing ({recipe.name}, {prepared.format.value})", total=sum(e.quantized for e in plan)) as advance:
        converted = exporter(prepared.format).load_quantized(prepared.src, plan, dtype, trust_remote_code)
        if converted is not None:  # torchao: transformers converts while it loads, so its load is the quantization
            return QuantizedModel(converted, plan, recipe)
        model = moe.linearize(models.load_model(prepared.src, dtype, trust_remote_code))
        if prepared.rotator is not None:
            if prepared.rotator.learning is not None:
                _learn_rotations(model, prepared, recipe, samples, options, progress, ctx)
            prepared.rotator.rotate_model(model)
        if not recipe.needs_calibration:
            return QuantizedModel(model, plan, recipe, quantize_without_data(model, plan, recipe.quantizer, advance))
        result = _calibrate(model, prepared, recipe, samples, options, progress, ctx)
        qparams = {name: qweight.qparams for name, qweight in result.qweights.items()}
        return QuantizedModel(model, plan, recipe, qparams, result.input_scales, result.kv_scales)


def _learn_rotations(model: nn.Module, prepared: Prepared, recipe: Recipe, samples, options: CalibrationOptions,
                     progress: Progress, ctx) -> None:
    """The recipe's rotations learned on the calibration data (`calibration.learned_rotations`), or, resuming, the
    ones the interrupted run learned: its finished layers were quantized with those. Every rank keeps its own copy
    in the work directory (`learned-rotations-rank<r>.safetensors`: ranks on other machines may not share it), and
    all ranks restore, or all learn again."""
    from quantkit.calibration import learned_rotations
    from quantkit.calibration.resume import learned_rotations_file
    from quantkit.runtime import distributed

    rank = ctx.rank if ctx is not None and ctx.distributed else 0
    saved = learned_rotations_file(prepared.work_dir, rank) if prepared.work_dir is not None else None
    found = saved is not None and prepared.resume and saved.is_file()
    if all(distributed.all_gather_int(int(found), ctx)):
        learned_rotations.restore(saved, prepared.rotator)
        return
    device = placement.compute_device(options.device, ctx)
    learned_rotations.learn_rotations(model, prepared.rotator, prepared.plan, recipe, samples, device, options.batch_size,
                                      progress, ctx)
    if saved is not None:
        learned_rotations.save(saved, prepared.rotator)


def quantize_without_data(model: nn.Module, plan: list[ModulePlan], step: AlgorithmStep | None = None,
                          advance=lambda: None) -> dict[str, QParams]:
    """Each planned Linear quantized on its grid by a data-free quantizer (`step`: round to nearest by default,
    HQQ, ...); its weight becomes the dequantized grid values."""
    step = step if step is not None else AlgorithmStep(algorithms.DEFAULT)
    algorithm, args = step.algorithm, step.arguments
    qparams = {}
    nvfp4 = {e.name: model.get_submodule(e.name).weight.data for e in plan if e.quantized and e.scheme.weights.global_scale}
    global_scales = fused_global_scales(nvfp4, kernel_fused_groups(list(nvfp4)))
    with torch.no_grad():
        for entry in plan:
            if entry.quantized:
                module = model.get_submodule(entry.name)
                models.check_finite(entry.name, module.weight.data)
                qweight = algorithm.quantize_weight(module.weight.data, entry.scheme.weights, args, global_scales.get(entry.name))
                module.weight.data = qweight.dequantize(module.weight.dtype)
                qparams[entry.name] = qweight.qparams
                advance()
    return qparams


def _calibrate(model: nn.Module, prepared: Prepared, recipe: Recipe, samples, options: CalibrationOptions,
               progress: Progress, ctx, stream=None):
    from quantkit.calibration import calibrate

    device = placement.compute_device(options.device, ctx)
    if options.max_device_bytes and device.type == "cuda":
        placement.cap_device_memory(device, options.max_device_bytes)
    if prepared.work_dir is not None:
        prepared.resumable = _resumable(prepared, recipe, samples, options, ctx)
    result = calibrate(model, prepared.plan, recipe, samples, device, options.batch_size, progress, ctx, prepared.resumable,
                       stream, prepared.offloaded)
    prepared.calibration = calibration_summary(result, samples, options, recipe, ctx, prepared.offloaded)
    return result


def _resumable(prepared: Prepared, recipe: Recipe, samples, options: CalibrationOptions, ctx):
    """The run's work directory, fingerprinted by everything that decides its result."""
    import hashlib
    import json

    from quantkit.calibration import resume
    from quantkit.version import __version__

    recipe_hash = hashlib.sha256(json.dumps(recipe.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
    fingerprint = {
        "quantkit version": __version__,
        "source": f"{prepared.src} ({resume.source_identity(prepared.src)})",
        "recipe": f"{recipe.name} ({recipe_hash})",
        "format": prepared.format.value,
        "samples": f"{samples.shape[0]} x {samples.shape[1]} tokens, seed {options.seed}, batch size {options.batch_size}",
        "calibration data": f"{options.data or recipe.calibration.dataset} ({resume.samples_identity(samples)})",
        "ranks": str(ctx.world_size if ctx is not None else 1),
        "dtype": prepared.dtype,
        "device": options.device,
    }
    return resume.Resumable(prepared.work_dir, fingerprint, prepared.resume, ctx, every=options.checkpoint_every)


def quantize_model(
    prepared: Prepared, recipe: Recipe, trust_remote_code: bool = False, progress: Progress = QUIET,
    calibration: CalibrationOptions | None = None, ctx=None,
) -> nn.Module:
    """The quantized model in memory, computing exactly as the written artifact will (what `eval -q` measures)."""
    quantized = quantize(prepared, recipe, trust_remote_code, progress, calibration, ctx)
    return exporter(prepared.format).as_loaded(quantized)


def finalize(
    src: str | Path,
    dst: str | Path,
    recipe: Recipe,
    fmt: Format | None = None,
    overwrite: bool = False,
    dtype: str = "auto",
    threads: int | None = None,
    trust_remote_code: bool = False,
    force_recipe: bool = False,
    calibration: CalibrationOptions | None = None,
    progress: Progress = QUIET,
    revision: str | None = None,
    max_shard_size: str | None = None,
    resume: bool = False,
    announce=None,
    in_memory: bool = False,
) -> FinalizeResult:
    """Quantize SRC into DST. Under torchrun (WORLD_SIZE > 1) every rank runs this; calibration is data-parallel
    and only rank 0 writes, after every rank has finished calibrating. A calibrated run saves every finished
    layer beside DST (`calibration.resume`); `resume` continues an interrupted one. The model is streamed, one
    decoder layer read, quantized and written at a time (`open_streamed`), unless `in_memory` or where it
    cannot be. Before loading, the preflight estimate is checked against the free disk at DST and passed to
    `announce`."""
    from quantkit.finalization import preflight
    from quantkit.runtime import distributed

    start = time.perf_counter()
    dst = Path(dst)
    check_threads(threads)
    recipe = for_format(recipe, fmt or recipe.format)
    prepared = prepare(src, recipe, fmt, trust_remote_code, force_recipe, revision, in_memory, dst=dst, overwrite=overwrite,
                       resume=resume, max_shard_size=max_shard_size, calibration=calibration or CalibrationOptions(),
                       dtype=dtype)
    recipe = prepared.recipe  # a QAT model's convert step (`checks.convert_recipe`)
    if runtime.is_main_process():  # the writer's: hashed beside the work (0.5 GB/s: 30 s for an 8B model's weights)
        prepared.source_fingerprint = models.fingerprint_in_background(prepared.src)
    world = distributed.world_from_env()[1]
    estimate = preflight.estimate(prepared, recipe, calibration or CalibrationOptions(), world, dst, prepared.dtype)
    preflight.check_disk(estimate, dst)
    preflight.check_memory(estimate)
    preflight.check_device_budget(estimate)
    prepared.offloaded = (estimate.get("device_plan") or {}).get("mode") == "offloaded"
    if announce is not None:
        announce(estimate)
    used_threads = runtime.set_threads(threads)
    with distributed.process_group((calibration or CalibrationOptions()).device) as ctx:
        streamed = open_streamed(prepared, trust_remote_code)
        with _resumable_errors(prepared):
            if streamed is not None:
                _write_errors(dst, lambda: _stream(streamed, prepared, recipe, dst, overwrite, trust_remote_code,
                                                   progress, calibration, ctx, estimate["output_bytes"]))
            else:
                quantized = quantize(prepared, recipe, trust_remote_code, progress, calibration, ctx)
        if streamed is None:
            distributed.barrier(ctx)  # every rank succeeded: only now does rank 0 write
            if ctx.is_main:
                write_artifact(quantized, prepared, dst, overwrite, progress)
        distributed.barrier(ctx)
        if prepared.resumable is not None:
            prepared.resumable.finish()
    return FinalizeResult(
        dst=dst, recipe=recipe, format=prepared.format, plan=prepared.plan, seconds=time.perf_counter() - start,
        source_bytes=models.weights_size(prepared.src), output_bytes=_artifact_bytes(dst), threads=used_threads,
        calibration=prepared.calibration, coverage=prepared.coverage, preflight=estimate,
        peak_ram_bytes=preflight.peak_resident_bytes(), loading=prepared.loading,
        transforms=prepared.rotator.describe() if prepared.rotator is not None else None,
    )


@contextlib.contextmanager
def _resumable_errors(prepared: Prepared):
    """Keep the finished layers of an interrupted calibration for `--resume`: they are dropped when the run
    failed on its own terms (a broken layer, bad data: a rerun would fail the same way)."""
    try:
        yield
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (`errors.Terminated`)
        work = prepared.resumable
        if work is not None:
            with contextlib.suppress(Exception):  # the last finished layer's checkpoint, if the interval held it back
                work.save_pending()
        if work is None or (prepared.resume and not work.completed):
            raise
        if not work.completed:
            with contextlib.suppress(Exception):  # finished layers without a checkpoint: nothing to resume from
                work.discard()
            raise InterruptedRunError(
                f"interrupted before the run's first resume checkpoint (every {work.every:g} s, --checkpoint-every; "
                "0: after every layer); nothing was written", interrupt,
            ) from None
        raise InterruptedRunError(
            f"interrupted after {work.completed} finished layer{'' if work.completed == 1 else 's'}, saved in {work.path}; "
            "run the same command with --resume to continue from there", interrupt,
        ) from None
    except QuantkitError:
        if prepared.resumable is not None and not prepared.resume:
            prepared.resumable.finish()
        raise


# ---------------------------------------------------------------- streaming: one decoder layer in memory at a time


def open_streamed(prepared: Prepared, trust_remote_code: bool):
    """The source as a `streaming.StreamedModel` (its decoder layers still on disk), or None where finalize loads
    it whole (`prepare` said why in `prepared.loading`, or the checkpoint's shapes turn out not to be the model's)."""
    from quantkit.models.streaming import NotStreamable, StreamedModel

    if prepared.loading is not None:
        return None
    try:
        streamed = StreamedModel.open(prepared.src, prepared.dtype, trust_remote_code)
    except NotStreamable as exc:
        prepared.loading = f"whole model in memory: {exc}"
        return None
    prepared.loading = STREAMED
    return streamed


STREAMED = "streamed: one decoder layer in memory at a time"


class _LayerIO:
    """A streamed run's `calibration.pipeline.LayerStream`: a layer is read before its turn, written (rank 0)
    and freed after it. With `background` (`runtime.placement.overlaps_io`), disk work runs in two worker threads
    while a layer calibrates: the next layer is read ahead (`prefetch`) into pinned memory, so that its copy to
    the GPU does not block, and a finished layer is packed and written, one layer at most in flight (the next
    waits for it), in order. A worker's first error is raised in the calling thread, at the layer's `load`, the
    next write or `flush`."""

    def __init__(self, streamed, writer, rotator=None, background: bool = False):
        self.streamed, self.writer, self.rotator = streamed, writer, rotator
        self._worker = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="quantkit-writer")
                        if background and writer is not None else None)
        self._reader = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="quantkit-reader")
                        if background else None)
        self._pin = background and torch.cuda.is_available()
        self._in_flight: concurrent.futures.Future | None = None
        self._reading: dict[int, concurrent.futures.Future] = {}  # id(module) -> its read ahead

    def prefetch(self, module: nn.Module) -> None:
        """Start reading `module` (the next layer) in the background, when this run overlaps its disk work."""
        if self._reader is not None and id(module) not in self._reading:
            self._reading[id(module)] = self._reader.submit(self._read, module)

    def load(self, module: nn.Module) -> None:
        """`module`'s weights, read (or the read ahead waited for) and rotated by the recipe's rotations."""
        ahead = self._reading.pop(id(module), None)
        if ahead is not None:
            ahead.result()
        else:
            self._read(module)

    def _read(self, module: nn.Module) -> None:
        self.streamed.load(module)
        if self.rotator is not None:  # the recipe's rotations, as the weights are read (`quant.rotations`)
            self.rotator.rotate_layer(module)
        if self._pin:
            for tensor in [*module.parameters(), *module.buffers()]:
                tensor.data = tensor.data.pin_memory()

    def load_rest(self) -> None:
        self.streamed.load_rest()
        if self.rotator is not None:
            self.rotator.rotate_rest(self.streamed.model)

    def release_rest(self) -> None:
        self.streamed.release_rest()

    def done(self, module: nn.Module, prefix: str, result) -> None:
        """Layer `prefix` is finished: its qparams, input scales and KV cache scales leave the result with it."""
        qparams = {n: result.qweights.pop(n).qparams for n in _under(prefix, result.qweights)}
        scales = {n: result.input_scales.pop(n) for n in _under(prefix, result.input_scales)}
        kv_scales = {n: result.kv_scales.pop(n) for n in _under(prefix, result.kv_scales)}
        if self._worker is None:
            self.write([module], qparams, scales, kv_scales)
            return
        self.flush()
        self._in_flight = self._worker.submit(self._write_now, [module], qparams, scales, kv_scales)

    def write(self, modules: list[nn.Module], qparams: dict[str, QParams], scales: dict, kv_scales: dict | None = None) -> None:
        """Write `modules` now, after any layer still being written."""
        self.flush()
        self._write_now(modules, qparams, scales, kv_scales)

    def flush(self) -> None:
        """Wait for the layer being written in the background, if any; raise its error."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()

    def close(self) -> None:
        """Stop the workers once what they are reading and writing is done (an error then is the caller's to have
        raised)."""
        for worker in (self._reader, self._worker):
            if worker is not None:
                worker.shutdown(wait=True, cancel_futures=True)

    def _write_now(self, modules: list[nn.Module], qparams: dict[str, QParams], scales: dict, kv_scales: dict | None) -> None:
        if self.writer is not None:
            self.writer.add(modules, qparams, scales, kv_scales or {})
        for module in modules:
            self.streamed.release(module)


def _under(prefix: str, names) -> list[str]:
    return [name for name in names if name.startswith(f"{prefix}.")]


def _stream(streamed, prepared: Prepared, recipe: Recipe, dst: Path, overwrite: bool, trust_remote_code: bool,
            progress: Progress, calibration: CalibrationOptions | None, ctx, expected_bytes: int | None = None) -> None:
    """Quantize and write layer by layer: every rank reads each decoder layer when its turn comes; rank 0 packs
    it into the output shards (in a temporary directory renamed at the end; `expected_bytes`, the preflight's
    estimate of the output, sizes the room kept for their headers) and every rank frees it."""
    from quantkit.runtime import distributed
    from quantkit.runtime.memory import map_large_allocations

    options = calibration or CalibrationOptions()
    samples = prepared_samples(prepared, recipe, options, trust_remote_code)
    if samples is not None:
        map_large_allocations()
    plan = prepared.plan
    with contextlib.ExitStack() as stack:
        tmp = (stack.enter_context(atomic.atomic_directory(dst, overwrite, single_file(prepared.format)))
               if ctx.is_main else None)
        writer = (exporter(prepared.format).StreamWriter(streamed.model, plan, recipe, tmp, prepared.shard_bytes, expected_bytes)
                  if tmp else None)
        background = samples is not None and placement.overlaps_io(torch.device(options.device))
        layer_io = _LayerIO(streamed, writer, prepared.rotator, background)
        stack.callback(layer_io.close)  # before the output directory's own exit: nothing writes into a removed one
        if samples is None:
            rest = _round_streamed(streamed, plan, recipe, prepared, layer_io, progress)
            scales = {}
        else:
            result = _calibrate(streamed.model, prepared, recipe, samples, options, progress, ctx, layer_io)
            rest, scales = {n: q.qparams for n, q in result.qweights.items()}, result.input_scales
        distributed.barrier(ctx)  # every rank succeeded: only now does rank 0 finish the artifact
        if writer is not None:
            with progress.task(f"Writing {dst}", total=None):
                layer_io.write(streamed.rest(), rest, scales)
                _write_beside(prepared, recipe, tmp)  # first: a one-file format (GGUF) embeds the tokenizer and record
                writer.finish()


def _round_streamed(streamed, plan: list[ModulePlan], recipe: Recipe, prepared: Prepared, layer_io: _LayerIO,
                    progress: Progress) -> dict[str, QParams]:
    """The recipe's data-free quantizer decoder layer by decoder layer, each layer written as soon as it is
    quantized; returns the qparams of the planned modules outside the layers (quantized last, written with the rest)."""
    layer_prefix = f"{streamed.prefix}."
    with progress.task(f"Quantizing ({recipe.name}, {prepared.format.value})", total=sum(e.quantized for e in plan)) as advance:
        for i, module in enumerate(streamed.layers):
            layer_io.load(module)
            inside = [e for e in plan if e.name.startswith(f"{layer_prefix}{i}.")]
            layer_io.write([module], quantize_without_data(streamed.model, inside, recipe.quantizer, advance), {})
        layer_io.load_rest()
        rest = [e for e in plan if not e.name.startswith(layer_prefix)]
        return quantize_without_data(streamed.model, rest, recipe.quantizer, advance)


def dry_run(src: str | Path, recipe: Recipe, fmt: Format | None, calibration: CalibrationOptions | None,
            world_size: int, trust_remote_code: bool = False, revision: str | None = None, dst: str | Path | None = None,
            dtype: str = "auto", in_memory: bool = False) -> dict:
    """The plan without loading weights: each rank's share of the samples and of the GPTQ weight rows (blocks
    of each stacked weight sharing a Hessian), and the preflight: peak RAM and
    device memory, output and work directory size, free disk at DST, and the time one layer takes here."""
    from quantkit.finalization import preflight
    options = calibration or CalibrationOptions()
    recipe = for_format(recipe, fmt or recipe.format)
    prepared = prepare(src, recipe, fmt, trust_remote_code, revision=revision, in_memory=in_memory, dtype=dtype,
                       calibration=options)  # the calibration data checked as a run checks it
    recipe = prepared.recipe  # a QAT model's convert step (`checks.convert_recipe`)
    quantized = [e for e in prepared.plan if e.quantized]
    rows = recipe.quantizer.algorithm.rows_per_rank(_stacked_rows(quantized), world_size)
    report = preflight.estimate(prepared, recipe, options, world_size, dst, prepared.dtype, measure_time=True,
                                trust_remote_code=trust_remote_code)
    preflight.check_device_budget(report)
    report["memory_shortfall"] = preflight.memory_shortfall(report)
    return {
        "ranks": world_size,
        "samples_per_rank": report["samples_per_rank"],
        "seq_len": options.sizes(recipe)[1] if recipe.needs_calibration else None,
        "gptq_rows_per_rank": rows,
        "preflight": report,
    }


def _stacked_rows(quantized: list[ModulePlan]) -> list[int]:
    """The rows of each stack of Linears sharing an input (and so a Hessian) in each layer."""
    from quantkit.models.architectures import shared_input_leaders

    stacked: dict[str, int] = {}
    for layer in sorted({e.name.rsplit(".", 2)[0] for e in quantized}):
        entries = [e for e in quantized if e.name.rsplit(".", 2)[0] == layer]
        leaders = shared_input_leaders([e.name for e in entries])
        for entry in entries:
            stacked[leaders[entry.name]] = stacked.get(leaders[entry.name], 0) + entry.out_features
    return list(stacked.values())


def write_artifact(quantized: QuantizedModel, prepared: Prepared, dst: Path, overwrite: bool, progress: Progress) -> None:
    """The format's files, the tokenizer and quantkit.json, into DST all at once (a temporary directory renamed)."""
    def write():
        with atomic.atomic_directory(dst, overwrite, single_file(prepared.format)) as tmp:
            with progress.task(f"Writing {dst}", total=None):
                _write_beside(prepared, quantized.recipe, tmp)  # first: a one-file format embeds them
                exporter(prepared.format).write(quantized, tmp, prepared.shard_bytes)

    _write_errors(dst, write)


def _artifact_bytes(dst: Path) -> int:
    """Bytes of the written weights: the safetensors files of a directory, or the one file (GGUF)."""
    return dst.stat().st_size if dst.is_file() else models.weights_size(dst)


def _write_errors(dst: Path, write) -> None:
    """Run `write`; a full disk is a one-line error (the temporary directory is gone by then)."""
    try:
        write()
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise ExportError(f"no space left on the device while writing {dst}; nothing was written: free some space "
                          "or choose another DST") from None


def _write_beside(prepared: Prepared, recipe: Recipe, out: Path) -> None:
    """The tokenizer and quantkit.json beside the weights."""
    models.copy_tokenizer(prepared.src, out)
    found = prepared.source_fingerprint
    info = metadata.build(recipe, prepared.format, prepared.plan, prepared.src,
                          found.result() if found is not None else models.fingerprint(prepared.src))
    info["modules"]["coverage"] = prepared.coverage
    info["calibration"] = prepared.calibration
    if prepared.rotator is not None:
        info["transforms"] = {"applied": [t for t in recipe.to_dict()["transforms"]], **prepared.rotator.describe()}
    metadata.write(out, info)
