"""The sequential calibration pipeline: decoder layer by decoder layer, without tracing.

1. Capture the inputs of the first decoder layer once (the embeddings run; the layer call is intercepted).
2. For each decoder layer: move it to the compute device and run the recipe's layer steps on it
   (`calibration.steps`): the transforms (AWQ, SmoothQuant), static activation scales when the scheme has
   them, then the quantizer (RTN, GPTQ), then the KV cache scales when the recipe has them. Unless a step
   computed them on the way, run the batches through the quantized layer to make the next layer's inputs;
   move the layer back. Peak device memory is
   one layer plus the calibration activations.

Modules the plan quantizes outside the decoder layers (lm_head, where the format quantizes it: GGUF's output, MLX) come
last: an untied lm_head by the recipe's quantizer on its own inputs (the final norm of the last layer's outputs) where
the quantizer can calibrate a lone Linear (`Algorithm.calibrates_head`: GPTQ), the rest by the recipe's data-free
quantizer (RTN, HQQ) or else round to nearest. Works for models whose decoder layers `models.decoder_layers` finds.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Protocol

import torch
from torch import nn

from quantkit import data
from quantkit import algorithms
from quantkit.calibration import offload
from quantkit.calibration.experts import calibrating
from quantkit.calibration.hooks import Tail, capture_inputs, hidden_states, run_layer_last, tail_calls, with_hidden
from quantkit.calibration.layer import CalibrationResult, Layer, relative_error
from quantkit.calibration.resume import Resumable
from quantkit.calibration.steps import step_of
from quantkit.calibration.steps.kv_cache import kv_cache_step
from quantkit.calibration.steps.static_scales import static_scales_step
from quantkit.errors import CalibrationError, UnsupportedModelError, UsageError
from quantkit.models import loading as models
from quantkit.models.architectures import final_norm
from quantkit.quant import kv_cache
from quantkit.quant.plan import ModulePlan
from quantkit.quant.registry import AlgorithmStep, Recipe
from quantkit.runtime import placement
from quantkit.runtime.distributed import Context
from quantkit.runtime.precision import float32_products, model_dtype
from quantkit.runtime.progress import QUIET, Progress

Step = Callable[[Layer], "list[torch.Tensor] | None"]


def layer_steps(recipe: Recipe) -> list[Step]:
    """The steps every layer runs, in order: transforms, static scales (if the scheme has them), the quantizer,
    KV cache scales (if the recipe has them)."""
    static = recipe.scheme.activations is not None and recipe.scheme.activations.calibrated
    steps = [_bound(step) for step in recipe.before_quantizer] + ([static_scales_step] if static else [])
    return steps + [_bound(recipe.quantizer)] + ([kv_cache_step] if recipe.kv_cache is not None else [])


def _bound(step: AlgorithmStep) -> Step:
    """The registered layer step of a recipe step, with its arguments."""
    function, arguments = step_of(step.algorithm), step.arguments
    return lambda layer: function(layer, arguments)


class LayerStream(Protocol):
    """Where decoder layers come from and go to when the model is streamed (`finalize`): `load` reads a layer's
    weights before its turn (`prefetch` may have started reading it during the previous turn), `done` writes the
    finished layer and frees it (taking its qparams out of the result)."""

    def load(self, module: nn.Module) -> None: ...

    def prefetch(self, module: nn.Module) -> None:
        """Start reading `module` (the next layer) while the current one calibrates, where the stream can."""

    def done(self, module: nn.Module, prefix: str, result: CalibrationResult) -> None: ...

    def load_rest(self) -> None:
        """Read the modules outside the decoder layers (embeddings, final norm, lm_head)."""

    def release_rest(self) -> None: ...


def calibrate(model: nn.Module, plan: list[ModulePlan], recipe: Recipe, samples: torch.Tensor,
              device: torch.device, batch_size: int = 8, progress: Progress = QUIET,
              ctx: Context | None = None, resumable: Resumable | None = None,
              stream: LayerStream | None = None, offloaded: bool = False) -> CalibrationResult:
    """Quantize `model` (in CPU memory) layer by layer on `device`; its Linear weights end up dequantized.
    With a distributed `ctx`, this rank calibrates on its share of `samples` (whole batches of the same full
    sample set on every rank, `data.rank_batches`) and statistics are merged at every layer, so every rank
    ends with the same qparams. With `resumable`, every finished layer is saved to its work directory, and a
    resumed run starts at the first unfinished layer. With `stream`, the decoder layers are read before and
    handed over after their turn, and the modules outside them are read for the first layer's inputs and again
    at the end (in memory when this returns). On a CPU without native half-precision products, a bf16 / fp16
    model's Linear products run in float32 (`precision.float32_products`). `offloaded`: the calibration hidden
    states wait in CPU memory and move to `device` batch by batch (`calibration.offload`), for a model whose
    activations do not fit the device's memory budget."""
    if offloaded and recipe.quantizer.algorithm.float_reference:
        raise UsageError(f"{recipe.quantizer.name} keeps the float model's hidden states beside the quantized "
                         "ones on the device: give it the memory (--max-gpu-memory) or fewer samples (--num-samples)")
    with float32_products(model_dtype(model), device):
        return _calibrate(model, plan, recipe, samples, device, batch_size, progress, ctx, resumable, stream, offloaded)


def _calibrate(model: nn.Module, plan: list[ModulePlan], recipe: Recipe, samples: torch.Tensor, device: torch.device,
               batch_size: int, progress: Progress, ctx: Context | None, resumable: Resumable | None,
               stream: LayerStream | None, offloaded: bool) -> CalibrationResult:
    steps = layer_steps(recipe)
    result = CalibrationResult()
    by_name = {entry.name: entry for entry in plan}
    layers = models.decoder_layers(model)
    prefix = models.module_name(model, layers)
    if recipe.kv_cache is not None:
        kv_cache.check_model(model, layers)
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None and ctx.distributed else (0, 1)
    batches = [samples[i.start : i.stop] for i in data.rank_batches(samples.shape[0], batch_size, rank, world)]
    started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # allocated and reserved
    if stream is not None:
        stream.load_rest()
    inputs = capture_inputs(model, layers, batches, device, offloaded)
    if stream is not None:  # not needed again until the end: one layer is held at a time, not the layer and these
        stream.release_rest()
    result.seconds["capture"] = time.perf_counter() - started
    # quantizers tuned against the float model's hidden states (`Layer.float_hidden`) carry them along
    float_hidden = hidden_states(inputs) if recipe.quantizer.algorithm.float_reference else None
    state = resumable.open() if resumable is not None else None
    if state is not None:
        hidden, saved_float = resumable.restore(state, result, len(layers))
        restored = offload.HostBatches(device, hidden) if offloaded else [h.to(device) for h in hidden]
        inputs = with_hidden(inputs, restored)
        float_hidden = [h.to(device) for h in saved_float] if float_hidden is not None else None
    done = resumable.completed if resumable is not None else 0
    with progress.task(f"Calibrating {len(layers)} layers ({recipe.describe_algorithm()})", total=len(layers),
                       completed=done) as advance:
        for i, module in enumerate(layers):
            if stream is not None:
                with _timed(result, "read"):  # the read ahead waited for (or the read itself)
                    stream.load(module)
                if i + 1 < len(layers):
                    stream.prefetch(layers[i + 1])
            if i < done:
                resumable.restore_layer(i, module, f"{prefix}.{i}", by_name, result)
            else:
                outputs, float_hidden = _calibrate_one(i, module, f"{prefix}.{i}", inputs, float_hidden, by_name, recipe,
                                                       result, ctx, steps, device, resumable, len(layers))
                inputs = with_hidden(inputs, outputs)
                worst = max((e for n, e in result.errors.items() if n.startswith(f"{prefix}.{i}.")), default=0.0)
                advance(description=f"Calibrating layer {i + 1}/{len(layers)} (worst relative error {worst:.4f})")
            if stream is not None:
                with _timed(result, "write"):  # the layer before it waited for, if still being written
                    stream.done(module, f"{prefix}.{i}", result)
    if stream is not None:
        with _timed(result, "read"):
            stream.load_rest()
    with _timed(result, "head"):
        _quantize_the_rest(model, plan, recipe, inputs, result, prefix, ctx, device)
    result.wall_seconds = time.perf_counter() - started
    return result


@contextlib.contextmanager
def _timed(result: CalibrationResult, phase: str):
    """Add the block's wall time to `result.seconds[phase]`."""
    started = time.perf_counter()
    try:
        yield
    finally:
        result.seconds[phase] += time.perf_counter() - started


def _calibrate_one(i: int, module: nn.Module, prefix: str, inputs: list[tuple], float_hidden: list[torch.Tensor] | None,
                   by_name: dict[str, ModulePlan], recipe: Recipe, result: CalibrationResult, ctx: Context | None,
                   steps: list[Step], device: torch.device, resumable: Resumable | None,
                   num_layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Run the steps on decoder layer `i`; return its outputs (the next layer's inputs) and, when the recipe tunes
    against the float model, the float model's hidden states after it."""
    module.to(device, non_blocking=True)  # from pinned memory where the stream read it ahead (`LayerStream.prefetch`)
    layer = Layer(module, prefix, i, inputs, by_name, recipe, result, ctx, float_hidden)
    layer.release_inputs = resumable.drop_pending if resumable is not None else lambda: None
    layer.inputs_read_after_quantizer = steps[-1] is kv_cache_step
    for name, linear in layer.linears.items():
        models.check_finite(name, linear.weight.data)
    outputs = calibrate_layer(layer, steps)
    result.peak_device_bytes = max(result.peak_device_bytes, _device_bytes(module, with_hidden(inputs, outputs), device))
    if device.type == "cuda":
        result.peak_device_reserved_bytes = max(result.peak_device_reserved_bytes, torch.cuda.max_memory_reserved(device))
        result.device_outside_allocator_bytes = max(result.device_outside_allocator_bytes, outside_allocator_bytes(device))
    with _timed(result, "hand-off"):
        placement.offload_layer(module, prefix, result)  # the layer and its qparams: on the CPU for the writer and resume
        if resumable is not None:
            resumable.save_layer(i, module, prefix, result, offload.on_host(outputs), num_layers, layer.float_hidden)
    return outputs, layer.float_hidden


def calibrate_layer(layer: Layer, steps: list[Step]) -> list[torch.Tensor]:
    """Run the steps on one layer; return its outputs (the next layer's hidden states). MoE experts see every
    token meanwhile (`experts.calibrating`)."""
    outputs = None
    with calibrating(layer):
        for step in steps:
            outputs = step(layer)
        if outputs is None:
            with _timed(layer.result, "propagate"):
                outputs = run_layer_last(layer)
    check_layer(layer, outputs)
    return outputs


MAX_RELATIVE_ERROR = 1.0  # a module whose output error is as large as its output computes noise


def check_layer(layer: Layer, outputs: list[torch.Tensor]) -> None:
    """Stop the run, naming the layer or module, when quantization broke it: non-finite outputs on the
    calibration data, or a module's relative output error of MAX_RELATIVE_ERROR or more (or NaN)."""
    bad = sum(int((~torch.isfinite(out)).sum()) for out in outputs)
    if bad:
        total = sum(out.numel() for out in outputs)
        raise CalibrationError(
            f"decoder layer {layer.prefix} gives non-finite outputs on the calibration data after quantization ({bad} of "
            f"{total} values); load the model in float32 (--dtype float32) or leave the layer out (recipe `ignore`)"
        )
    for name in layer.linears:
        error = layer.result.errors.get(name, 0.0)
        if not error < MAX_RELATIVE_ERROR:
            raise CalibrationError(
                f"{name}: relative output error {error:.3g} after quantization (the error is as large as the output); "
                "leave the module out (recipe `ignore`) or use a wider scheme"
            )


def _quantize_the_rest(model: nn.Module, plan: list[ModulePlan], recipe: Recipe, inputs: list[tuple],
                       result: CalibrationResult, layers_prefix: str, ctx: Context | None, device: torch.device) -> None:
    """Quantize the planned modules outside the decoder layers (the layers' steps quantized theirs): lm_head by
    the recipe's quantizer on its inputs where it can (`_head_layer`), the others (and a tied lm_head, which is
    the token embedding too: GPTQ would fit it to the head's inputs alone) by the recipe's data-free quantizer,
    else round to nearest."""
    rest = [entry for entry in plan if entry.quantized and entry.name not in result.qweights
            and not entry.name.startswith(f"{layers_prefix}.")]
    if not rest:
        return
    quantizer = recipe.quantizer.algorithm
    head = _head_layer(model, rest, recipe, inputs, result, ctx)
    if head is not None:
        head.module.to(device)
        try:
            step_of(quantizer)(head, recipe.quantizer.arguments)
            check_layer(head, [])
        finally:
            head.module.to("cpu")  # where the model's modules outside the layers wait
    data_free = quantizer if not quantizer.needs_data else algorithms.get(algorithms.DEFAULT)
    for entry in rest:
        if entry.name not in result.qweights:
            module = model.get_submodule(entry.name)
            qweight = data_free.quantize_weight(module.weight.data, entry.scheme.weights,
                                                recipe.quantizer.arguments if data_free is quantizer else None)
            result.errors[entry.name] = relative_error(module.weight.data, qweight, None)
            module.weight.data = qweight.dequantize(module.weight.dtype)
            result.qweights[entry.name] = qweight


def _head_layer(model: nn.Module, rest: list[ModulePlan], recipe: Recipe, inputs: list[tuple],
                result: CalibrationResult, ctx: Context | None) -> Layer | None:
    """lm_head's turn as a `Layer` (the final norm and lm_head, fed the last decoder layer's outputs), or None where
    the recipe's quantizer cannot calibrate it (`Algorithm.calibrates_head`), the plan leaves it alone, it is tied
    to the token embedding, or the model has no final norm where quantkit looks."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not recipe.quantizer.algorithm.calibrates_head or head is None or not isinstance(head, nn.Linear):
        return None
    if embedding is not None and head.weight is getattr(embedding, "weight", None):
        return None
    name = models.module_name(model, head)
    if name not in {entry.name for entry in rest}:
        return None
    try:
        norm = final_norm(getattr(model, getattr(model, "base_model_prefix", "model")))
    except (UnsupportedModelError, AttributeError):
        return None
    return Layer(Tail(norm, {name: head}), "", -1, tail_calls(inputs), {entry.name: entry for entry in rest}, recipe, result, ctx)


def outside_allocator_bytes(device: torch.device) -> int:
    """The GPU's memory in use (by every process: the driver's count, as nvidia-smi's) less what torch's allocator
    has reserved now: the CUDA context, the libraries' kernels and workspaces, and anything allocated outside torch."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def _device_bytes(layer: nn.Module, inputs: list[tuple], device: torch.device) -> int:
    """Bytes of tensors held on the compute device: on a GPU, the most torch's allocator has held since calibration
    began (the temporaries of the layer's work included); elsewhere, the layer's parameters plus the calibration
    activations on the device."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    params = sum(p.numel() * p.element_size() for p in layer.parameters() if p.device == device)
    acts = sum(_tensor_bytes(item, device) for item in inputs)
    return params + acts


def _tensor_bytes(value: Any, device: torch.device) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() if value.device == device else 0
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v, device) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, device) for v in value.values())
    return 0
