"""Attention for AutoRound's tuning passes on CPU in bfloat16 (autocast): the same computation as transformers'
`sdpa` attention, as two bf16 matrix multiplications around a softmax that computes in float32.

torch's CPU flash-attention kernel, which `scaled_dot_product_attention` picks for bf16 on CPU, runs well below
the CPU's bf16 matmul rate at calibration lengths (256 tokens, 4 heads of 64, 4 samples: 10.8 ms forward and
backward), and its math fallback multiplies in float32. Here the scores' scaling and mask (causal or the
caller's, as an additive bf16 bias) are folded into their product (`baddbmm`), and the softmax takes and gives
bf16 (float32 inside: its output is float32's rounded to bf16, bit for bit), so no score-sized tensor is converted,
scaled or masked on its own: 2.8 ms forward and backward for the same shapes (the float32-score version before it:
6-8 ms; most of a tuning pass's time outside the weight products was spent on those score-sized copies). Anything
else `sdpa` handles differently (a position bias, logit soft-capping, another device or dtype, dropout) goes to
transformers' `sdpa` itself.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch import nn
from transformers import AttentionInterface

from quantkit.models import compat
sdpa_attention_forward, repeat_kv = compat.sdpa_attention()

NAME = "quantkit_cpu_bf16"  # its name in transformers' attention registry


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (batch, heads, tokens, head_dim) in, (batch, tokens, heads,
    head_dim) out, the mask boolean (True: attend) or additive, None for causal attention."""
    if (query.device.type != "cpu" or not _in_bf16(query) or dropout or kwargs.get("softcap") is not None
            or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    query, key, value = query.bfloat16(), repeat_kv(key.bfloat16(), groups), repeat_kv(value.bfloat16(), groups)
    batch, heads, q_length, head_dim = query.shape
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = q_length > 1 and attention_mask is None and is_causal
    if causal:  # as sdpa: causal attention is aligned to the first key
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    bias = _causal_bias(q_length, key.shape[2], query.device) if causal else _mask_bias(attention_mask)
    nothing = None  # the queries that may see no key: zeros, as sdpa gives
    if bias is not None and bias.dim() == 4 and bool(torch.isneginf(bias).all(-1).any()):
        nothing = torch.isneginf(bias).all(-1, keepdim=True)
        bias = bias.masked_fill(nothing, 0.0)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    flat = lambda t: t.reshape(batch * heads, *t.shape[2:])  # noqa: E731
    scores = torch.baddbmm(_batched(bias, batch, heads, query.device), flat(query), flat(key).transpose(1, 2),
                           beta=0.0 if bias is None else 1.0, alpha=scale)
    weights = torch.softmax(scores, dim=-1)  # bf16 in and out, float32 inside
    if nothing is not None:
        weights = weights.view(batch, heads, *weights.shape[1:]).masked_fill(nothing, 0.0).flatten(0, 1)
    out = torch.bmm(weights, flat(value)).view(batch, heads, q_length, -1)
    return out.transpose(1, 2).contiguous(), None


def _in_bf16(query: torch.Tensor) -> bool:
    """Whether attention on `query` computes in bf16: bf16 itself, or under CPU bf16 autocast (rotary embeddings in
    float32 make float32 queries of the bf16 projections)."""
    return query.dtype == torch.bfloat16 or (torch.is_autocast_enabled("cpu")
                                             and torch.get_autocast_dtype("cpu") == torch.bfloat16)


def _causal_bias(q_length: int, k_length: int, device: torch.device) -> torch.Tensor:
    """0 on and below the diagonal, -inf above it (bf16, [queries, keys])."""
    return torch.full((q_length, k_length), -math.inf, dtype=torch.bfloat16, device=device).triu_(1)


def _mask_bias(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A transformers mask ([batch or 1, heads or 1, queries, keys], boolean True: attend, or additive) as an additive
    bf16 bias: -inf where masked; finite additive values below bf16's range stay finite (its smallest value)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.bfloat16, device=mask.device).masked_fill_(~mask, -math.inf)
    lowest = torch.finfo(torch.bfloat16).min
    return torch.where(torch.isneginf(mask), mask, mask.clamp(min=lowest)).bfloat16()


def _batched(bias: torch.Tensor | None, batch: int, heads: int, device: torch.device) -> torch.Tensor:
    """The bias broadcastable to the flattened (batch x heads, queries, keys) scores (a 0-d zero where there is none,
    which `baddbmm` with beta 0 ignores)."""
    if bias is None:
        return torch.zeros((), dtype=torch.bfloat16, device=device)
    if bias.dim() == 2 or bias.shape[:2] == (1, 1):
        return bias.reshape(bias.shape[-2:])
    return bias.expand(batch, heads, *bias.shape[2:]).reshape(batch * heads, *bias.shape[2:])


AttentionInterface.register(NAME, attention)


@contextlib.contextmanager
def bf16_cpu_attention(layer: nn.Module) -> Iterator[None]:
    """While it lasts, the layer's attention modules that use transformers' `sdpa` use `attention` (their configs'
    attention implementation, restored afterwards)."""
    configs = {id(m.config): m.config for m in layer.modules()
               if getattr(getattr(m, "config", None), "_attn_implementation", None) == "sdpa"}
    for config in configs.values():
        config._attn_implementation = NAME
    try:
        yield
    finally:
        for config in configs.values():
            config._attn_implementation = "sdpa"
