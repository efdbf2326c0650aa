"""Learned rotations (SpinQuant): R1 and R2 optimized on the calibration data for the quantized model's loss.

Hadamard rotations spread outliers blindly; SpinQuant learns them. Starting from the recipe's Hadamard (or
random-Hadamard) matrices, R1 (the residual stream, hidden x hidden) and one R2 per decoder layer (head_dim x
head_dim) take Cayley SGD steps (`algorithms.cayley`: they stay orthogonal) that lower the next-token loss of the
model as the recipe quantizes it:

- the whole model is held on the compute device, its norms folded into the Linears they feed (`Rotator.fold`);
- every planned Linear computes with the recipe's fake-quantized activations (QAT's fake quantizers, a
  straight-through backward), and with its fake-quantized weights (rounded to nearest) unless a quantizer that
  chooses its own rounding afterwards (GPTQ, AutoRound) follows on a scheme with quantized activations: then the
  weights stay float, as SpinQuant trains for GPTQ. A weight-only scheme always trains on the rounded weights
  (with float weights and activations the loss would not depend on the rotation at all);
- each step the model computes with its float weights rotated by the current matrices (`functional_call`, the
  products of `algorithms.rotation`): the weights are never changed, only R1 and the R2s have gradients;
- the learning rate decays by a cosine to zero (SpinQuant: 1.5, 100 steps).

Data-parallel: every step takes one batch of `batch_size` calibration samples (batches cycle through the
samples in order, the same whatever the ranks), of which each rank computes its share; the gradients are
summed over the ranks, so every rank takes the same step and ends with the same matrices. The learned matrices
are then fused into the weights as the Hadamard ones are (`Rotator.learned`, `rotate_model`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from quantkit.algorithms.cayley import cayley_step, cosine_learning_rate
from quantkit.algorithms.rotation import heads_bias, heads_input, heads_output
from quantkit.errors import CalibrationError
from quantkit.models import architectures
from quantkit.quant.plan import ModulePlan
from quantkit.quant.registry import Recipe
from quantkit.quant.rotations import Rotator, transform_matrix
from quantkit.runtime import distributed
from quantkit.runtime.progress import QUIET, Progress

__all__ = ["learn_rotations", "RotatedWeights", "save", "restore"]


def learn_rotations(model: nn.Module, rotator: Rotator, plan: list[ModulePlan], recipe: Recipe, samples: torch.Tensor,
                    device: torch.device, batch_size: int = 8, progress: Progress = QUIET, ctx=None) -> dict:
    """Learn `rotator`'s R1 / R2 on `samples` [num_samples, seq_len] for `model` (whole, in CPU memory) and hand
    them to it (`Rotator.learned`); the model's norms are folded (its function unchanged) and it is back in CPU
    memory, unrotated, when this returns. Returns the summary quantkit.json records."""
    transform = rotator.learning
    learning = transform.learn
    started = time.perf_counter()
    rotator.fold(model)
    weights = RotatedWeights(model, rotator)
    r1 = transform_matrix(transform, rotator.hidden, device=device) if "R1" in transform.rotations else None
    r2 = transform_matrix(transform, rotator.head_dim, device=device).expand(len(weights.wirings), -1, -1).clone() \
        if "R2" in transform.rotations else None
    world, rank = (ctx.world_size, ctx.rank) if ctx is not None and ctx.distributed else (1, 0)
    count = min(batch_size, samples.shape[0])
    losses, durations = [], []
    with _on_device(model, device), _fake_quantized(model, plan, recipe):
        with progress.task(f"Learning rotations ({'+'.join(transform.rotations)}, {learning.steps} steps)",
                           total=learning.steps) as advance:
            for step in range(learning.steps):
                step_started = time.perf_counter()
                ids = _share(samples, step, count, rank, world).to(device)
                loss, grads = _loss_and_gradients(model, weights, r1, r2, ids, count * (samples.shape[1] - 1))
                flat = torch.cat([loss.reshape(1)] + [g.reshape(-1) for g in grads])
                distributed.all_reduce_(flat, ctx)  # every rank: the whole batch's loss and gradients
                losses.append(float(flat[0]))
                if not torch.isfinite(flat).all():  # a step would make the matrices NaN, and the artifact garbage
                    raise CalibrationError(
                        f"learning the rotations: the loss or its gradient is not finite at step {step + 1} (loss "
                        f"{losses[-1]:.4g}); load the model in float32 (--dtype float32) or lower learn.learning_rate")
                rate = cosine_learning_rate(learning.learning_rate, step, learning.steps)
                offset = 1
                if r1 is not None:
                    r1 = cayley_step(r1, flat[offset:offset + r1.numel()].view_as(r1), rate)
                    offset += r1.numel()
                if r2 is not None:
                    r2 = cayley_step(r2, flat[offset:offset + r2.numel()].view_as(r2), rate)
                durations.append(time.perf_counter() - step_started)
                advance(description=f"Learning rotations: step {step + 1}/{learning.steps}, loss {losses[-1]:.4f}")
    window = max(1, min(10, len(losses) // 4))
    summary = {"steps": learning.steps, "learning_rate": learning.learning_rate, "samples_per_step": count,
               "passes_over_samples": round(learning.steps * count / samples.shape[0], 2),
               "loss_first_steps": round(sum(losses[:window]) / window, 4),
               "loss_last_steps": round(sum(losses[-window:]) / window, 4),
               "seconds": round(time.perf_counter() - started, 3),
               "seconds_per_step": round(sorted(durations[1:] or durations)[len(durations[1:] or durations) // 2], 4)}
    rotator.learned(r1.cpu() if r1 is not None else None, list(r2.cpu()) if r2 is not None else None, summary)
    return summary


def save(path, rotator: Rotator) -> None:
    """The learned matrices and their summary, for a resumed run (`restore`): written to a temporary name, renamed."""
    import json
    import os

    from safetensors.torch import save_file

    tensors = {"R1": rotator.r1} if isinstance(rotator.r1, torch.Tensor) else {}
    if rotator.r2_per_layer is not None:
        tensors["R2"] = torch.stack(rotator.r2_per_layer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"summary": json.dumps(rotator.learned_summary)})
    os.replace(tmp, path)


def restore(path, rotator: Rotator) -> None:
    """Hand `rotator` the matrices an interrupted run learned (`save`)."""
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        summary = json.loads(handle.metadata()["summary"])
    r2 = tensors.get("R2")
    rotator.learned(tensors.get("R1"), list(r2) if r2 is not None else None, {**summary, "restored": True})


def _share(samples: torch.Tensor, step: int, count: int, rank: int, world: int) -> torch.Tensor:
    """This rank's share of step `step`'s batch: samples step·count ... (cycling), split in rank order."""
    indices = [(step * count + j) % samples.shape[0] for j in range(count)]
    return samples[indices[rank * count // world:(rank + 1) * count // world]]


def _loss_and_gradients(model: nn.Module, weights: "RotatedWeights", r1: torch.Tensor | None, r2: torch.Tensor | None,
                        ids: torch.Tensor, tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's part of the batch loss (its tokens' cross-entropy summed, over the batch's `tokens`) and its
    gradients in R1 and R2 (zeros for a rank with no sample in this batch)."""
    leaves = [r.to(torch.float32).requires_grad_() for r in (r1, r2) if r is not None]
    if ids.shape[0] == 0:
        return torch.zeros((), dtype=torch.float64, device=leaves[0].device), [torch.zeros_like(x) for x in leaves]
    it = iter(leaves)
    q1 = next(it) if r1 is not None else None
    q2 = next(it) if r2 is not None else None
    logits = functional_call(model, weights(q1, q2), (ids,)).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum") / tokens
    grads = torch.autograd.grad(loss, leaves)
    return loss.detach().double(), [g.double() for g in grads]


class RotatedWeights:
    """The weights `model` computes with under rotations R1 (None: not rotated) and R2 [layers, head_dim,
    head_dim]: name -> tensor for every parameter they change, differentiable in the matrices (the parameters
    themselves are not changed). The same products `Rotator.rotate_layer` applies in place."""

    def __init__(self, model: nn.Module, rotator: Rotator):
        layers = architectures.decoder_layers(model)
        self.prefix = architectures.module_name(model, layers)
        self.embeddings = architectures.module_name(model, model.get_input_embeddings())
        self.head = architectures.module_name(model, model.get_output_embeddings())
        self.wirings = [architectures.residual_modules(layer, rotator.hidden, rotator._value_rows()) for layer in layers]
        self.value_rows = rotator.kv_heads * rotator.head_dim
        self.head_dim = rotator.head_dim
        self.params = dict(model.named_parameters())

    def __call__(self, r1: torch.Tensor | None, r2: torch.Tensor | None) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}

        def change(name: str, function) -> None:
            if name in self.params:
                current = out.get(name, self.params[name])
                out[name] = function(current.to(torch.float32)).to(current.dtype)

        if r1 is not None:
            change(f"{self.embeddings}.weight", lambda w: w @ r1)
            change(f"{self.head}.weight", lambda w: w @ r1)
        for i, wiring in enumerate(self.wirings):
            name = lambda module, kind="weight": f"{self.prefix}.{i}.{module}.{kind}"  # noqa: E731
            if r1 is not None:
                for reader in (*wiring.attention_readers, *wiring.mlp_readers):
                    change(name(reader), lambda w: w @ r1)
                for writer in (wiring.attention_writer, *wiring.mlp_writers):
                    change(name(writer), lambda w: r1.T @ w)
                    change(name(writer, "bias"), lambda b: b @ r1)
            if r2 is not None:
                q, rows = r2[i], slice(wiring.value_rows, wiring.value_rows + self.value_rows)
                change(name(wiring.values), lambda w: _rows_replaced(w, rows, heads_output(w[rows], q, self.head_dim)))
                change(name(wiring.values, "bias"),
                       lambda b: _rows_replaced(b, rows, heads_bias(b[rows], q, self.head_dim)))
                change(name(wiring.attention_writer), lambda w: heads_input(w, q, self.head_dim))
        return out


def _rows_replaced(tensor: torch.Tensor, rows: slice, value: torch.Tensor) -> torch.Tensor:
    return torch.cat([tensor[:rows.start], value, tensor[rows.stop:]])


@contextmanager
def _on_device(model: nn.Module, device: torch.device):
    """The model on `device`, its parameters without gradients, for the block; back in CPU memory after."""
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    model.requires_grad_(False)
    model.to(device)
    try:
        yield
    finally:
        model.to("cpu")
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])


@contextmanager
def _fake_quantized(model: nn.Module, plan: list[ModulePlan], recipe: Recipe):
    """Every planned Linear computing with the recipe's fake-quantized activations, and weights unless a quantizer
    that reads data (GPTQ, AutoRound) rounds them later on a scheme whose activations are quantized, for the block."""
    from quantkit.quant import fake_quant

    fake_quant.prepare(model, plan)
    if recipe.quantizer.algorithm.needs_data and recipe.scheme.activations is not None:
        for module in model.modules():
            if isinstance(module, fake_quant.QATLinear):
                module.weight_fake_quantizer.enabled = False
    try:
        yield
    finally:
        fake_quant.strip(model)
