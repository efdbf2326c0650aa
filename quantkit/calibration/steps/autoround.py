"""AutoRound on one decoder layer: `algorithms.autoround.tune` learns each Linear's rounding and clipping so that the
quantized layer, on the quantized layers' outputs before it, gives the float model's outputs; the layer is then
quantized with the learned rounding.

As in auto-round (`enable_quanted_input`, its default, which llm-compressor's AutoRoundModifier keeps): the target
is the float model's hidden states after this layer (the float layer on the float model's hidden states before
it, `Layer.float_hidden`, carried along by the pipeline), and the tuned layer's inputs are the quantized stream,
so each layer also learns to correct the error the layers before it left. A step's samples go `samples_per_pass`
to a forward and backward pass with respect to the step's fake-quantized weights, where the samples differ only
in their hidden states (equal-length calibration samples; otherwise one a pass): a pass's gradient is then the
same whichever rank runs it. With `amp` (the default), those passes run in bfloat16 autocast where the device
multiplies bf16 natively (CUDA; CPUs with AVX512-BF16 or AMX), as auto-round tunes; the targets, the losses in the
summary and the final rounding are computed in the model's dtype. The summary keeps the layer's loss (mean squared
error to the float model's output per sample, over all samples) with round-to-nearest and after tuning.

Distributed: this rank's samples are the contiguous slice `data.rank_batches` gave it; every rank gathers every
rank's samples of the layer and runs the passes dealt to it; every pass's gradient with respect to the
fake-quantized weights and its samples' losses are gathered onto every rank and added up in pass order before they
are carried back to the rounding, so every rank takes the same step and ends with the same rounding.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import time
from typing import Callable, Iterator

import torch
from torch import nn
from torch.func import functional_call

from quantkit.algorithms.methods.autoround import AutoRoundArgs
from quantkit.algorithms.autoround import Rounding, Share, quantize, tune
from quantkit.calibration.hooks import cut_rows, hidden_state, hidden_states, run_layer, with_hidden
from quantkit.calibration.layer import Layer, relative_error
from quantkit.calibration.steps import register
from quantkit.calibration.tuning_attention import bf16_cpu_attention
from quantkit.models.moe import experts_modules
from quantkit.runtime import distributed, precision


@register("autoround")
def autoround_step(layer: Layer, args: AutoRoundArgs) -> list[torch.Tensor]:
    started = time.perf_counter()
    weights = {name: m.weight.data for name, m in layer.linears.items()}
    specs = {name: layer.plan[name].scheme.weights for name in weights}
    reference = layer.float_hidden if layer.float_hidden is not None else hidden_states(layer.inputs)
    targets = run_layer(layer.module, with_hidden(layer.inputs, reference))  # the float model's next hidden states
    layer.float_hidden = targets
    if not weights:  # the recipe leaves every Linear of this layer out: nothing to tune
        return run_layer(layer.module, layer.inputs)
    dtype, device = next((w.dtype, w.device) for w in weights.values())
    amp = args.amp and precision.native_bf16(device)
    rows = [(b, r) for b, call in enumerate(layer.inputs) for r in range(hidden_state(*call).shape[0])]
    counts = distributed.all_gather_int(len(rows), layer.ctx)  # ranks hold contiguous runs in rank order
    first, total = sum(counts[: layer.ctx.rank if layer.distributed else 0]), sum(counts)
    nearest = {name: quantize(w, Rounding.nearest(w, specs[name]), specs[name], args.full_range)
               for name, w in weights.items()}
    before = _mean_loss(layer, _outputs_with(layer, nearest), targets, first, total)
    every = _every_sample(layer, rows, targets, first, total)
    if every is None:  # samples whose other arguments differ (or a rank holds none): each rank runs its own, one a pass
        sample_loss, share, per_pass = _sample_loss(layer, rows, first, targets, amp), _held(layer, counts), 1
    else:  # each step's passes dealt out evenly over the ranks (one process: all of them)
        sample_loss, share, per_pass = _every_sample_loss(layer, *every, amp), _dealt(layer), args.samples_per_pass
    tuning = time.perf_counter()
    layer.result.seconds["forward"] += tuning - started

    generator = torch.Generator().manual_seed(args.seed + layer.index)
    attention = bf16_cpu_attention(layer.module) if amp and device.type == "cpu" else contextlib.nullcontext()
    with _tuning(layer.module), attention:
        tuned = tune(weights, specs, sample_loss, total, generator, args, per_pass, share,
                     torch.bfloat16 if amp else None)
    for name, weight in weights.items():
        qweight = quantize(weight, tuned.roundings[name], specs[name], args.full_range)
        layer.record(name, qweight, relative_error(weight, qweight, None))
    propagating = time.perf_counter()
    layer.result.seconds["quantize"] += propagating - tuning
    outputs = run_layer(layer.module, layer.inputs)
    layer.result.tuning[layer.prefix] = {"loss_rtn": before, "loss_tuned": _mean_loss(layer, outputs, targets, first, total),
                                         "best_step": tuned.best_iter, "steps": args.iters,
                                         "seconds_per_step": round(tuned.step_seconds, 4),
                                         "compute": "bfloat16" if amp else str(dtype).removeprefix("torch."),
                                         "samples_per_pass": per_pass,
                                         "split": ("one process" if not layer.distributed
                                                   else "as held" if every is None else "dealt evenly")}
    layer.result.seconds["propagate"] += time.perf_counter() - propagating
    return outputs


def _sample_loss(layer: Layer, rows: list[tuple[int, int]], first: int, targets: list[torch.Tensor], amp: bool):
    """The loss of a pass of one global sample (this rank's `rows[sample - first]`: batch, row) with the
    fake-quantized weights in place of the float ones: a batch of one (in bfloat16 autocast with `amp`)."""
    def sample_loss(fake: dict[str, torch.Tensor], samples: list[int]) -> torch.Tensor:
        sample, = samples
        batch, row = rows[sample - first]
        return _call_losses(layer, fake, _row_call(layer.inputs[batch], row), targets[batch][row : row + 1], amp)

    return sample_loss


def _call_losses(layer: Layer, fake: dict[str, torch.Tensor], call: tuple, target: torch.Tensor, amp: bool) -> torch.Tensor:
    """Each sample's mean squared error to `target` of the layer's output on `call` (one pass over its samples),
    with the fake-quantized weights in place of the float ones (in bfloat16 autocast with `amp`)."""
    call_args, call_kwargs = call
    with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=amp):
        out = functional_call(layer.module, _local(layer, fake), call_args, call_kwargs)
    out = out[0] if isinstance(out, tuple) else out
    return ((out.float() - target.float()) ** 2).flatten(1).mean(1)


def _every_sample(layer: Layer, rows: list[tuple[int, int]], targets: list[torch.Tensor], first: int,
                  total: int) -> tuple[Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]], tuple] | None:
    """Where every sample's call differs from the others only in its hidden states (calibration samples of equal
    length): the hidden states and float outputs of any samples (rows in global order) and a one-sample call
    to put them in, so that several samples share a pass and each step's passes can be dealt out evenly. On
    several ranks every rank's samples are gathered onto every rank (a rank holding its own samples only would
    run as many of a step's as it happens to hold, and the others would wait for it). None where the samples'
    other arguments differ or a rank holds none: then each rank runs its own, one a pass."""
    template = _row_call(layer.inputs[0], 0) if rows else None
    uniform = bool(rows) and all(_same_call(_row_call(layer.inputs[b], r), template) for b, r in rows)
    if not layer.distributed:
        if not uniform:
            return None
        held = [(hidden_state(*layer.inputs[b])[r : r + 1], targets[b][r : r + 1]) for b, r in rows]

        def rows_of(samples: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.cat([held[s][0] for s in samples]), torch.cat([held[s][1] for s in samples])

        return rows_of, template
    seq_len, width = hidden_state(*template).shape[1:] if uniform else (0, 0)
    counts = distributed.all_gather_int(len(rows) if uniform else 0, layer.ctx)
    shapes = [distributed.all_gather_int(size, layer.ctx) for size in (seq_len, width)]
    if min(counts) == 0 or any(len(set(sizes)) > 1 for sizes in shapes):
        return None
    hidden = torch.cat(hidden_states(layer.inputs))
    outputs = torch.cat(targets)
    every = [torch.empty((total, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in (hidden, outputs)]
    for full, mine in zip(every, (hidden, outputs)):
        full[first : first + len(rows)] = mine
    starts = [sum(counts[:rank]) for rank in range(len(counts))]
    distributed.all_gather_rows(every, [slice(a, a + n) for a, n in zip(starts, counts)], layer.ctx)
    return (lambda samples: (every[0][samples], every[1][samples])), template


def _same_call(call: tuple, template: tuple) -> bool:
    """Whether a one-sample call's arguments other than the hidden states are the template's."""
    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
        if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a is b or a == b

    (args, kwargs), (t_args, t_kwargs) = call, template
    return (same(args[1:], t_args[1:]) and kwargs.keys() == t_kwargs.keys()
            and all(k == "hidden_states" or same(v, t_kwargs[k]) for k, v in kwargs.items()))


def _dealt(layer: Layer) -> Share:
    """A step's passes dealt out: the passes at places rank, rank + world_size, ... to each rank (one process: all)."""
    if not layer.distributed:
        return Share()
    world_size = layer.ctx.world_size
    return Share(layer.ctx.rank, world_size, lambda place, samples: place % world_size, _gather(layer))


def _held(layer: Layer, counts: list[int]) -> Share:
    """Each pass (one sample) run by the rank that holds its sample: the ranks hold `counts` samples, contiguous
    runs in rank order (`data.rank_batches`)."""
    if not layer.distributed:
        return Share()
    ends = list(itertools.accumulate(counts))
    return Share(layer.ctx.rank, layer.ctx.world_size, lambda place, samples: bisect.bisect_right(ends, samples[0]),
                 _gather(layer))


def _gather(layer: Layer):
    return lambda tensors, shares: distributed.all_gather_rows(tensors, shares, layer.ctx)


def _every_sample_loss(layer: Layer, rows_of, template: tuple, amp: bool):
    """The losses of any samples (`_every_sample`'s rows), in one pass: the template call with their hidden states
    (its per-sample tensors repeated for each)."""
    def sample_loss(fake: dict[str, torch.Tensor], samples: list[int]) -> torch.Tensor:
        hidden, target = rows_of(samples)
        call, = with_hidden([_repeated(template, len(samples))], [hidden])
        return _call_losses(layer, fake, call, target, amp)

    return sample_loss


def _repeated(call: tuple, count: int) -> tuple[tuple, dict]:
    """A one-sample call (`_row_call`'s) made a call of `count` samples: its tensors of one row (2 dims or more)
    repeated `count` times, as a batch of samples with the same arguments would hold them."""
    def grow(value):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and count > 1:
            return value.expand(count, *value.shape[1:])
        if isinstance(value, tuple):
            return tuple(grow(v) for v in value)
        return value

    args, kwargs = call
    return tuple(grow(a) for a in args), {k: grow(v) for k, v in kwargs.items()}


def _row_call(call: tuple, row: int) -> tuple[tuple, dict]:
    """One sample of a batched layer call (`hooks.cut_rows`)."""
    return cut_rows(call, row, row + 1)


def _local(layer: Layer, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qualified module names -> the layer's own parameter names (`mlp.up_proj.weight`)."""
    return {f"{name[len(layer.prefix) + 1:]}.weight": tensor for name, tensor in tensors.items()}


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
