"""AWQ on one decoder layer: for each group of Linears fed by one op, search the scales on the block's output
(`algorithms.awq.search_scales`) and fold them into the op and the Linears.

One pass over the layer captures every mapping's block calls and activation statistic (folding a mapping's
scales leaves the float function, so the later blocks' inputs, unchanged). A block that is one Linear
(o, down) is scored through its input Hessian, sum ||(W' - W) x||^2 = tr(dW H dW^T), instead of running it on
every token for every candidate.

Distributed, every rank ends with every candidate's error over all ranks' tokens, the same numbers a single
process gets, so all choose alike and as one process would:
- through the Hessian (all-reduced, the same on every rank), each candidate is scored on one rank only
  (`distributed.computed_once`): the grid's scoring is shared out instead of repeated on every rank;
- by running the block, each rank scores every candidate on its own batches, and the per-batch errors of all
  candidates are exchanged once (`distributed.gathered_in_order`) and summed in the batches' order.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from quantkit.algorithms.methods.awq import AWQArgs
from quantkit.algorithms.awq import candidate_scales, fold_scales, hessian_error, least_error, scaled_candidate
from quantkit.calibration import offload
from quantkit.calibration.hooks import cut_rows, hidden_state, run_layer
from quantkit.calibration.layer import Layer
from quantkit.calibration.steps import register
from quantkit.models.architectures import norm_weight_offset, scales_fold
from quantkit.models.moe import real_routing
from quantkit.grids.observers import ChannelAbsMean, HessianObserver, Observer
from quantkit.grids.schemes import WeightSpec
from quantkit.runtime import distributed


@register("awq")
def awq_step(layer: Layer, args: AWQArgs) -> None:
    started = time.perf_counter()
    mappings = _mappings(layer)
    rows = scored_rows(offload.batch_shapes(layer.inputs), args.grid_tokens, layer.ctx)
    captured = capture_blocks(layer.module, [(block, linears[0]) for _, block, linears, _, _ in mappings], layer.inputs,
                              rows)
    for (prev, block, linears, specs, along), (calls, act, hessian, cut) in zip(mappings, captured):
        distributed.all_reduce_observer(act, layer.ctx)
        candidates = candidate_scales(act.mean(), args)
        # a block run on the layer's batches was cut to the scored rows as it was captured; one run on part of
        # them (an MoE expert on its tokens) is cut here, on its own tokens
        grid_tokens = None if cut else args.grid_tokens
        scored = _errors(block, linears, specs, calls, hessian, layer.ctx, candidates, grid_tokens)
        scales, _ = least_error(candidates, scored)
        weights = [m.weight for m in linears + along]
        offset = 0.0 if isinstance(prev, nn.Linear) else norm_weight_offset(prev)
        fold_scales(prev.weight, getattr(prev, "bias", None), weights, scales, offset)
    layer.result.seconds["transforms"] += time.perf_counter() - started


def _mappings(layer: Layer) -> list[tuple[nn.Module, nn.Module, list[nn.Module], list[WeightSpec], list[nn.Module]]]:
    """(feeding op, block, quantized Linears, their weight specs, the modules reading the same input that stay in
    full precision) for each of the wiring's mappings AWQ can use here. The scales are searched on the quantized
    Linears and folded into all of them (an MoE router takes them too, so the routing does not change)."""
    part = layer.module.get_submodule
    mappings = []
    for prev_name, linear_names, block_name in layer.traced_wiring.awq_mappings:
        if prev_name is None:
            layer.skip("awq", linear_names, "no norm feeds them: their input is the residual stream")
            continue
        prev, block = part(prev_name), part(block_name)
        entries = {name: layer.plan.get(f"{layer.prefix}.{name}") for name in linear_names}
        quantized = [name for name, e in entries.items() if e is not None and e.quantized]
        if not quantized:
            continue  # every Linear left in full precision: nothing to protect
        linears = [part(name) for name in quantized]
        if isinstance(prev, nn.Linear) and prev.out_features != linears[0].in_features:
            continue  # e.g. v -> o under grouped-query attention
        if isinstance(prev, nn.Linear) and not _scales_fold(layer, prev_name, linear_names):
            layer.skip("awq", linear_names, f"{prev_name} feeds them through {_between(linears)}: no scale folds between them")
            continue
        along = [part(name) for name in linear_names if name not in quantized]
        mappings.append((prev, block, linears, [entries[n].scheme.weights for n in quantized], along))
    return mappings


def _between(linears: list[nn.Module]) -> str:
    """What stands between a feeding Linear and `linears` when no scale folds: an online rotation of their inputs
    (`quant.rotations.OnlineRotation`, R4), else a non-linear op."""
    from quantkit.quant.rotations import ONLINE_ATTRIBUTE

    if any(getattr(linear, ONLINE_ATTRIBUTE, None) is not None for linear in linears):
        return "the online rotation R4"
    return "a non-linear op (an activation)"


def _scales_fold(layer: Layer, prev: str, linears: tuple[str, ...]) -> bool:
    """`architectures.scales_fold` on this rank's first batch, agreed by every rank (they must keep the same mappings)."""
    folds = scales_fold(layer.module, layer.inputs[0], prev, linears)
    world = layer.ctx.world_size if layer.distributed else 1
    return distributed.all_reduce_sum(float(folds), layer.ctx) == world


def _errors(block, linears, specs, calls, hessian, ctx, candidates: list[torch.Tensor],
            grid_tokens: int | None = None) -> list[float]:
    """Each candidate's summed squared block output error over all ranks' tokens (see the module docstring); a
    block that is run on its calls is scored on the first rows of each batch, `grid_tokens` of all ranks' tokens in
    all (`scored_rows`)."""
    if hessian is not None:  # the block is one Linear
        distributed.all_reduce_observer(hessian, ctx)  # every rank then scores any candidate the same
        xtx = hessian.xtx()
        weight = linears[0].weight.data
        return distributed.computed_once(
            len(candidates), lambda k: hessian_error(weight, scaled_candidate(weight, specs[0], candidates[k]), xtx), ctx)
    mine = torch.zeros(len(candidates), len(calls), dtype=torch.float64)
    rows = scored_rows(offload.batch_shapes(calls), grid_tokens, ctx)
    with real_routing(block):  # the block's output is all the scores need: MoE experts on their own tokens only
        for group in offload.resident_groups(calls):  # offloaded calls: a group of batches at a time on the device
            held = calls[group.start : group.stop] if offload.is_offloaded(calls) else calls  # a list, on the device
            if rows is not None:
                held = [cut_rows(call, 0, rows[b]) for b, call in zip(group, held)]
            reference = run_layer(block, held)
            for k, scales in enumerate(candidates):
                mine[k, group.start : group.stop] = torch.tensor(block_errors(block, held, reference, linears, specs, scales))
    return [sum(row) for row in distributed.gathered_in_order(mine, ctx).tolist()]


def scored_rows(shapes: list[torch.Size], grid_tokens: int | None, ctx) -> list[int] | None:
    """The rows of each batch (shapes [rows, tokens, ...]) the grid scores: the same share of every batch, so that all
    ranks' batches together hold about `grid_tokens` tokens (at least one row a batch). None: every row (no limit,
    or no more tokens than it)."""
    total = distributed.all_reduce_sum(float(sum(math.prod(s[:-1]) for s in shapes)), ctx)
    if grid_tokens is None or total <= grid_tokens:
        return None
    return [max(1, math.ceil(s[0] * grid_tokens / total)) for s in shapes]


def capture_blocks(layer: nn.Module, blocks: list[tuple[nn.Module, nn.Module]], inputs: list[tuple],
                   rows: list[int] | None = None) -> list[tuple[list[tuple], Observer, HessianObserver | None, bool]]:
    """For each (block, its first Linear), from one run of the layer: the (args, kwargs) of every call of the block
    (none kept for a block that is that Linear: its input Hessian, accumulated instead, is all its scores need, and
    an MoE layer's every expert down projection would keep experts x tokens x intermediate values), mean |x| of
    the Linear's input over every token, and that Hessian (None for other blocks).

    `rows` (`scored_rows`, one count per batch): a block call on the layer's batch (its hidden states have the
    batch's rows and tokens) is kept, as a copy, and enters the Hessian with only its first rows (the last item
    then says the block's calls were cut). Calls on other shapes (an expert's routed tokens) are kept whole."""
    batch = {"index": -1, "shape": None}  # the layer call being run

    def next_batch(module, args, kwargs):
        batch["index"] += 1
        batch["shape"] = hidden_state(args, kwargs).shape[:-1]

    def scored(x: torch.Tensor) -> int | None:
        """The rows of `x` to keep when it is on the layer's batch, else None."""
        if rows is None or x.shape[:-1] != batch["shape"]:
            return None
        return rows[batch["index"]]

    def keep_call(k, args, kwargs):
        count = scored(hidden_state(args, kwargs))
        if count is not None:
            cut[k] = True
        captured[k][0].append((args, kwargs) if count is None else cut_rows((args, kwargs), 0, count, copy=True))

    def add_to_hessian(hessian, x):
        count = scored(x)
        hessian.update(x if count is None else x[:count])

    captured = [(offload.calls_collector(inputs), ChannelAbsMean(), HessianObserver() if block is first else None)
                for block, first in blocks]
    cut = [False] * len(blocks)
    handles = [layer.register_forward_pre_hook(next_batch, with_kwargs=True)]
    for k, ((block, first), (calls, act, hessian)) in enumerate(zip(blocks, captured)):
        if hessian is None:
            handles.append(block.register_forward_pre_hook(lambda m, a, kw, k=k: keep_call(k, a, kw), with_kwargs=True))
        else:
            handles.append(block.register_forward_pre_hook(lambda m, a, hessian=hessian: add_to_hessian(hessian, a[0])))
        handles.append(first.register_forward_pre_hook(lambda m, a, act=act: act.update(a[0])))
    try:
        with torch.no_grad():
            for args, kwargs in inputs:  # the outputs are not kept: the hooks took what the search needs
                layer(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return [(calls, act, hessian, was_cut) for (calls, act, hessian), was_cut in zip(captured, cut)]


def block_error(block: nn.Module, calls: list[tuple], reference: list[torch.Tensor], linears: list[nn.Module],
                specs: list[WeightSpec], scales: torch.Tensor) -> float:
    """Summed squared block output error with each Linear's weight scaled by s, rounded on its grid, unscaled."""
    return sum(block_errors(block, calls, reference, linears, specs, scales))


def block_errors(block: nn.Module, calls: list[tuple], reference: list[torch.Tensor], linears: list[nn.Module],
                 specs: list[WeightSpec], scales: torch.Tensor) -> list[float]:
    """`block_error` of each call (batch) on its own."""
    originals = [m.weight.data for m in linears]
    errors = []
    try:
        for module, weight, spec in zip(linears, originals, specs):
            module.weight.data = scaled_candidate(weight, spec, scales)
        with torch.no_grad():
            for (args, kwargs), ref in zip(calls, reference):  # one batch's output at a time, never all of them
                out = block(*args, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                errors.append((out.float() - ref.float()).pow(2).sum())
    finally:
        for module, weight in zip(linears, originals):
            module.weight.data = weight
    return torch.stack(errors).tolist() if errors else []
