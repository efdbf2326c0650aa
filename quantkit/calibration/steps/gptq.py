"""GPTQ on one decoder layer: Hessians of each Linear's inputs, then `algorithms.gptq.gptq_quantize`.

Two ways through a layer, chosen once per run (every rank the same):
- staged ("true sequential", `calibration.true_sequential`): one pass; each stage's Hessian is summed over this
  rank's batches and all-reduced, and the stage's weights are quantized (below) before the next stage runs.
  Used when the staged computation reproduces the layer's forward bit for bit.
- layer-wise: observe every Linear's Hessian on the float layer, reduce, quantize; the pipeline then runs the
  quantized layer to make the next layer's inputs.

Distributed: every rank needs each Hessian (all-reduced, in one collective) and its inverse factor, which the
ranks compute together on CPUs (`algorithms.factor`: the Cholesky's row blocks dealt out, each panel broadcast;
the triangular inverse's rows shared out and exchanged) and each rank whole on GPUs. Each rank then solves its share of the weight rows (`algorithms.gptq.row_share`: whole
blocks of ROW_BLOCK rows); the shares' qdata, scale and zero point are gathered (one broadcast per rank). Every
block's arithmetic has the same shapes on any number of ranks, so every rank installs the weights of a one-rank
run, bit for bit.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch
from torch import nn

from quantkit.algorithms.methods.gptq import GPTQArgs
from quantkit.algorithms.factor import ALONE, Sharing
from quantkit.algorithms.gptq import InverseHessian, gptq_quantize_rows, inverse_hessian, row_share
from quantkit.calibration import true_sequential
from quantkit.calibration.hooks import observe, observer_groups
from quantkit.calibration.layer import Layer, relative_error_of_solve
from quantkit.calibration.steps import register
from quantkit.errors import UsageError
from quantkit.models.architectures import find_wiring
from quantkit.grids.observers import HessianObserver
from quantkit.grids import empty_quantized
from quantkit.grids.qparams import QuantizedWeight
from quantkit.grids.schemes import WeightSpec
from quantkit.runtime import distributed, placement
from quantkit.runtime.memory import return_freed_memory


@register("gptq")
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
    calls = true_sequential.Calls(inputs)  # read one at a time: offloaded calls are not all brought back at once
    return all(c is not None for c in calls) and true_sequential.matches_layer(module, wiring, calls[0])


def _staged(layer: Layer, args: GPTQArgs) -> list[torch.Tensor]:
    started = time.perf_counter()
    spent = {"observe": 0.0, "quantize": 0.0}

    def quantize(stage: tuple[str, ...], stage_inputs: Iterable[torch.Tensor]) -> None:
        names = [f"{layer.prefix}.{n}" for n in stage if f"{layer.prefix}.{n}" in layer.linears]
        if not names:
            return
        began = time.perf_counter()
        observer = HessianObserver()
        for x in stage_inputs:
            observer.update(x)
        distributed.all_reduce_observer(observer, layer.ctx)
        mid = time.perf_counter()
        _solve(layer, names, observer, args)
        del observer
        spent["observe"] += mid - began
        spent["quantize"] += time.perf_counter() - mid

    calls = true_sequential.Calls(layer.inputs)
    first = calls[0][0]
    hold = placement.holds_stage_inputs(first.device, _held_bytes(layer, first, len(calls)))
    layer.result.stage_inputs_held = hold
    in_place = not calls.offloaded and layer.take_inputs()  # the residual stream in the inputs: one copy less
    outputs = true_sequential.run_stages(layer.module, layer.wiring, calls, quantize, hold, in_place)
    seconds = layer.result.seconds
    seconds["observe"] += spent["observe"]
    seconds["quantize"] += spent["quantize"]
    seconds["forward"] += time.perf_counter() - started - spent["observe"] - spent["quantize"]
    return outputs


def _held_bytes(layer: Layer, first: torch.Tensor, batches: int) -> int:
    """The down projection's inputs for `batches` batches like `first` (the layer's first hidden states): the most
    the staged pass would hold at once (attention's output, the other held input, is freed before it)."""
    down = layer.module.get_submodule(layer.wiring.down)
    return batches * first[..., 0].numel() * down.in_features * first.element_size()


def _layer_wise(layer: Layer, args: GPTQArgs) -> None:
    started = time.perf_counter()
    observers = observe(layer.linears, HessianObserver, layer.module, layer.inputs)
    groups = observer_groups(observers)
    distributed.all_reduce_observers([observers[names[0]] for names in groups], layer.ctx)
    layer.result.seconds["observe"] += time.perf_counter() - started
    started = time.perf_counter()
    for names in groups:
        _solve(layer, names, observers.pop(names[0]), args)
    layer.result.seconds["quantize"] += time.perf_counter() - started


def _solve(layer: Layer, names: list[str], observer: HessianObserver, args: GPTQArgs) -> None:
    """GPTQ on the weights of modules sharing one Hessian: its inverse factor once, then the weights stacked
    row-wise (rows are independent given the factor, so this equals one run per module, for a third of the
    per-column work on q/k/v; one run per module when their grids differ), each rank solving its share of the
    rows. Every rank records the same qweights and relative errors."""
    device = layer.linears[names[0]].weight.device
    try:  # the Hessian given up as a temporary: on a GPU the factor is made in its own memory (`reuse`)
        factor = inverse_hessian(_popped(observer, device), args, sharing=_sharing(layer), reuse=True)
    except ValueError as exc:
        raise UsageError(f"GPTQ failed on {', '.join(names)}: {exc}") from exc
    global_scales = layer.global_scales()
    for same_grid in _by_grid(layer, names, global_scales):
        weights = [layer.linears[n].weight.data for n in same_grid]
        stacked = torch.cat(weights) if len(weights) > 1 else weights[0]
        spec = layer.plan[same_grid[0]].scheme.weights
        global_scale = global_scales.get(same_grid[0])
        row_errors = torch.zeros(stacked.shape[0], dtype=torch.float32, device=stacked.device)
        if layer.distributed:
            whole = _solve_shared(layer, stacked, factor, spec, args, global_scale, row_errors)
        else:
            whole = gptq_quantize_rows(stacked, factor, spec, args, global_scale, row_errors)
        sizes = [w.shape[0] for w in weights]
        for name, weight, qweight, errors in zip(same_grid, weights, split_rows(whole, sizes), row_errors.split(sizes)):
            layer.record(name, qweight, relative_error_of_solve(weight, errors, factor))
        del stacked


def _popped(observer: HessianObserver, device: torch.device) -> torch.Tensor:
    """The observer's Hessian on `device`, its float64 sums freed and their heap memory returned first (the solve's
    copies are the layer's largest allocations: not on top of freed heap memory). No frame keeps a reference to it
    once returned: the factor stands for it from there on (the errors too)."""
    hessian = observer.pop_hessian().to(device)
    return_freed_memory()
    return hessian


def _sharing(layer: Layer) -> Sharing:
    """How this rank takes part in computing each inverse-Hessian factor (`algorithms.factor`)."""
    if not layer.distributed:
        return ALONE
    return Sharing(layer.ctx.rank, layer.ctx.world_size,
                   lambda rows, src, wait: distributed.broadcast_(rows, src, layer.ctx, wait))


def _solve_shared(layer: Layer, stacked: torch.Tensor, factor: InverseHessian, spec: WeightSpec, args: GPTQArgs,
                  global_scale: torch.Tensor | None, row_errors: torch.Tensor) -> QuantizedWeight:
    """This rank's share of the rows, then every rank's shares gathered, the rows' squared errors with them
    (NVFP4's global scale is the whole weight's, the same on every rank)."""
    world, rank = layer.ctx.world_size, layer.ctx.rank
    shares = [row_share(stacked.shape[0], world, r) for r in range(world)]
    whole = empty_quantized(stacked, spec)
    whole.global_scale = global_scale
    if shares[rank].stop > shares[rank].start:
        mine = gptq_quantize_rows(stacked[shares[rank]], factor, spec, args, global_scale, row_errors[shares[rank]])
        for full, part in zip(_tensors(whole), _tensors(mine)):
            full[shares[rank]] = part
    distributed.all_gather_rows([*_tensors(whole), row_errors[:, None]], shares, layer.ctx)
    rows = layer.result.gptq_rows or [0] * world
    layer.result.gptq_rows = [done + share.stop - share.start for done, share in zip(rows, shares)]
    return whole


def _by_grid(layer: Layer, names: list[str], global_scales: dict[str, torch.Tensor]) -> list[list[str]]:
    """The modules stacked into one GPTQ run: all of them when they share a grid, a dtype and (NVFP4) a global
    scale, else one each."""
    if (len({layer.plan[n].scheme.weights for n in names}) > 1 or len({layer.linears[n].weight.dtype for n in names}) > 1
            or len({id(global_scales.get(n)) for n in names}) > 1):
        return [[n] for n in names]
    return [names]


def _tensors(qweight: QuantizedWeight) -> list[torch.Tensor]:
    """Every per-row tensor of `qweight`: its integers, scales and zero points, and a block grid's codes and scales."""
    grid = tuple(qweight.k.parts().values()) if qweight.k is not None else ()
    return [t for t in (qweight.qdata, qweight.scale, qweight.zero_point, *grid) if t is not None]



def split_rows(qweight: QuantizedWeight, rows: list[int]) -> list[QuantizedWeight]:
    """A row-stacked QuantizedWeight cut back into its modules' (qdata, scale and zero point are per row, and so is
    a block grid's every tensor)."""
    parts = [t.split(rows) if t is not None else [None] * len(rows) for t in (qweight.qdata, qweight.scale, qweight.zero_point)]
    grids = [None] * len(rows)
    if qweight.k is not None:
        starts = [sum(rows[:i]) for i in range(len(rows))]
        grids = [qweight.k.map(lambda t, a=a, n=n: t[a:a + n].contiguous()) for a, n in zip(starts, rows)]
    return [QuantizedWeight(q.contiguous(), s.contiguous(), z.contiguous() if z is not None else None, qweight.spec,
                            qweight.global_scale, grid) for (q, s, z), grid in zip(zip(*parts), grids)]
