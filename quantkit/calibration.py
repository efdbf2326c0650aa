"""The sequential calibration pipeline: decoder layer by decoder layer, without tracing.

1. Capture the inputs of the first decoder layer once (the embeddings run; the layer call is intercepted).
2. For each decoder layer: move it to the compute device; if the recipe has transforms (SmoothQuant), run
   the calibration batches through it with observers on the smoothed Linear inputs and fold the scales;
   run the batches again with observers (GPTQ Hessians, static activation ranges) on its Linear modules;
   quantize its modules; run the batches through the quantized layer to make the next layer's inputs;
   move it back. Peak device memory is one layer plus the calibration activations.

Modules the plan quantizes outside the decoder layers (rare: lm_head is ignored by default) are rounded to
nearest. Works for Llama-, Qwen2- and Mistral-style models (model.<base>.layers).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from quantkit import data, distributed
from quantkit.algorithms import get_algorithm
from quantkit.algorithms.awq import fold_scales as awq_fold
from quantkit.algorithms.awq import search_scales
from quantkit.algorithms.smoothquant import fold_scales, smoothing_scales
from quantkit.errors import UsageError
from quantkit.observers import ChannelAbsMax, ChannelAbsMean, HessianObserver, Observer, activation_observer
from quantkit.plan import ModulePlan
from quantkit.progress import QUIET, Progress
from quantkit.distributed import Context
from quantkit.qparams import QuantizedWeight, empty_quantized, fake_quantize_weight, quantize_weight
from quantkit.registry import Algorithm, Recipe


class UnsupportedModelError(UsageError):
    pass


@dataclass
class CalibrationResult:
    qweights: dict[str, QuantizedWeight] = field(default_factory=dict)
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # static activation scales
    errors: dict[str, float] = field(default_factory=dict)  # relative output error per module
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # per phase
    peak_device_bytes: int = 0
    owners: dict[str, int] = field(default_factory=dict)  # GPTQ module -> the rank that quantized it


class _Captured(Exception):
    pass


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise UnsupportedModelError(
            f"{type(model).__name__}: calibration needs decoder layers at model.{getattr(model, 'base_model_prefix', 'model')}"
            ".layers (Llama-, Qwen2-, Mistral-style models); this architecture has none there"
        )
    return layers


def capture_inputs(model: nn.Module, layers: nn.ModuleList, batches: list[torch.Tensor], device: torch.device) -> list[tuple]:
    """(args, kwargs) of the first decoder layer for each batch. Only the modules before the layers
    (embeddings, rotary embedding) visit `device`; the layers stay where they are."""
    captured: list[tuple] = []

    def hook(module, args, kwargs):
        captured.append((args, kwargs))
        raise _Captured

    base = getattr(model, model.base_model_prefix)
    front = [m for m in base.children() if m is not layers]
    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for module in front:
            module.to(device)
        for ids in batches:
            try:
                model(input_ids=ids.to(device), use_cache=False)
            except _Captured:
                pass
    finally:
        handle.remove()
        for module in front:
            module.to("cpu")
    return captured


def run_layer(layer: nn.Module, inputs: list[tuple]) -> list[torch.Tensor]:
    outputs = []
    with torch.no_grad():
        for args, kwargs in inputs:
            out = layer(*args, **kwargs)
            outputs.append(out[0] if isinstance(out, tuple) else out)
    return outputs


def with_hidden(inputs: list[tuple], hidden: list[torch.Tensor]) -> list[tuple]:
    """The captured calls with their hidden states replaced (the next layer's inputs)."""
    return [((h, *args[1:]), kwargs) if args else ((), {**kwargs, "hidden_states": h}) for (args, kwargs), h in zip(inputs, hidden)]


def observe(modules: dict[str, nn.Module], make: Callable[[], Observer], layer: nn.Module, inputs: list[tuple]) -> dict[str, Observer]:
    """Run the layer with an observer on each module's input."""
    observers = {name: make() for name in modules}
    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: observers[name].update(args[0]))
               for name, m in modules.items()]
    try:
        run_layer(layer, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return observers


def relative_error(weight: torch.Tensor, qweight: QuantizedWeight, hessian: torch.Tensor | None) -> float:
    """||(W - Q) X|| / ||W X|| through the Hessian when there is one, else on the weights."""
    delta = weight.float() - qweight.dequantize(torch.float32)
    if hessian is None:
        return (delta.norm() / weight.float().norm().clamp(min=1e-12)).item()
    num = torch.einsum("ij,jk,ik->", delta, hessian, delta)
    den = torch.einsum("ij,jk,ik->", weight.float(), hessian, weight.float())
    return (num / den.clamp(min=1e-12)).sqrt().item()


def quantize_module(name: str, module: nn.Module, entry: ModulePlan, recipe: Recipe, observer: Observer | None) -> tuple[QuantizedWeight, float]:
    step = recipe.quantizer
    weight = module.weight.data
    hessian = observer.hessian() if isinstance(observer, HessianObserver) else None
    if step.name is Algorithm.GPTQ:
        try:
            qweight = get_algorithm(Algorithm.GPTQ)(weight, hessian, entry.scheme.weights, **step.args)
        except ValueError as exc:
            raise UsageError(f"GPTQ failed on {name}: {exc}") from exc
    else:
        qweight = get_algorithm(Algorithm.RTN)(weight, entry.scheme.weights)
    error = relative_error(weight, qweight, hessian)
    module.weight.data = qweight.dequantize(weight.dtype)  # the next layer sees the quantized output
    return qweight, error


def calibrate_layer(layer: nn.Module, prefix: str, plan: dict[str, ModulePlan], recipe: Recipe,
                    inputs: list[tuple], result: CalibrationResult, ctx: Context | None = None) -> None:
    linears = {f"{prefix}.{n}": m for n, m in layer.named_modules() if f"{prefix}.{n}" in plan and plan[f"{prefix}.{n}"].quantized}
    started = time.perf_counter()
    for step in recipe.transforms:
        if step.name is Algorithm.AWQ:
            awq_layer(layer, prefix, plan, inputs, **step.args, ctx=ctx)
        else:
            smooth_layer(layer, inputs, **step.args, ctx=ctx)
    result.seconds["transforms"] += time.perf_counter() - started
    started = time.perf_counter()
    observers = _observe_for(recipe, linears, layer, inputs)
    owners = _synchronise(observers, linears, recipe, ctx)
    result.owners.update(owners)
    result.seconds["observe"] += time.perf_counter() - started
    started = time.perf_counter()
    for name, module in linears.items():
        qweight, error = _quantize_on_owner(name, module, plan[name], recipe, observers.get(name), owners.get(name), ctx)
        result.qweights[name], result.errors[name] = qweight, error
        if name in observers and hasattr(observers[name], "absmax"):
            qmax = recipe.scheme.activations.dtype.qrange[1]
            result.input_scales[name] = (observers[name].absmax() / qmax).clamp(min=torch.finfo(torch.float32).eps)
    result.seconds["quantize"] += time.perf_counter() - started


def _synchronise(observers: dict[str, Observer], linears: dict[str, nn.Module], recipe: Recipe,
                 ctx: Context | None) -> dict[str, int]:
    """Merge the ranks' statistics: GPTQ Hessians onto each module's owner (bin-packed on Hessian size),
    everything else onto every rank. Returns the owners (empty when nothing is owned)."""
    if recipe.quantizer.name is not Algorithm.GPTQ or ctx is None or not ctx.distributed:
        for observer in observers.values():
            distributed.all_reduce_observer(observer, ctx)
        return {}
    owners = distributed.assign_owners({n: m.in_features ** 2 for n, m in linears.items()}, ctx.world_size)
    for name, observer in observers.items():
        distributed.reduce_observer_to(observer, owners[name], ctx)
    return owners


def _quantize_on_owner(name: str, module: nn.Module, entry: ModulePlan, recipe: Recipe, observer: Observer | None,
                       owner: int | None, ctx: Context | None) -> tuple[QuantizedWeight, float]:
    """The owner quantizes and broadcasts qdata, scale and zero point; every rank installs the same result."""
    if owner is None or ctx is None or not ctx.distributed:
        return quantize_module(name, module, entry, recipe, observer)
    if ctx.rank == owner:
        qweight, error = quantize_module(name, module, entry, recipe, observer)
    else:
        qweight, error = empty_quantized(module.weight.data, entry.scheme.weights), 0.0
    buffers = [qweight.qdata, qweight.scale] + ([qweight.zero_point] if qweight.zero_point is not None else [])
    distributed.broadcast_(buffers, owner, ctx)
    module.weight.data = qweight.dequantize(module.weight.dtype)
    return qweight, distributed.all_reduce_sum(error, ctx)


# Which norm feeds which Linear modules, in Llama-, Qwen2- and Mistral-style decoder layers.
SMOOTHING_MAPPINGS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
)


def smooth_layer(layer: nn.Module, inputs: list[tuple], alpha: float = 0.5, ctx: Context | None = None) -> None:
    """SmoothQuant on one decoder layer: observe the normed activations (max over all ranks), fold the scales."""
    groups = {norm: [_submodule(layer, name) for name in linears] for norm, linears in SMOOTHING_MAPPINGS}
    first = {norm: linears[0] for norm, linears in groups.items()}
    observers = observe(first, ChannelAbsMax, layer, inputs)
    for observer in observers.values():
        distributed.all_reduce_observer(observer, ctx)
    for norm, linears in groups.items():
        scales = smoothing_scales(observers[norm].state["absmax"], [m.weight for m in linears], alpha)
        fold_scales(_submodule(layer, norm).weight, [m.weight for m in linears], scales)


# (the op feeding the Linear modules, the Linear modules, the block whose output measures the error)
AWQ_MAPPINGS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    ("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)


def awq_layer(layer: nn.Module, prefix: str, plan: dict[str, ModulePlan], inputs: list[tuple], grid: int = 20,
              ctx: Context | None = None) -> None:
    """AWQ on one decoder layer: for each mapping, search the scales on the block's output and fold them."""
    for prev_name, linear_names, block_name in AWQ_MAPPINGS:
        prev, block = _submodule(layer, prev_name), _submodule(layer, block_name)
        linears = [_submodule(layer, name) for name in linear_names]
        entries = [plan.get(f"{prefix}.{name}") for name in linear_names]
        if not all(e is not None and e.quantized for e in entries):
            continue  # a Linear left in full precision: nothing to protect
        if isinstance(prev, nn.Linear) and prev.out_features != linears[0].in_features:
            continue  # e.g. v_proj -> o_proj under grouped-query attention
        calls, act = _block_calls(layer, block, linears[0], inputs)
        distributed.all_reduce_observer(act, ctx)
        reference = _run_calls(block, calls)
        specs = [e.scheme.weights for e in entries]

        def error_of(scales: torch.Tensor) -> float:  # summed over every rank's tokens: the same choice on all
            return distributed.all_reduce_sum(_awq_error(block, calls, reference, linears, specs, scales), ctx)

        scales, _ = search_scales(act.mean(), error_of, grid)
        bias = prev.bias if isinstance(prev, nn.Linear) else None
        awq_fold(prev.weight, bias, [m.weight for m in linears], scales)


def _block_calls(layer: nn.Module, block: nn.Module, first: nn.Module, inputs: list[tuple]) -> tuple[list[tuple], Observer]:
    """The (args, kwargs) of every call of `block` in the layer, and mean |x| of `first`'s input."""
    calls: list[tuple] = []
    act = ChannelAbsMean()
    handles = [block.register_forward_pre_hook(lambda m, a, k: calls.append((a, k)), with_kwargs=True),
               first.register_forward_pre_hook(lambda m, a: act.update(a[0]))]
    try:
        run_layer(layer, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return calls, act


def _run_calls(block: nn.Module, calls: list[tuple]) -> list[torch.Tensor]:
    return run_layer(block, calls)


def _awq_error(block, calls, reference, linears, specs, scales) -> float:
    """Summed squared block output error with each Linear's weight scaled by s, rounded on its grid, unscaled."""
    originals = [m.weight.data for m in linears]
    try:
        for module, weight, spec in zip(linears, originals, specs):
            scaled = weight * scales.to(weight.dtype)
            module.weight.data = fake_quantize_weight(scaled, spec) / scales.to(weight.dtype)
        outputs = _run_calls(block, calls)
    finally:
        for module, weight in zip(linears, originals):
            module.weight.data = weight
    return sum(float((o.float() - r.float()).pow(2).sum()) for o, r in zip(outputs, reference))


def _submodule(layer: nn.Module, name: str) -> nn.Module:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        raise UnsupportedModelError(
            f"calibration needs {name} in each decoder layer ({type(layer).__name__} has none); "
            "supported: Llama-, Qwen2-, Mistral-style layers"
        ) from None


def _observe_for(recipe: Recipe, linears: dict[str, nn.Module], layer: nn.Module, inputs: list[tuple]) -> dict[str, Observer]:
    static = recipe.scheme.activations is not None and not recipe.scheme.activations.dynamic
    if recipe.quantizer.name is Algorithm.GPTQ:
        if static:
            raise UsageError("GPTQ with static activation scales is not supported yet; use rtn for static recipes")
        return observe(linears, HessianObserver, layer, inputs)
    if static:
        return observe(linears, activation_observer(recipe.scheme.activations.observer), layer, inputs)
    return {}


def calibrate(model: nn.Module, plan: list[ModulePlan], recipe: Recipe, samples: torch.Tensor,
              device: torch.device, batch_size: int = 8, progress: Progress = QUIET,
              ctx: Context | None = None) -> CalibrationResult:
    """Quantize `model` (in CPU memory) layer by layer on `device`; its Linear weights end up dequantized.
    With a distributed `ctx`, this rank calibrates on its share of `samples` (the same full sample set on
    every rank) and statistics are merged at every layer, so every rank ends with the same qparams."""
    if ctx is not None and ctx.distributed:
        samples = samples[data.rank_slice(samples.shape[0], ctx.rank, ctx.world_size)]
    result = CalibrationResult()
    by_name = {entry.name: entry for entry in plan}
    layers = decoder_layers(model)
    prefix = _layers_prefix(model, layers)
    batches = list(samples.split(batch_size))
    started = time.perf_counter()
    inputs = capture_inputs(model, layers, batches, device)
    result.seconds["capture"] = time.perf_counter() - started
    with progress.task(f"Calibrating {len(layers)} layers ({recipe.describe_algorithm()})", total=len(layers)) as advance:
        for i, layer in enumerate(layers):
            layer.to(device)
            calibrate_layer(layer, f"{prefix}.{i}", by_name, recipe, inputs, result, ctx)
            started = time.perf_counter()
            inputs = with_hidden(inputs, run_layer(layer, inputs))
            result.seconds["propagate"] += time.perf_counter() - started
            result.peak_device_bytes = max(result.peak_device_bytes, _device_bytes(layer, inputs, device))
            layer.to("cpu")
            worst = max((result.errors[n] for n in result.errors if n.startswith(f"{prefix}.{i}.")), default=0.0)
            advance(description=f"Calibrating layer {i + 1}/{len(layers)} (worst relative error {worst:.4f})")
    _round_the_rest(model, plan, result)
    return result


def _layers_prefix(model: nn.Module, layers: nn.ModuleList) -> str:
    return next(name for name, module in model.named_modules() if module is layers)


def _round_the_rest(model: nn.Module, plan: list[ModulePlan], result: CalibrationResult) -> None:
    for entry in plan:
        if entry.quantized and entry.name not in result.qweights:
            module = model.get_submodule(entry.name)
            qweight = quantize_weight(module.weight.data, entry.scheme.weights)
            result.errors[entry.name] = relative_error(module.weight.data, qweight, None)
            module.weight.data = qweight.dequantize(module.weight.dtype)
            result.qweights[entry.name] = qweight


def _device_bytes(layer: nn.Module, inputs: list[tuple], device: torch.device) -> int:
    """Bytes of tensors held on the compute device: the layer's parameters plus the calibration activations."""
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
