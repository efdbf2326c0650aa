"""Attention for AutoRound's tuning passes on CPU in bfloat16 (autocast): the same computation as transformers'
`sdpa` attention, with the two products as bf16 matrix multiplications and the softmax in float32.

torch's CPU flash-attention kernel, which `scaled_dot_product_attention` picks for bf16 on CPU, runs well below
the CPU's bf16 matmul rate at calibration lengths (256 tokens, 4 heads of 64, 4 samples: 10.8 ms forward and
backward against 5.2 ms this way on an AVX512-BF16 core), and its math fallback multiplies in float32. As in
transformers' eager attention under autocast, the scores are rounded to bf16 by their product before the float32
softmax. Anything else `sdpa` handles differently (a position bias, logit soft-capping, another device or dtype,
dropout) goes to transformers' `sdpa` itself.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

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
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = q_length > 1 and attention_mask is None and is_causal
    if causal:  # as sdpa: causal attention is aligned to the first key
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = torch.matmul(query, key.transpose(2, 3)).float() * scale
    if causal:
        weights = torch.softmax(scores + _causal_mask(q_length, scores.device), dim=-1)
    elif attention_mask is not None:
        scores = (scores.masked_fill(~attention_mask, -math.inf) if attention_mask.dtype == torch.bool
                  else scores + attention_mask)
        nothing = (scores == -math.inf).all(-1, keepdim=True)  # a query that may see no key: zeros, as sdpa gives
        weights = torch.softmax(scores.masked_fill(nothing, 0.0), dim=-1).masked_fill(nothing, 0.0)
    else:
        weights = torch.softmax(scores, dim=-1)
    weights = weights.bfloat16()
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


def _in_bf16(query: torch.Tensor) -> bool:
    """Whether attention on `query` computes in bf16: bf16 itself, or under CPU bf16 autocast (rotary embeddings in
    float32 make float32 queries of the bf16 projections)."""
    return query.dtype == torch.bfloat16 or (torch.is_autocast_enabled("cpu")
                                             and torch.get_autocast_dtype("cpu") == torch.bfloat16)


def _causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """0 on and below the diagonal, -inf above it (float32)."""
    return torch.full((length, length), -math.inf, device=device).triu_(1)


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
