"""The sequential calibration pipeline: decoder layer by decoder layer, without tracing.

1. Capture the inputs of the first decoder layer once (the embeddings run; the layer call is intercepted).
2. For each decoder layer: move it to the compute device; if the recipe has transforms (SmoothQuant, AWQ), run
   the calibration batches through it with observers on the smoothed Linear inputs and fold the scales;
   run the batches again with observers (GPTQ Hessians, static activation ranges) on its Linear modules;
   quantize its modules; run the batches through the quantized layer to make the next layer's inputs;
   move it back. Peak device memory is one layer plus the calibration activations.
   GPTQ on Llama-, Qwen2- and Mistral-style layers takes one pass instead of the observe and propagate
   passes: `true_sequential` quantizes the layer stage by stage (q/k/v, o, gate/up, down) as it runs.

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

from quantkit import data, distributed, true_sequential
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
    true_sequential: bool = False  # GPTQ ran stage by stage in one pass per layer (`true_sequential`)


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
    """Run the layer with an observer on each module's input; each batch stops as soon as every module has
    seen its input (in a decoder layer: before down_proj's matmul and the rest of the layer).

    Modules fed the very same tensor (q/k/v after the input norm, gate/up after the post-attention norm) share
    one observer, updated once per batch: their statistics are identical, so one computation (and, across
    ranks, one reduction) serves them all. `observer_groups` lists the modules of each observer."""
    observers: dict[str, Observer] = {}
    seen: dict[int, tuple[torch.Tensor, Observer]] = {}  # this batch's module inputs, by tensor identity
    done: set[str] = set()  # modules that have seen this batch

    def hook(module, args, name):
        x = args[0]
        hit = seen.get(id(x))
        shared = hit is not None and hit[0] is x
        if name not in observers:
            observers[name] = hit[1] if shared else make()
        if not (shared and hit[1] is observers[name]):  # else: this batch's input is already counted
            seen[id(x)] = (x, observers[name])
            observers[name].update(x)
        done.add(name)
        if len(done) == len(modules):
            raise _Captured  # nothing left to observe in this batch

    def new_batch(*_):
        seen.clear()
        done.clear()

    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: hook(mod, args, name)) for name, m in modules.items()]
    handles.append(layer.register_forward_pre_hook(new_batch))
    try:
        with torch.no_grad():
            for args, kwargs in inputs:
                try:
                    layer(*args, **kwargs)
                except _Captured:
                    pass
    finally:
        new_batch()
        for handle in handles:
            handle.remove()
    return {name: observers.get(name) or make() for name in modules}


def observer_groups(observers: dict[str, Observer]) -> list[list[str]]:
    """Module names grouped by shared observer, in order; the first name of a group leads it."""
    groups: dict[int, list[str]] = {}
    for name, observer in observers.items():
        groups.setdefault(id(observer), []).append(name)
    return list(groups.values())


ERROR_ROWS = 256  # output rows the Hessian-weighted error is measured on (evenly spaced): an estimate, cheap


def relative_error(weight: torch.Tensor, qweight: QuantizedWeight, hessian: torch.Tensor | None) -> float:
    """||(W - Q) X|| / ||W X|| through the Hessian (on up to ERROR_ROWS evenly spaced output rows: the exact
    value costs as much as GPTQ itself), else on the weights."""
    delta = weight.float() - qweight.dequantize(torch.float32)
    if hessian is None:
        return (delta.norm() / weight.float().norm().clamp(min=1e-12)).item()
    rows = torch.linspace(0, weight.shape[0] - 1, min(ERROR_ROWS, weight.shape[0]), device=weight.device).long()
    both = torch.cat([delta[rows], weight[rows].float()])
    num, den = ((both @ hessian) * both).sum(-1).split(len(rows))
    return (num.sum() / den.sum().clamp(min=1e-12)).sqrt().item()


def quantize_modules(names: list[str], modules: list[nn.Module], entries: list[ModulePlan], recipe: Recipe,
                     observer: Observer | None) -> list[tuple[QuantizedWeight, float]]:
    """Quantize modules that share one input (and so one observer): GPTQ runs once on their weights stacked
    row-wise (rows are independent given the Hessian, so this equals one run per module, for a third of the
    per-column work on q/k/v); RTN rounds each. Returns (qweight, relative error) per module and leaves each
    module's weight dequantized (the next layer sees the quantized output)."""
    step = recipe.quantizer
    hessian = observer.hessian() if isinstance(observer, HessianObserver) else None
    weights = [m.weight.data for m in modules]
    if step.name is Algorithm.GPTQ:
        qweights = _gptq_stacked(names, weights, entries, hessian, step.args)
    else:
        qweights = [get_algorithm(Algorithm.RTN)(w, e.scheme.weights) for w, e in zip(weights, entries)]
    results = []
    for module, weight, qweight in zip(modules, weights, qweights):
        results.append((qweight, relative_error(weight, qweight, hessian)))
        module.weight.data = qweight.dequantize(weight.dtype)
    return results


def _gptq_stacked(names, weights, entries, hessian, args) -> list[QuantizedWeight]:
    specs = {e.scheme.weights for e in entries}
    if len(specs) > 1 or len({w.dtype for w in weights}) > 1:  # not one grid: one run each
        return [q for n, w, e in zip(names, weights, entries) for q in _gptq_stacked([n], [w], [e], hessian, args)]
    try:
        stacked = get_algorithm(Algorithm.GPTQ)(torch.cat(weights), hessian, entries[0].scheme.weights, **args)
    except ValueError as exc:
        raise UsageError(f"GPTQ failed on {', '.join(names)}: {exc}") from exc
    return split_rows(stacked, [w.shape[0] for w in weights])


def split_rows(qweight: QuantizedWeight, rows: list[int]) -> list[QuantizedWeight]:
    """A row-stacked QuantizedWeight cut back into its modules' (qdata, scale and zero point are per row)."""
    parts = [t.split(rows) if t is not None else [None] * len(rows) for t in (qweight.qdata, qweight.scale, qweight.zero_point)]
    return [QuantizedWeight(q.contiguous(), s.contiguous(), z.contiguous() if z is not None else None, qweight.spec)
            for q, s, z in zip(*parts)]


def calibrate_layer(layer: nn.Module, prefix: str, plan: dict[str, ModulePlan], recipe: Recipe,
                    inputs: list[tuple], result: CalibrationResult, ctx: Context | None = None,
                    stages: bool = False) -> list[torch.Tensor] | None:
    """Transform, observe and quantize one decoder layer. With `stages` (GPTQ on a layer `true_sequential`
    handles), the layer is quantized in one staged pass and its outputs are returned; otherwise None (the
    caller runs the quantized layer to make the next layer's inputs)."""
    linears = {f"{prefix}.{n}": m for n, m in layer.named_modules() if f"{prefix}.{n}" in plan and plan[f"{prefix}.{n}"].quantized}
    started = time.perf_counter()
    for step in recipe.transforms:
        if step.name is Algorithm.AWQ:
            awq_layer(layer, prefix, plan, inputs, **step.args, ctx=ctx)
        else:
            smooth_layer(layer, inputs, **step.args, ctx=ctx)
    result.seconds["transforms"] += time.perf_counter() - started
    if stages:
        return _calibrate_stages(layer, prefix, plan, linears, recipe, inputs, result, ctx)
    started = time.perf_counter()
    observers = _observe_for(recipe, linears, layer, inputs)
    owners = _synchronise(observers, linears, recipe, ctx)
    result.owners.update(owners)
    result.seconds["observe"] += time.perf_counter() - started
    started = time.perf_counter()
    for names in observer_groups(observers) if observers else [[name] for name in linears]:
        quantized = _quantize_on_owner(names, [linears[n] for n in names], [plan[n] for n in names], recipe,
                                       observers.get(names[0]), owners.get(names[0]), ctx)
        for name, (qweight, error) in zip(names, quantized):
            result.qweights[name], result.errors[name] = qweight, error
    for name in linears:
        if name in observers and hasattr(observers[name], "absmax"):
            qmax = recipe.scheme.activations.dtype.qrange[1]
            result.input_scales[name] = (observers[name].absmax() / qmax).clamp(min=torch.finfo(torch.float32).eps)
    result.seconds["quantize"] += time.perf_counter() - started
    return None


def _calibrate_stages(layer: nn.Module, prefix: str, plan: dict[str, ModulePlan], linears: dict[str, nn.Module],
                      recipe: Recipe, inputs: list[tuple], result: CalibrationResult, ctx: Context | None) -> list[torch.Tensor]:
    """GPTQ in one pass (`true_sequential.run_stages`): each stage's Hessian is summed over this rank's batches,
    reduced to the stage's owner, and the owner's result is broadcast before the next stage runs."""
    distributed_run = ctx is not None and ctx.distributed
    shapes = {name: (m.in_features, m.out_features) for name, m in linears.items()}
    owners = gptq_owners(shapes, shared_input_leaders(list(linears)), ctx.world_size) if distributed_run else {}
    result.owners.update(owners)
    started = time.perf_counter()
    spent = {"observe": 0.0, "quantize": 0.0}

    def quantize(stage: tuple[str, ...], stage_inputs: list[torch.Tensor]) -> None:
        names = [f"{prefix}.{n}" for n in stage if f"{prefix}.{n}" in linears]
        if not names:
            return
        began = time.perf_counter()
        observer = HessianObserver()
        for x in stage_inputs:
            observer.update(x)
        owner = owners.get(names[0])
        if distributed_run:
            distributed.reduce_observer_to(observer, owner, ctx)
        mid = time.perf_counter()
        quantized = _quantize_on_owner(names, [linears[n] for n in names], [plan[n] for n in names], recipe,
                                       observer, owner, ctx)
        for name, (qweight, error) in zip(names, quantized):
            result.qweights[name], result.errors[name] = qweight, error
        spent["observe"] += mid - began
        spent["quantize"] += time.perf_counter() - mid

    outputs = true_sequential.run_stages(layer, [true_sequential.split_call(a, k) for a, k in inputs], quantize)
    result.seconds["observe"] += spent["observe"]
    result.seconds["quantize"] += spent["quantize"]
    result.seconds["forward"] += time.perf_counter() - started - spent["observe"] - spent["quantize"]
    return outputs


def uses_stages(recipe: Recipe, layer: nn.Module, inputs: list[tuple]) -> bool:
    """Whether GPTQ can run on this model's layers in one staged pass (`true_sequential`): a GPTQ recipe, a layer
    with the Llama-style parts, and a staged computation that reproduces the layer's forward exactly."""
    if recipe.quantizer.name is not Algorithm.GPTQ or not true_sequential.has_stages(layer) or not inputs:
        return False
    calls = [true_sequential.split_call(a, k) for a, k in inputs]
    return all(c is not None for c in calls) and true_sequential.matches_layer(layer, calls[0])


def _synchronise(observers: dict[str, Observer], linears: dict[str, nn.Module], recipe: Recipe,
                 ctx: Context | None) -> dict[str, int]:
    """Merge the ranks' statistics: GPTQ Hessians onto an owner rank (bin-packed on GPTQ work), everything
    else onto every rank. Modules sharing a Hessian share its owner. Returns the owners (empty when nothing
    is owned)."""
    groups = observer_groups(observers)
    if recipe.quantizer.name is not Algorithm.GPTQ or ctx is None or not ctx.distributed:
        for names in groups:
            distributed.all_reduce_observer(observers[names[0]], ctx)
        return {}
    leaders = {name: names[0] for names in groups for name in names}
    owners = gptq_owners({name: (m.in_features, m.out_features) for name, m in linears.items()}, leaders, ctx.world_size)
    for names in groups:
        distributed.reduce_observer_to(observers[names[0]], owners[names[0]], ctx)
    return owners


def gptq_owners(shapes: dict[str, tuple[int, int]], leaders: dict[str, str], world_size: int) -> dict[str, int]:
    """The rank that runs GPTQ for each module (`shapes`: name -> (in, out); `leaders`: name -> the first module
    sharing its Hessian). Modules sharing a Hessian go to one owner, bin-packed on GPTQ work: the inverse
    (in^3) plus each module's column updates (out * in^2)."""
    work: dict[str, int] = defaultdict(int)
    for name, (size, out) in shapes.items():
        work[leaders[name]] += out * size ** 2 + (size ** 3 if leaders[name] == name else 0)
    by_leader = distributed.assign_owners(dict(work), world_size)
    return {name: by_leader[leaders[name]] for name in shapes}


def shared_input_leaders(names: list[str]) -> dict[str, str]:
    """For a plan's module names, the first module of its input-sharing group (q/k/v; gate/up; itself
    otherwise), as `observe` finds them at run time on Llama-, Qwen2- and Mistral-style layers and as
    `true_sequential` stages them; `--dry-run` plans with this."""
    present = set(names)
    leaders = {name: name for name in names}
    for layer in {name.rsplit(".", 2)[0] for name in names}:
        for stage in true_sequential.STAGES:
            members = [f"{layer}.{n}" for n in stage if f"{layer}.{n}" in present]
            for name in members:
                leaders[name] = members[0]
    return leaders


def _quantize_on_owner(names: list[str], modules: list[nn.Module], entries: list[ModulePlan], recipe: Recipe,
                       observer: Observer | None, owner: int | None, ctx: Context | None) -> list[tuple[QuantizedWeight, float]]:
    """The owner quantizes and broadcasts qdata, scale and zero point; every rank installs the same result."""
    if owner is None or ctx is None or not ctx.distributed:
        return quantize_modules(names, modules, entries, recipe, observer)
    if ctx.rank == owner:
        results = quantize_modules(names, modules, entries, recipe, observer)
    else:
        results = [(empty_quantized(m.weight.data, e.scheme.weights), 0.0) for m, e in zip(modules, entries)]
    installed = []
    for module, (qweight, error) in zip(modules, results):
        buffers = [qweight.qdata, qweight.scale] + ([qweight.zero_point] if qweight.zero_point is not None else [])
        distributed.broadcast_(buffers, owner, ctx)
        module.weight.data = qweight.dequantize(module.weight.dtype)
        installed.append((qweight, distributed.all_reduce_sum(error, ctx)))
    return installed


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
    """AWQ on one decoder layer: for each mapping, search the scales on the block's output and fold them.

    One pass over the layer captures every mapping's block calls and activation statistic (folding a mapping's
    scales leaves the float function, so the later blocks' inputs, unchanged). A block that is one Linear
    (o_proj, down_proj) is scored through its input Hessian, sum ||(W' - W) x||^2 = tr(dW H dW^T), instead of
    running it on every token for every candidate."""
    mappings = []
    for prev_name, linear_names, block_name in AWQ_MAPPINGS:
        prev, block = _submodule(layer, prev_name), _submodule(layer, block_name)
        linears = [_submodule(layer, name) for name in linear_names]
        entries = [plan.get(f"{prefix}.{name}") for name in linear_names]
        if not all(e is not None and e.quantized for e in entries):
            continue  # a Linear left in full precision: nothing to protect
        if isinstance(prev, nn.Linear) and prev.out_features != linears[0].in_features:
            continue  # e.g. v_proj -> o_proj under grouped-query attention
        mappings.append((prev, block, linears, [e.scheme.weights for e in entries]))
    captured = _capture_blocks(layer, [(block, linears[0]) for _, block, linears, _ in mappings], inputs)
    for (prev, block, linears, specs), (calls, act) in zip(mappings, captured):
        distributed.all_reduce_observer(act, ctx)
        if len(linears) == 1 and block is linears[0]:
            hessian = HessianObserver()
            for args, _ in calls:
                hessian.update(args[0])
            distributed.all_reduce_observer(hessian, ctx)  # every rank then scores every candidate the same
            xtx = hessian.state["xtx"].float()

            def error_of(scales: torch.Tensor, xtx=xtx, linear=linears[0], spec=specs[0]) -> float:
                return _awq_hessian_error(linear, spec, scales, xtx)
        else:
            reference = _run_calls(block, calls)

            def error_of(scales: torch.Tensor) -> float:  # summed over every rank's tokens: the same choice on all
                return distributed.all_reduce_sum(_awq_error(block, calls, reference, linears, specs, scales), ctx)

        scales, _ = search_scales(act.mean(), error_of, grid)
        bias = prev.bias if isinstance(prev, nn.Linear) else None
        awq_fold(prev.weight, bias, [m.weight for m in linears], scales)


def _capture_blocks(layer: nn.Module, blocks: list[tuple[nn.Module, nn.Module]], inputs: list[tuple]) -> list[tuple[list[tuple], Observer]]:
    """For each (block, its first Linear): the (args, kwargs) of every call of the block, and mean |x| of the
    Linear's input, from one run of the layer."""
    captured = [([], ChannelAbsMean()) for _ in blocks]
    handles = []
    for (block, first), (calls, act) in zip(blocks, captured):
        handles.append(block.register_forward_pre_hook(lambda m, a, k, calls=calls: calls.append((a, k)), with_kwargs=True))
        handles.append(first.register_forward_pre_hook(lambda m, a, act=act: act.update(a[0])))
    try:
        run_layer(layer, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _run_calls(block: nn.Module, calls: list[tuple]) -> list[torch.Tensor]:
    return run_layer(block, calls)


def _awq_error(block, calls, reference, linears, specs, scales) -> float:
    """Summed squared block output error with each Linear's weight scaled by s, rounded on its grid, unscaled."""
    originals = [m.weight.data for m in linears]
    try:
        for module, weight, spec in zip(linears, originals, specs):
            module.weight.data = _awq_candidate(weight, spec, scales)
        outputs = _run_calls(block, calls)
    finally:
        for module, weight in zip(linears, originals):
            module.weight.data = weight
    return sum(float((o.float() - r.float()).pow(2).sum()) for o, r in zip(outputs, reference))


def _awq_hessian_error(linear: nn.Module, spec, scales: torch.Tensor, xtx: torch.Tensor) -> float:
    """The same summed squared output error for a lone Linear, through sum x x^T: tr(dW H dW^T)."""
    weight = linear.weight.data
    delta = _awq_candidate(weight, spec, scales).float() - weight.float()
    return float(((delta @ xtx) * delta).sum(dtype=torch.float64))


def _awq_candidate(weight: torch.Tensor, spec, scales: torch.Tensor) -> torch.Tensor:
    scaled = weight * scales.to(weight.dtype)
    return fake_quantize_weight(scaled, spec) / scales.to(weight.dtype)


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
    With a distributed `ctx`, this rank calibrates on its share of `samples` (whole batches of the same full
    sample set on every rank, `data.rank_batches`) and statistics are merged at every layer, so every rank ends with the same qparams."""
    result = CalibrationResult()
    by_name = {entry.name: entry for entry in plan}
    layers = decoder_layers(model)
    prefix = _layers_prefix(model, layers)
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None and ctx.distributed else (0, 1)
    batches = [samples[i.start : i.stop] for i in data.rank_batches(samples.shape[0], batch_size, rank, world)]
    started = time.perf_counter()
    inputs = capture_inputs(model, layers, batches, device)
    result.seconds["capture"] = time.perf_counter() - started
    with progress.task(f"Calibrating {len(layers)} layers ({recipe.describe_algorithm()})", total=len(layers)) as advance:
        stages = False
        for i, layer in enumerate(layers):
            layer.to(device)
            if i == 0:  # every rank must take the same path
                stages = distributed.all_reduce_sum(float(uses_stages(recipe, layer, inputs)), ctx) == (ctx.world_size if ctx else 1)
                result.true_sequential = stages
            outputs = calibrate_layer(layer, f"{prefix}.{i}", by_name, recipe, inputs, result, ctx, stages)
            if outputs is None:
                started = time.perf_counter()
                outputs = run_layer(layer, inputs)
                result.seconds["propagate"] += time.perf_counter() - started
            inputs = with_hidden(inputs, outputs)
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
