"""AutoRound on one decoder layer: `algorithms.autoround.tune` learns each Linear's rounding and clipping so that the
quantized layer, on the quantized layers' outputs before it, gives the float model's outputs; the layer is then
quantized with the learned rounding.

As in auto-round (`enable_quanted_input`, its default, which llm-compressor's AutoRoundModifier keeps): the target
is the float model's hidden states after this layer (the float layer on the float model's hidden states before
it, `Layer.float_hidden`, carried along by the pipeline), and the tuned layer's inputs are the quantized stream,
so each layer also learns to correct the error the layers before it left. Each sample is its own forward and
backward pass (batch of one) with respect to the step's fake-quantized weights: a sample's gradient is then the
same whichever rank holds it. With `amp` (the default), those passes run in bfloat16 autocast where the device
multiplies bf16 natively (CUDA; CPUs with AVX512-BF16 or AMX), as auto-round tunes; the targets, the losses in the
summary and the final rounding are computed in the model's dtype. The summary keeps the layer's loss (mean squared
error to the float model's output per sample, over all samples) with round-to-nearest and after tuning.

Distributed: this rank's samples are the contiguous slice `data.rank_batches` gave it; every step's gradients with
respect to the fake-quantized weights (float64) and per-sample losses are all-reduced before they are carried back
to the rounding, so every rank takes the same step and ends with the same rounding.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
from torch import nn
from torch.func import functional_call

from quantkit import distributed, precision
from quantkit.algorithms import Algorithm
from quantkit.algorithms.arguments import AutoRoundArgs
from quantkit.algorithms.autoround import Rounding, quantize, tune
from quantkit.calibration.hooks import run_layer, with_hidden
from quantkit.calibration.layer import Layer, relative_error
from quantkit.calibration.steps import register
from quantkit.moe import experts_modules


@register(Algorithm.AUTOROUND)
def autoround_step(layer: Layer, args: AutoRoundArgs) -> list[torch.Tensor]:
    started = time.perf_counter()
    weights = {name: m.weight.data for name, m in layer.linears.items()}
    specs = {name: layer.plan[name].scheme.weights for name in weights}
    reference = layer.float_hidden if layer.float_hidden is not None else [_hidden(*call) for call in layer.inputs]
    targets = run_layer(layer.module, with_hidden(layer.inputs, reference))  # the float model's next hidden states
    layer.float_hidden = targets
    if not weights:  # the recipe leaves every Linear of this layer out: nothing to tune
        return run_layer(layer.module, layer.inputs)
    dtype, device = next((w.dtype, w.device) for w in weights.values())
    amp = args.amp and precision.native_bf16(device)
    rows = [(b, r) for b, call in enumerate(layer.inputs) for r in range(_hidden(*call).shape[0])]
    first, total = _global_slice(len(rows), layer)
    nearest = {name: quantize(w, Rounding.nearest(w, specs[name]), specs[name], args.full_range)
               for name, w in weights.items()}
    before = _mean_loss(layer, _outputs_with(layer, nearest), targets, first, total)
    tuning = time.perf_counter()
    layer.result.seconds["forward"] += tuning - started

    generator = torch.Generator().manual_seed(args.seed + layer.index)
    with _tuning(layer.module):
        tuned = tune(weights, specs, _sample_loss(layer, rows, first, targets, amp),
                     range(first, first + len(rows)), total, generator, args,
                     lambda flat: distributed.all_reduce_(flat, layer.ctx))
    for name, weight in weights.items():
        qweight = quantize(weight, tuned.roundings[name], specs[name], args.full_range)
        layer.record(name, qweight, relative_error(weight, qweight, None))
    propagating = time.perf_counter()
    layer.result.seconds["quantize"] += propagating - tuning
    outputs = run_layer(layer.module, layer.inputs)
    layer.result.tuning[layer.prefix] = {"loss_rtn": before, "loss_tuned": _mean_loss(layer, outputs, targets, first, total),
                                         "best_step": tuned.best_iter, "steps": args.iters,
                                         "seconds_per_step": round(tuned.step_seconds, 4),
                                         "compute": "bfloat16" if amp else str(dtype).removeprefix("torch.")}
    layer.result.seconds["propagate"] += time.perf_counter() - propagating
    return outputs


def _sample_loss(layer: Layer, rows: list[tuple[int, int]], first: int, targets: list[torch.Tensor], amp: bool):
    """The loss of global sample `sample` (this rank's `rows[sample - first]`: batch, row) with the fake-quantized
    weights in place of the float ones: its own forward pass, a batch of one (in bfloat16 autocast with `amp`)."""
    device_type = next(iter(layer.linears.values())).weight.device.type

    def sample_loss(fake: dict[str, torch.Tensor], sample: int) -> torch.Tensor:
        batch, row = rows[sample - first]
        call_args, call_kwargs = _row_call(layer.inputs[batch], row)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp):
            out = functional_call(layer.module, _local(layer, fake), call_args, call_kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return torch.nn.functional.mse_loss(out.float(), targets[batch][row : row + 1].float())

    return sample_loss


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _row_call(call: tuple, row: int) -> tuple[tuple, dict]:
    """One sample of a batched layer call: every tensor with the batch's leading size (and 2 dims or more) cut to
    that sample's row; the rest (1-D cache positions, broadcast rotary tables, None masks) as it is."""
    args, kwargs = call
    size = _hidden(args, kwargs).shape[0]

    def cut(value):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == size:
            return value[row : row + 1].detach()
        if isinstance(value, tuple):
            return tuple(cut(v) for v in value)
        return value

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _local(layer: Layer, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qualified module names -> the layer's own parameter names (`mlp.up_proj.weight`)."""
    return {f"{name[len(layer.prefix) + 1:]}.weight": tensor for name, tensor in tensors.items()}


def _global_slice(count: int, layer: Layer) -> tuple[int, int]:
    """(the global index of this rank's first sample, the number of samples over all ranks): ranks hold contiguous
    slices in rank order (`data.rank_batches`)."""
    if not layer.distributed:
        return 0, count
    counts = torch.zeros(layer.ctx.world_size, dtype=torch.float64, device=layer.ctx.device)
    counts[layer.ctx.rank] = count
    distributed.all_reduce_(counts, layer.ctx)
    return int(counts[: layer.ctx.rank].sum()), int(counts.sum())


def _outputs_with(layer: Layer, qweights: dict) -> list[torch.Tensor]:
    """The layer's outputs on this rank's batches with these quantized weights in place of its float ones."""
    dequantized = {name: q.dequantize(layer.linears[name].weight.dtype) for name, q in qweights.items()}
    with torch.no_grad():
        outs = [functional_call(layer.module, _local(layer, dequantized), a, k) for a, k in layer.inputs]
    return [out[0] if isinstance(out, tuple) else out for out in outs]


def _mean_loss(layer: Layer, outputs: list[torch.Tensor], targets: list[torch.Tensor], first: int, total: int) -> float:
    """The mean over all ranks' samples of each sample's mean squared output error (summed in sample order)."""
    per_sample = torch.zeros(total, dtype=torch.float64, device=outputs[0].device if outputs else None)
    errors = [((o.float() - t.float()) ** 2).flatten(1).mean(1) for o, t in zip(outputs, targets)]
    if errors:
        mine = torch.cat(errors).double()
        per_sample[first : first + mine.numel()] = mine
    distributed.all_reduce_(per_sample, layer.ctx)
    return sum(per_sample.tolist()) / max(1, total)


@contextlib.contextmanager
def _tuning(module: nn.Module) -> Iterator[None]:
    """While tuning: the layer's own parameters need no gradients, and MoE experts run on their routed tokens only
    (the output is the same; running every expert on every token, as statistics need, would only cost time)."""
    params = [p for p in module.parameters() if p.requires_grad]
    experts = [m for m in experts_modules(module).values() if m.all_tokens]
    for p in params:
        p.requires_grad_(False)
    for m in experts:
        m.all_tokens = False
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
        for m in experts:
            m.all_tokens = True
