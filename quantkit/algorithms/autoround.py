"""AutoRound (SignRound): learned rounding offsets and clipping factors, tuned by signed gradient descent.

Intel's auto-round (`auto_round/wrapper.py`, `data_type/int.py`, `sign_sgd.py`, the tuning loop in its
`sign_round/quantizer.py`), on quantkit's grids. For each weight element an offset V in [-0.5, 0.5] is added
before rounding, and each group's min and max are scaled by factors in [0, 1] before its scale is chosen:

    q = clamp(round(w / s + V) + z, qmin, qmax),   s from (min * a, max * b) as the scheme's grid chooses it

V, a and b are tuned on a decoder layer's output error: each step takes the sign of the gradient (rounding passed
straight through), moves V by lr and a, b by minmax_lr (both decayed linearly to 0 over the steps), and the
iterate with the least loss is kept. V = 0, a = b = 1 is round-to-nearest, bit for bit.

A step fake-quantizes the weights once; the gradient with respect to the fake-quantized weights comes from
forward and backward passes over a fixed number of the step's samples each (`per_pass`), shared out over the ranks
(`Share`), gathered onto every rank and summed in float32 in pass order; the sum is carried back through the
fake-quantization once. Every rank adds the same numbers in the same order, so every rank takes the same step.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine_with_min_max

from quantkit.algorithms.methods.autoround import AutoRoundArgs
from quantkit.grids.family import SearchedGrid
from quantkit.grids import family_of
from quantkit.grids.qparams import QuantizedWeight, block_size, scale_dtype
from quantkit.grids.schemes import WeightSpec

EPS = torch.finfo(torch.float32).eps  # the smallest scale, as `qparams.choose_qparams` clamps it


@dataclass
class Rounding:
    """One Linear's tuned parameters (float32): `value` V [out, in], `min_scale` and `max_scale` [out, groups]."""

    value: torch.Tensor
    min_scale: torch.Tensor
    max_scale: torch.Tensor

    @classmethod
    def nearest(cls, weight: torch.Tensor, spec: WeightSpec) -> Rounding:
        """V = 0 and unit clipping: round-to-nearest."""
        groups = weight.shape[1] // block_size(weight, spec)[1]
        ones = torch.ones(weight.shape[0], groups, dtype=torch.float32, device=weight.device)
        return cls(torch.zeros(weight.shape, dtype=torch.float32, device=weight.device), ones, ones.clone())

    def tensors(self) -> list[torch.Tensor]:
        return [self.value, self.min_scale, self.max_scale]

    def clone(self) -> Rounding:
        return Rounding(*(t.detach().clone() for t in self.tensors()))

    def copy_(self, other: Rounding) -> Rounding:
        """`other`'s values in this Rounding's tensors (no new memory)."""
        with torch.no_grad():
            for mine, theirs in zip(self.tensors(), other.tensors()):
                mine.copy_(theirs)
        return self


def _grouped(weight: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    return weight.reshape(weight.shape[0], -1, block_size(weight, spec)[1])


def _qparams(low: torch.Tensor, high: torch.Tensor, spec: WeightSpec, round_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each group from its (clipped) range, as torchao's `choose_qparams_affine` computes
    them (differentiable when `round_fn` passes gradients through)."""
    qmin, qmax = spec.dtype.qrange
    low, high = low.clamp(max=0), high.clamp(min=0)
    if spec.symmetric:
        scale = torch.maximum(-low, high) / ((qmax - qmin) / 2)
        return scale.clamp(min=EPS), torch.zeros_like(scale)
    scale = ((high - low) / (qmax - qmin)).clamp(min=EPS)
    return scale, (qmin - round_fn(low / scale)).clamp(qmin, qmax)


def _full_range_scale(low: torch.Tensor, high: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """auto-round's symmetric grid ("full range", from llama.cpp; `data_type/int.py: quant_tensor_sym`): the larger side
    of the group's (clipped) range lands exactly on the grid's most negative value, the scale's sign choosing the
    side, so every one of the 2^bits levels is used (the min-max grid leaves the larger side of its range outside)."""
    qmin = spec.dtype.qrange[0]
    low, high = low.clamp(max=0), high.clamp(min=0)
    scale = torch.where(-low > high, -low, -high) / -qmin
    return torch.where(scale < 0, scale.clamp(max=-EPS), scale.clamp(min=EPS))


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest (ties to even) forward; the identity backward (straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


@dataclass(frozen=True)
class Groups:
    """A weight's float32 groups [out, groups, group size] and each group's min and max: what the fake-quantization
    reads of the weight, which stays the same for the whole tuning (taken once, not every step). On a grid whose
    family's search fixes its steps (llama.cpp's K grids: `GridFamily.searched`), that grid (`k`), which stays fixed
    while the rounding is tuned."""

    values: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    k: SearchedGrid | None = None

    @classmethod
    def of(cls, weight: torch.Tensor, spec: WeightSpec) -> Groups:
        values = _grouped(weight.float(), spec)
        return cls(values, values.amin(-1), values.amax(-1), family_of(spec).searched(weight, spec))


def _k_shifted(weight: torch.Tensor, grid: SearchedGrid, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(w + offset) / step + V on a searched grid, in `k_grids.round_k`'s arithmetic (V = 0: its value before rounding);
    with each column's step and offset."""
    step, offset = grid.column_scales(0, weight.shape[1])
    x = weight.float()
    return torch.div(x if offset is None else x + offset, step) + value, step, offset


def _fake_quantize_k(weight: torch.Tensor, value: torch.Tensor, grid: SearchedGrid) -> torch.Tensor:
    """The weight on its fixed K grid with offsets V: the grid's value of clamp(round((w + offset) / step + V)),
    differentiable in V (rounding straight through, clamp's gradient 0 outside the codes)."""
    shifted, step, offset = _k_shifted(weight, grid, value)
    low, high = grid.code_range
    codes = round_ste(shifted).clamp(low, high)
    values = torch.where(step == 0, 0.0, codes) * step
    return values if offset is None else values - offset


def fake_quantize(weight: torch.Tensor, rounding: Rounding, spec: WeightSpec, full_range: bool = False,
                  groups: Groups | None = None) -> torch.Tensor:
    """The weight on the grid `rounding` chooses, float32, differentiable in V, a and b (rounding straight through).
    `full_range`: symmetric grids scale as auto-round's (`_full_range_scale`). `groups`: the weight's, if taken
    already."""
    groups = groups if groups is not None else Groups.of(weight, spec)
    if groups.k is not None:  # a searched grid (llama.cpp's K): the rounding alone is tuned (its scales are the search's)
        return _fake_quantize_k(weight, rounding.value, groups.k)
    low, high = groups.low * rounding.min_scale, groups.high * rounding.max_scale
    if full_range and spec.symmetric:
        scale, zero = _full_range_scale(low, high, spec), None
    else:
        scale, zero = _qparams(low, high, spec, round_ste)
        zero = None if spec.symmetric else zero.unsqueeze(-1)
    qmin, qmax = spec.dtype.qrange
    value = _grouped(rounding.value, spec)
    return _RoundToGrid.apply(groups.values, value, scale.unsqueeze(-1), zero, qmin, qmax).reshape(weight.shape)


class _RoundToGrid(torch.autograd.Function):
    """(clamp(round(w / s + V) + z, qmin, qmax) - z) * s per group (w: the weight's groups, s and z: each group's
    scale and zero point, None where symmetric), with autograd's gradients of that expression with rounding passed
    straight through (round's derivative 1; clamp's 1 inside [qmin, qmax], 0 outside), in a handful of
    whole-weight passes instead of the ~20 autograd would make of it. Forward: the same operations in the same
    order as `quantize`, so what tuning sees is what is written, bit for bit."""

    @staticmethod
    def forward(ctx, values, value, scale, zero, qmin, qmax):
        inverse = 1.0 / scale
        shifted = values * inverse
        shifted += value
        shifted.round_()
        if zero is not None:
            shifted += zero
        q = shifted.clamp(qmin, qmax)
        inside = q == shifted  # where clamp passes the gradient
        if zero is not None:
            q -= zero
        ctx.save_for_backward(values, inverse, scale, q, inside)
        ctx.has_zero = zero is not None
        return q * scale

    @staticmethod
    def backward(ctx, grad):
        values, inverse, scale, q, inside = ctx.saved_tensors
        masked = grad * inside
        grad_value = masked * scale if ctx.needs_input_grad[1] else None
        grad_scale = grad_zero = None
        if ctx.needs_input_grad[2]:  # d/ds of q * s, and of q's w * (1 / s) where the grid does not clamp
            grad_scale = (grad * q).sum(-1, keepdim=True) - inverse * (masked * values).sum(-1, keepdim=True)
        if ctx.has_zero and ctx.needs_input_grad[3]:  # d/dz of (clamp(... + z) - z) * s: s inside, 0 - s outside
            grad_zero = (masked.sum(-1, keepdim=True) - grad.sum(-1, keepdim=True)) * scale
        return None, grad_value, grad_scale, grad_zero, None, None


def quantize(weight: torch.Tensor, rounding: Rounding, spec: WeightSpec, full_range: bool = False) -> QuantizedWeight:
    """The weight on its grid with the learned rounding: the scales are chosen as round-to-nearest chooses them,
    from the clipped group ranges (in the weight's dtype), so V = 0 with unit clipping gives `quantize_weight`'s.
    `full_range` (symmetric grids): auto-round's scales, `_full_range_scale` (negative where the larger side of a
    group's range is its maximum), in the scale dtype."""
    searched = family_of(spec).searched(weight, spec)
    if searched is not None:
        return _quantize_searched(weight, rounding, spec, searched)
    with torch.no_grad():
        groups = _grouped(weight, spec)
        low = (groups.amin(-1).float() * rounding.min_scale).to(weight.dtype)
        high = (groups.amax(-1).float() * rounding.max_scale).to(weight.dtype)
        qmin, qmax = spec.dtype.qrange
        if full_range and spec.symmetric:
            scale = _full_range_scale(low.float(), high.float(), spec).to(scale_dtype(weight, spec))
            zero = torch.zeros_like(scale, dtype=torch.int8)
        else:
            mapping = MappingType.SYMMETRIC if spec.symmetric else MappingType.ASYMMETRIC
            scale, zero = choose_qparams_affine_with_min_max(
                low, high, mapping, list(block_size(weight, spec)), torch.int8, qmin, qmax, eps=EPS,
                scale_dtype=scale_dtype(weight, spec), zero_point_dtype=torch.int8,
            )
        shifted = (groups * (1.0 / scale.unsqueeze(-1))).float() + _grouped(rounding.value, spec)
        offset = zero.unsqueeze(-1) if not spec.symmetric else 0
        qdata = torch.clamp(torch.round(shifted) + offset, qmin, qmax).to(torch.int8).reshape(weight.shape)
    return QuantizedWeight(qdata, scale, None if spec.symmetric else zero, spec)


def _quantize_searched(weight: torch.Tensor, rounding: Rounding, spec: WeightSpec, grid: SearchedGrid) -> QuantizedWeight:
    """The weight on a searched grid (llama.cpp's K) with the learned rounding V: codes as `k_grids.round_k` rounds
    them (V = 0: round to nearest's, bit for bit)."""
    with torch.no_grad():
        shifted, step, _ = _k_shifted(weight, grid, rounding.value)
        low, high = grid.code_range
        codes = torch.where(step == 0, 0.0, torch.round(shifted).clamp(low, high)).to(torch.int8)
    return grid.result(codes, spec)


# ---------------------------------------------------------------- tuning


@dataclass
class Tuned:
    roundings: dict[str, Rounding]  # the best iterate
    first_loss: float  # the first step's loss (round-to-nearest on its samples)
    best_loss: float
    best_iter: int
    step_seconds: float  # the median wall time of a step (the first, warming up, left out when there are others)


SampleLoss = Callable[[dict[str, torch.Tensor], list[int]], torch.Tensor]  # (fake-quantized weights, samples) ->
# each sample's loss, from one forward pass over them; its gradient is taken with respect to those weights (leaf
# tensors), so it must not detach them
GatherRows = Callable[[list[torch.Tensor], list[slice]], None]  # every rank fills its rows of the tensors; every
# rank ends with all of them (`distributed.all_gather_rows`)


@dataclass(frozen=True)
class Share:
    """How the ranks share a step's passes: which rank runs each (`owner(place in the step, samples)`), and how
    the passes' gradients and losses, one table row a pass, reach every rank. The default: one process."""

    rank: int = 0
    world_size: int = 1
    owner: Callable[[int, list[int]], int] = lambda place, samples: 0
    gather_rows: GatherRows = lambda tensors, shares: None


def draws(num_samples: int, batch_size: int, iters: int, generator: torch.Generator) -> list[list[int]]:
    """The samples of each step, as auto-round's `IndexSampler` draws them: consecutive slices of a shuffled order,
    shuffled again when fewer than a batch are left. Depends on the seed and sizes only, not on the ranks."""
    batch = min(batch_size, num_samples)
    order, at, out = torch.randperm(num_samples, generator=generator).tolist(), 0, []
    for _ in range(iters):
        if at + batch > num_samples:
            order, at = torch.randperm(num_samples, generator=generator).tolist(), 0
        out.append(sorted(order[at : at + batch]))
        at += batch
    return out


def passes(chosen: list[int], per_pass: int) -> list[list[int]]:
    """A step's samples cut into forward/backward passes of `per_pass` consecutive samples (the last one shorter)."""
    return [chosen[at : at + per_pass] for at in range(0, len(chosen), per_pass)]


def tune(weights: dict[str, torch.Tensor], specs: dict[str, WeightSpec], sample_loss: SampleLoss, num_samples: int,
         generator: torch.Generator, args: AutoRoundArgs = AutoRoundArgs(), per_pass: int = 1, share: Share = Share(),
         pass_dtype: torch.dtype | None = None) -> Tuned:
    """Tune a Rounding for each weight on the summed loss of `args.batch_size` samples a step (of `num_samples`),
    `per_pass` samples to a forward and backward pass; this rank runs the passes `share` gives it. The passes take
    the fake-quantized weights in `pass_dtype` (default: the weights' own; bfloat16 under autocast, where their
    gradients come out of bf16 products anyway). `args.iters` SignSGD steps; the iterate with the least loss is
    returned."""
    roundings = {name: Rounding.nearest(w, specs[name]) for name, w in weights.items()}
    tuned = [(r.value, args.rounding_lr, (-0.5, 0.5)) for r in roundings.values()]
    if args.minmax_tuning:
        tuned += [(t, args.clipping_lr, (0.0, 1.0)) for r in roundings.values() for t in (r.min_scale, r.max_scale)]
    params = [t.requires_grad_() for t, _, _ in tuned]
    groups = {name: Groups.of(w, specs[name]) for name, w in weights.items()}
    reused = Reused()
    leaves = {name: reused.get(("leaf", name), w.shape, pass_dtype or w.dtype, w.device).requires_grad_()
              for name, w in weights.items()}  # the fake-quantized weights the passes take, refilled every step
    kept = {name: r.clone() for name, r in roundings.items()}  # the best iterate yet, refilled in place
    first, best, seconds = None, (math.inf, 0), []
    for step, chosen in enumerate(draws(num_samples, args.batch_size, args.iters, generator)):
        started = time.perf_counter()
        with torch.enable_grad():  # once a step; the passes' gradients are carried back through it once
            fake = {name: fake_quantize(w, roundings[name], specs[name], args.full_range, groups[name])
                    for name, w in weights.items()}
        with torch.no_grad():
            for name, t in fake.items():
                leaves[name].copy_(t)
        flat, losses = _gradients(leaves, sample_loss, passes(chosen, per_pass), share, reused)
        loss = sum(losses.tolist()) / len(chosen)  # one value per sample, summed in one order on every rank
        first = loss if first is None else first
        if loss < best[0]:
            best = (loss, step)
            for name, rounding in roundings.items():
                kept[name].copy_(rounding)
        _sign_step(tuned, 1.0 - step / args.iters, _through_fake_quantization(fake, params, flat))
        seconds.append(time.perf_counter() - started)
    return Tuned(kept, first, best[0], best[1], statistics.median(seconds[1:] or seconds))


class Reused:
    """Tensors a step needs, allocated once for the whole tuning and refilled every step. On a CPU a fresh tensor
    the size of a layer's weights costs the page faults of new memory every time (filling 51 MB freshly
    allocated: ~13 ms; the same tensor again: ~2 ms): ~20 ms a step on a hidden-1024 layer."""

    def __init__(self) -> None:
        self._held: dict[object, torch.Tensor] = {}

    def get(self, key: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The tensor held under `key`, made (uninitialised) the first time or when its shape or dtype changes."""
        held = self._held.get(key)
        if held is None or held.shape != torch.Size(shape) or held.dtype != dtype or held.device != device:
            held = self._held[key] = torch.empty(shape, dtype=dtype, device=device)
        return held


CHUNK = 1 << 20  # elements: a mixed-dtype add converts its second operand in a temporary this size at most


def _gradients(leaves: dict[str, torch.Tensor], sample_loss: SampleLoss, step_passes: list[list[int]],
               share: Share = Share(), reused: Reused | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's gradient with respect to the fake-quantized weights (`leaves`), flat, float32 (or the leaves'
    dtype where wider), and its samples' losses (float64, in the step's sample order), the same on every rank.

    Each pass is its own forward and backward pass; its gradient does not depend on which rank runs it. This rank
    runs its passes into its rows of a table (a row a pass, in the leaves' dtype, rows grouped by rank); the rows
    are gathered onto every rank, and every rank adds the passes up in pass order: the arithmetic of one process, on
    any number of ranks. (float32, not float64: the sum of two bf16 passes is float32's correctly rounded one
    either way, and on a CPU bf16 -> float64 is ~30x slower than bf16 -> float32: 6.5 against 0.2 ms for the
    benchmark layer's two passes, measured alone.) The table and the sum are `reused`'s where given: the sum
    returned is then good until the next call with the same `reused`."""
    reused = reused if reused is not None else Reused()
    sizes = [leaf.numel() for leaf in leaves.values()]
    device, dtype = next(iter(leaves.values())).device, next(iter(leaves.values())).dtype
    owners = [share.owner(place, samples) for place, samples in enumerate(step_passes)]
    order = sorted(range(len(step_passes)), key=lambda place: (owners[place], place))  # the table's rows
    row = {place: at for at, place in enumerate(order)}
    grads = reused.get("table", (len(step_passes), sum(sizes)), dtype, device)  # every row is filled below
    losses = torch.zeros(len(step_passes), max(map(len, step_passes)), dtype=torch.float64, device=device)
    for place, samples in enumerate(step_passes):
        if owners[place] == share.rank:
            with torch.enable_grad():
                found = sample_loss(leaves, samples)
                pass_grads = torch.autograd.grad(found.sum(), list(leaves.values()), allow_unused=True)
            for into, grad in zip(grads[row[place]].split(sizes), pass_grads):
                if grad is None:
                    into.zero_()
                else:
                    into.copy_(grad.reshape(-1))
            losses[row[place], : len(samples)] = found.detach().double()
    counts = [owners.count(rank) for rank in range(share.world_size)]
    share.gather_rows([grads, losses], [slice(sum(counts[:rank]), sum(counts[: rank + 1])) for rank in range(share.world_size)])
    flat = reused.get("sum", (sum(sizes),), torch.promote_types(dtype, torch.float32), device)
    flat.copy_(grads[row[0]])
    for place in range(1, len(step_passes)):
        for into, part in zip(flat.split(CHUNK), grads[row[place]].split(CHUNK)):
            into.add_(part)
    return flat, torch.cat([losses[row[place], : len(samples)] for place, samples in enumerate(step_passes)])


def _through_fake_quantization(fake: dict[str, torch.Tensor], params: list[torch.Tensor],
                               flat: torch.Tensor) -> list[torch.Tensor | None]:
    """The gradients of `params` from the step's gradient with respect to the fake-quantized weights (`flat`): one
    backward pass through the step's fake-quantization `fake` (rounding straight through). Every rank holds the
    same gradient, so every rank gets the same (None: a parameter the loss does not reach)."""
    sizes = [t.numel() for t in fake.values()]
    upstream = [g.view(t.shape).float() for g, t in zip(flat.split(sizes), fake.values())]
    return list(torch.autograd.grad(list(fake.values()), params, upstream, allow_unused=True))


def _sign_step(tuned: list[tuple[torch.Tensor, float, tuple[float, float]]], decay: float,
               grads: list[torch.Tensor | None]) -> None:
    """Each (parameter, lr, bounds) with its gradient: p -= lr * decay * sign(gradient), then clamped to its bounds
    (V to [-0.5, 0.5], the clipping factors to [0, 1]). `decay` falls linearly to 0: torch's LinearLR, as
    auto-round schedules its steps."""
    with torch.no_grad():
        for (param, lr, (low, high)), grad in zip(tuned, grads):
            if grad is not None:
                param.add_(torch.sign(grad), alpha=-lr * decay)
            param.clamp_(low, high)
