"""GPTQ on one decoder layer: Hessians of each Linear's inputs, then `algorithms.gptq.gptq_quantize`.

Two ways through a layer, chosen once per run (every rank the same):
- staged ("true sequential", `calibration.true_sequential`): one pass; each stage's Hessian is summed over this
  rank's batches, reduced to the stage's owner rank, and the owner's result is broadcast before the next stage
  runs. Used when the staged computation reproduces the layer's forward bit for bit.
- layer-wise: observe every Linear's Hessian on the float layer, reduce, quantize; the pipeline then runs the
  quantized layer to make the next layer's inputs.

Distributed: modules sharing a Hessian go to one owner rank (bin-packed on GPTQ work); the owner quantizes them
and broadcasts qdata, scale and zero point, so every rank installs the same weights.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

from quantkit import distributed
from quantkit.algorithms import Algorithm
from quantkit.algorithms.arguments import GPTQArgs
from quantkit.algorithms.gptq import gptq_quantize
from quantkit.architectures import find_wiring, shared_input_leaders
from quantkit.calibration import true_sequential
from quantkit.calibration.hooks import observe, observer_groups
from quantkit.calibration.layer import Layer, relative_error
from quantkit.calibration.steps import register
from quantkit.errors import UsageError
from quantkit.memory import return_freed_memory
from quantkit.observers import HessianObserver
from quantkit.qparams import QuantizedWeight, empty_quantized


@register(Algorithm.GPTQ)
def gptq_step(layer: Layer, args: GPTQArgs) -> list[torch.Tensor] | None:
    if layer.index == 0:  # every rank must take the same path
        agree = distributed.all_reduce_sum(float(can_stage(layer.module, layer.inputs)), layer.ctx)
        layer.result.true_sequential = agree == (layer.ctx.world_size if layer.ctx else 1)
    if layer.result.true_sequential and find_wiring(layer.module) is not None:  # an MoE layer after dense ones: not staged
        return _staged(layer, args)
    _layer_wise(layer, args)
    return None


def can_stage(module: nn.Module, inputs: list[tuple]) -> bool:
    """Whether GPTQ can run on this layer in one staged pass: a known wiring, and a staged computation that
    reproduces the layer's forward exactly."""
    wiring = find_wiring(module)
    if wiring is None or not inputs:
        return False
    calls = [true_sequential.split_call(a, k) for a, k in inputs]
    return all(c is not None for c in calls) and true_sequential.matches_layer(module, wiring, calls[0])


def _staged(layer: Layer, args: GPTQArgs) -> list[torch.Tensor]:
    shapes = {name: (m.in_features, m.out_features) for name, m in layer.linears.items()}
    owners = gptq_owners(shapes, shared_input_leaders(list(shapes)), layer.ctx.world_size) if layer.distributed else {}
    layer.result.owners.update(owners)
    started = time.perf_counter()
    spent = {"observe": 0.0, "quantize": 0.0}

    def quantize(stage: tuple[str, ...], stage_inputs: list[torch.Tensor]) -> None:
        names = [f"{layer.prefix}.{n}" for n in stage if f"{layer.prefix}.{n}" in layer.linears]
        if not names:
            return
        began = time.perf_counter()
        observer = HessianObserver()
        for x in stage_inputs:
            observer.update(x)
        owner = owners.get(names[0])
        if layer.distributed:
            distributed.reduce_observer_to(observer, owner, layer.ctx)
        mid = time.perf_counter()
        _quantize_on_owner(layer, names, observer, owner, args)
        del observer
        spent["observe"] += mid - began
        spent["quantize"] += time.perf_counter() - mid

    calls = [true_sequential.split_call(a, k) for a, k in layer.inputs]
    outputs = true_sequential.run_stages(layer.module, layer.wiring, calls, quantize)
    seconds = layer.result.seconds
    seconds["observe"] += spent["observe"]
    seconds["quantize"] += spent["quantize"]
    seconds["forward"] += time.perf_counter() - started - spent["observe"] - spent["quantize"]
    return outputs


def _layer_wise(layer: Layer, args: GPTQArgs) -> None:
    started = time.perf_counter()
    observers = observe(layer.linears, HessianObserver, layer.module, layer.inputs)
    groups = observer_groups(observers)
    owners = {}
    if layer.distributed:
        shapes = {name: (m.in_features, m.out_features) for name, m in layer.linears.items()}
        owners = gptq_owners(shapes, {name: names[0] for names in groups for name in names}, layer.ctx.world_size)
    for names in groups:
        distributed.reduce_observer_to(observers[names[0]], owners.get(names[0]), layer.ctx)
    layer.result.owners.update(owners)
    layer.result.seconds["observe"] += time.perf_counter() - started
    started = time.perf_counter()
    for names in groups:
        _quantize_on_owner(layer, names, observers[names[0]], owners.get(names[0]), args)
    layer.result.seconds["quantize"] += time.perf_counter() - started


def gptq_owners(shapes: dict[str, tuple[int, int]], leaders: dict[str, str], world_size: int) -> dict[str, int]:
    """The rank that runs GPTQ for each module (`shapes`: name -> (in, out); `leaders`: name -> the first module
    sharing its Hessian). Modules sharing a Hessian go to one owner, bin-packed on GPTQ work: the inverse
    (in^3) plus each module's column updates (out * in^2)."""
    work: dict[str, int] = defaultdict(int)
    for name, (size, out) in shapes.items():
        work[leaders[name]] += out * size ** 2 + (size ** 3 if leaders[name] == name else 0)
    by_leader = distributed.assign_owners(dict(work), world_size)
    return {name: by_leader[leaders[name]] for name in shapes}


def _quantize_on_owner(layer: Layer, names: list[str], observer: HessianObserver, owner: int | None, args: GPTQArgs) -> None:
    """The owner quantizes and broadcasts qdata, scale and zero point; every rank installs the same result."""
    if owner is None or not layer.distributed:
        for name, qweight, error in _quantize_group(layer, names, observer.pop_hessian(), args):
            layer.record(name, qweight, error)
        return
    if layer.ctx.rank == owner:
        results = _quantize_group(layer, names, observer.pop_hessian(), args)
    else:
        results = [(n, empty_quantized(layer.linears[n].weight.data, layer.plan[n].scheme.weights), 0.0) for n in names]
    for name, qweight, error in results:
        buffers = [qweight.qdata, qweight.scale] + ([qweight.zero_point] if qweight.zero_point is not None else [])
        distributed.broadcast_(buffers, owner, layer.ctx)
        layer.record(name, qweight, distributed.all_reduce_sum(error, layer.ctx))


def _quantize_group(layer: Layer, names: list[str], hessian: torch.Tensor, args: GPTQArgs) -> list[tuple[str, QuantizedWeight, float]]:
    """GPTQ once on the weights of modules sharing one Hessian, stacked row-wise (rows are independent given the
    Hessian, so this equals one run per module, for a third of the per-column work on q/k/v), or one run per
    module when their grids differ. Returns (name, qweight, relative error) per module."""
    return_freed_memory()  # the solve's copies are the layer's largest allocations: not on top of freed heap memory
    weights = [layer.linears[n].weight.data for n in names]
    specs = {layer.plan[n].scheme.weights for n in names}
    if len(specs) > 1 or len({w.dtype for w in weights}) > 1:  # not one grid: one run each
        return [r for n in names for r in _quantize_group(layer, [n], hessian, args)]
    try:
        stacked = gptq_quantize(torch.cat(weights) if len(weights) > 1 else weights[0], hessian, specs.pop(), args)
    except ValueError as exc:
        raise UsageError(f"GPTQ failed on {', '.join(names)}: {exc}") from exc
    qweights = split_rows(stacked, [w.shape[0] for w in weights])
    return [(n, q, relative_error(w, q, hessian)) for n, w, q in zip(names, weights, qweights)]


def split_rows(qweight: QuantizedWeight, rows: list[int]) -> list[QuantizedWeight]:
    """A row-stacked QuantizedWeight cut back into its modules' (qdata, scale and zero point are per row)."""
    parts = [t.split(rows) if t is not None else [None] * len(rows) for t in (qweight.qdata, qweight.scale, qweight.zero_point)]
    return [QuantizedWeight(q.contiguous(), s.contiguous(), z.contiguous() if z is not None else None, qweight.spec)
            for q, s, z in zip(*parts)]
