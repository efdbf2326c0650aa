"""Sensitivity, measured: how much each candidate type of each tensor adds to the model's output error, in the
units of the KL divergence of the model's next-token distribution from the float model's.

Two measurements on the calibration samples, with the whole model in memory:

1. **A proxy per tensor and type** (one forward pass over up to MOMENT_SAMPLES samples): each Linear's input
   second moments E[x_j^2] (an importance matrix, llama.cpp's imatrix: the diagonal of GPTQ's Hessian over the
   token count) are collected; a type's proxy is sum_ij (W - Q(W))_ij^2 E[x_j^2], the expected squared error it
   adds to the Linear's output per token (Q rounded to nearest on the type's grid, the K types' search weighted by
   the same E[x^2]), computed on every k-th row (ROWS of them) and scaled to the whole weight: every format here
   rounds rows independently. The token embedding's is sum_t p(t) |E_t - Q(E)_t|^2 with p the tokens'
   frequencies in the samples, over the EMBEDDING_ROWS most frequent tokens.
2. **An end-to-end gain per role** (one forward per role over PROBE_SAMPLES samples): the proxy compares
   tensors of one role well, but not a value projection with an MLP's down projection: an error early in the
   residual stream or in a tensor the attention amplifies costs more at the output. So all tensors of a role
   (GGUF's: attn_q, attn_v, ffn_down, output, token_embd, ...) are put on their smallest candidate together, the
   KL divergence of the model's output from the float model's is measured, and the role's gain is that KL over
   the sum of its tensors' proxies there. A tensor's estimated error in a type is its role's gain times its proxy.

The estimate treats errors as additive; the benchmark (docs/benchmarks.md, "Fitting a budget") measures how the
plan it leads to does end to end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.evaluation.divergence import kl_divergence
from quantkit.grids import quantize_weight
from quantkit.quant import gguf_types
from quantkit.quant.registry import tensor_type_spec as spec_of

MOMENT_SAMPLES = 32  # samples the input moments are taken on (E[x^2] settles long before: it is a mean)
ROWS = 256  # rows of a weight its proxy is computed on: every k-th row, the sum scaled up (rows are alike)
EMBEDDING_ROWS = 2048  # the most frequent tokens' rows of the embedding (the others weigh little or nothing)
PROBE_SAMPLES = 4  # samples the gains' KL divergences are measured on
PROBE_FLOATS = 1 << 25  # and the reference logits kept for them: at most 128 MiB of float32
BATCH = 4


@dataclass
class Sensitivity:
    errors: dict[str, dict[str, float]]  # tensor -> type -> estimated added KL (nats per token)
    proxies: dict[str, dict[str, float]]  # tensor -> type -> the proxy (output squared error per token)
    gains: dict[str, float]  # role -> KL per unit of proxy
    role_kl: dict[str, float]  # role -> the KL measured with its tensors on their smallest candidate
    seconds: dict[str, float] = field(default_factory=dict)
    probe_tokens: int = 0
    tokens: int = 0


@torch.no_grad()
def measure(model: nn.Module, candidates: dict[str, list[str]], roles: dict[str, str], samples: torch.Tensor,
            embedding: str | None = None, members: dict[str, list[str]] | None = None,
            smallest: dict[str, str] | None = None) -> Sensitivity:
    """Estimated errors of each tensor in each of its `candidates` types. A tensor is a Linear's module name, or
    `embedding` (the token embedding's name), or a name `members` maps to Linears that take one type together (an
    MoE layer's experts of one projection: GGUF stacks them into one tensor; their proxies add up, so an expert
    few tokens reach weighs little, and one none reach nothing). `roles`: each tensor's role (its gain's group).
    `samples`: token ids [n, seq_len]. `smallest`: each tensor's smallest candidate, which its role's gain is
    measured in (by default the one of fewest bits, for GGML types)."""
    started = time.perf_counter()
    members = {name: (members or {}).get(name, [name]) for name in candidates}
    linears = {linear: model.get_submodule(linear) for name in candidates if name != embedding for linear in members[name]}
    moments, tokens = _input_moments(model, linears, samples[:MOMENT_SAMPLES])
    seconds = {"moments": time.perf_counter() - started}
    started = time.perf_counter()
    proxies = {}
    for name, types in candidates.items():
        if name == embedding:
            weight = model.get_input_embeddings().weight.data
            freq = torch.bincount(samples.flatten(), minlength=weight.shape[0])[: weight.shape[0]].float() / samples.numel()
            top = freq.topk(min(EMBEDDING_ROWS, int((freq > 0).sum()))).indices.sort().values
            proxies[name] = {t: _proxy(weight[top], t, freq[top], rows=True) for t in types}
        else:
            proxies[name] = {t: sum(_proxy(linears[m].weight.data, t, moments[m]) for m in members[name]) for t in types}
    seconds["proxies"] = time.perf_counter() - started
    started = time.perf_counter()
    probe = samples[: max(1, min(PROBE_SAMPLES, PROBE_FLOATS // (samples.shape[1] * model.config.vocab_size)))]
    reference = _logits(model, probe)
    role_kl, gains = {}, {}
    for role in sorted(set(roles.values())):
        of_role = [name for name in candidates if roles[name] == role]
        least = {name: (smallest or {}).get(name) or min(candidates[name], key=gguf_types.bits_per_weight) for name in of_role}
        with _on_grids(model, {m: t for name, t in least.items() for m in members[name]}, embedding):
            role_kl[role] = float(kl_divergence(reference, _logits(model, probe))[0].mean())
        proxy = sum(proxies[name][least[name]] for name in of_role)
        gains[role] = role_kl[role] / proxy if proxy > 0 else 0.0
    seconds["gains"] = time.perf_counter() - started
    errors = {name: {t: gains[roles[name]] * p for t, p in by_type.items()} for name, by_type in proxies.items()}
    return Sensitivity(errors, proxies, gains, role_kl, seconds, probe.numel(), tokens)


def _input_moments(model: nn.Module, linears: dict[str, nn.Linear], samples: torch.Tensor) -> tuple[dict, int]:
    """E[x_j^2] of each Linear's input over every sample token (float32 [in]), and the token count."""
    sums = {name: torch.zeros(m.in_features, dtype=torch.float32) for name, m in linears.items()}

    def hook(name):
        def accumulate(module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sums[name] += (x * x).sum(0).cpu()
        return accumulate

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in linears.items()]
    try:
        for batch in samples.split(BATCH):
            model(batch.to(_device(model)))
    finally:
        for handle in handles:
            handle.remove()
    count = samples.numel()
    return {name: s / count for name, s in sums.items()}, count


def _proxy(weight: torch.Tensor, type_name: str, importance: torch.Tensor, rows: bool = False) -> float:
    """sum (W - Q(W))^2 weighted by `importance`: per column (a Linear's E[x^2]) or per row (`rows`: the
    embedding's token frequencies, all rows given); a Linear's on every k-th of its rows (ROWS), scaled up."""
    stride = 1 if rows else max(1, weight.shape[0] // ROWS)
    w = weight[::stride].float()
    spec = spec_of(type_name)
    if spec is None:
        return 0.0
    column_importance = None if rows else importance.to(w.device)
    q = quantize_weight(w, spec, importance=column_importance).dequantize(torch.float32)
    error = (w - q).pow_(2)
    weighted = error.sum(1) * importance.to(w.device) if rows else error @ importance.to(w.device)
    return float(weighted.sum()) * (weight.shape[0] / w.shape[0])


class _on_grids:
    """Inside: the given tensors hold their types' rounded values (the rest float); restored on leaving."""

    def __init__(self, model: nn.Module, types: dict[str, str], embedding: str | None):
        self.model, self.types, self.embedding, self.saved = model, types, embedding, {}

    def _param(self, name: str) -> nn.Parameter:
        return self.model.get_input_embeddings().weight if name == self.embedding else self.model.get_submodule(name).weight

    def __enter__(self):
        for name, type_name in self.types.items():
            param = self._param(name)
            self.saved[name] = param.data
            spec = spec_of(type_name)
            if spec is not None:
                param.data = quantize_weight(param.data.float(), spec).dequantize(torch.float32).to(param.dtype)
        return self

    def __exit__(self, *exc):
        for name, data in self.saved.items():
            self._param(name).data = data


def _logits(model: nn.Module, samples: torch.Tensor) -> torch.Tensor:
    """float32 logits [tokens, vocab] of every position of `samples`."""
    logits = [model(b.to(_device(model))).logits.float().cpu() for b in samples.split(BATCH)]
    return torch.cat(logits).flatten(0, -2)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
