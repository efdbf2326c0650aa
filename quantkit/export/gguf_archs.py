"""What llama.cpp's Gemma2, Gemma3 and Phi-3 graphs need beyond the Llama family's: metadata keys, tensor values,
extra tensors, and the configs they cannot compute.

Written as llama.cpp's converter writes these architectures (convert_hf_to_gguf's Gemma2Model, Gemma3Model,
Phi3MiniModel), so that llama.cpp computes what the Hugging Face model computes:
- Gemma's RMSNorms multiply by (1 + weight): the file holds 1 + weight (every `*norm.weight`, q/k norms included),
  added in float32 as Hugging Face computes it; the embedding's sqrt(hidden) scale is in llama.cpp's graph; a tied
  lm_head is token_embd (llama.cpp's Gemma2 has no output tensor).
- Gemma's attention and final logit soft-capping, its sliding window and which layers slide (written per layer, so
  any `layer_types` reaches llama.cpp as Hugging Face has it), its RoPE bases (Gemma3: global and local).
- Phi-3's fused qkv_proj and gate_up_proj are llama.cpp's attn_qkv and ffn_up as they are; LongRoPE's per-dimension
  factors are the rope_factors_long / rope_factors_short tensors and its attention factor a key.

A config llama.cpp would compute differently is refused (`refusal`) before any weight is read: llama.cpp fixes
what Hugging Face configures (Gemma's query scale follows its model size, Gemma2 always soft-caps, Phi-3's sliding
window is switched off), so such a model written anyway would run, and compute another model.
"""

from __future__ import annotations

import math

import numpy as np
import torch

GEMMA = {"gemma2", "gemma3_text"}
ARCHITECTURES = {"gemma2": "GEMMA2", "gemma3_text": "GEMMA3", "phi3": "PHI3"}  # Hugging Face model_type -> llama.cpp's
# llama.cpp scales Gemma's queries by 1/sqrt(hidden / heads) for the model size it names 27B (by its layer count),
# by 1/sqrt(head_dim) for every other: Hugging Face by query_pre_attn_scalar ** -0.5.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


# Keys gguf 0.17 (the lowest release quantkit supports) has no writer method for: written by name, as gguf 0.19's
# add_sliding_window_pattern / add_rope_freq_base_swa write them
SLIDING_WINDOW_PATTERN = "{arch}.attention.sliding_window_pattern"
FREQ_BASE_SWA = "{arch}.rope.freq_base_swa"


def refusal(config) -> str | None:
    """Why llama.cpp's graph for `config`'s architecture would compute another model than Hugging Face's, or None."""
    checks = {"gemma2": _gemma2_refusal, "gemma3_text": _gemma3_refusal, "phi3": _phi3_refusal,
              "qwen3_moe": _qwen3_moe_refusal}
    check = checks.get(config.model_type)
    return check(config) if check else None


def _qwen3_moe_refusal(config) -> str | None:
    if not getattr(config, "norm_topk_prob", True):
        return ("norm_topk_prob false: llama.cpp's Qwen3-MoE always rescales the chosen experts' weights to sum "
                "to 1 (released Qwen3-MoE models set it true)")
    return None


def _gemma_refusal(config) -> str | None:
    """What Gemma2 and Gemma3 share: the query scale, the GELU, the attention without biases."""
    expected = (config.hidden_size // config.num_attention_heads
                if config.num_hidden_layers == GEMMA_27B_LAYERS[config.model_type] else config.head_dim)
    if config.query_pre_attn_scalar != expected:
        return (f"query_pre_attn_scalar {config.query_pre_attn_scalar}: llama.cpp scales queries by 1/sqrt({expected}) "
                f"for a model of {config.num_hidden_layers} layers")
    if config.hidden_activation != "gelu_pytorch_tanh":
        return f"hidden_activation {config.hidden_activation}: llama.cpp's Gemma MLP is GELU's tanh approximation"
    if getattr(config, "attention_bias", False):
        return "attention_bias: llama.cpp's Gemma attention has no biases"
    if any(t not in ("sliding_attention", "full_attention") for t in layer_types(config)):
        return f"layer types {sorted(set(layer_types(config)))}: llama.cpp knows sliding and full attention"
    return None


def _gemma2_refusal(config) -> str | None:
    if config.attn_logit_softcapping is None or config.final_logit_softcapping is None:
        return "no logit soft-capping: llama.cpp's Gemma2 graph always caps attention and final logits"
    if not config.tie_word_embeddings:
        return "an lm_head apart from the embedding: llama.cpp's Gemma2 computes logits with token_embd"
    if "sliding_attention" not in layer_types(config):
        return "no sliding layer: llama.cpp's Gemma2 graph needs one (else it slides every other layer)"
    kind = rope_kind(rope_parameters(config))
    if kind not in ("default", "linear"):
        return f"RoPE scaling '{kind}': quantkit describes Gemma2's default and linear RoPE to llama.cpp"
    return _gemma_refusal(config)


def _gemma3_refusal(config) -> str | None:
    if config.attn_logit_softcapping is not None:
        return "attention logit soft-capping: llama.cpp's Gemma3 graph has none"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention: llama.cpp's Gemma3 is causal"
    full, local = gemma3_rope(config)
    if rope_kind(full) not in ("default", "linear"):
        return (f"RoPE scaling '{rope_kind(full)}' on the global layers: llama.cpp's Gemma3 scales them linearly "
                "or not at all")
    if rope_kind(local) != "default":
        return f"RoPE scaling '{rope_kind(local)}' on the sliding layers: llama.cpp's Gemma3 leaves them unscaled"
    return _gemma_refusal(config)


def _phi3_refusal(config) -> str | None:
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        return (f"a sliding window of {window} tokens in a context of {config.max_position_embeddings}: llama.cpp "
                "switches Phi-3's sliding window off, so it attends further than the model does")
    if config.hidden_act != "silu":
        return f"hidden_act {config.hidden_act}: llama.cpp's Phi-3 MLP is SwiGLU"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        return f"head_dim {head_dim}: llama.cpp's Phi-3 takes hidden_size / heads"
    rope = rope_parameters(config)
    if rope_kind(rope) not in ("default", "longrope"):
        return f"RoPE scaling '{rope_kind(rope)}': quantkit describes Phi-3's default RoPE and LongRoPE to llama.cpp"
    return None


# ---------------------------------------------------------------- metadata


def describe(writer, config) -> None:
    """The keys of `config`'s architecture beyond the Llama family's common ones (`gguf.describe_model`)."""
    {"gemma2": _describe_gemma2, "gemma3_text": _describe_gemma3, "phi3": _describe_phi3}[config.model_type](writer, config)


def _describe_gemma(writer, config) -> None:
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    sliding = [t == "sliding_attention" for t in layer_types(config)]
    if any(sliding):
        writer.add_sliding_window(config.sliding_window)
        writer.add_array(SLIDING_WINDOW_PATTERN.format(arch=writer.arch), sliding)  # read before its default pattern


def _describe_gemma2(writer, config) -> None:
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    _linear_scaling(writer, rope)
    writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
    _describe_gemma(writer, config)


def _describe_gemma3(writer, config) -> None:
    full, local = gemma3_rope(config)
    writer.add_rope_freq_base(float(full.get("rope_theta", 1_000_000.0)))
    writer.add_float32(FREQ_BASE_SWA.format(arch=writer.arch), float(local.get("rope_theta", 10000.0)))
    _linear_scaling(writer, full)  # llama.cpp scales the global layers only, as Hugging Face does
    _describe_gemma(writer, config)


def _describe_phi3(writer, config) -> None:
    rope = rope_parameters(config)
    writer.add_rope_scaling_orig_ctx_len(_original_context(config))
    writer.add_rope_dimension_count(_phi3_rope_dims(config))
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_sliding_window(getattr(config, "sliding_window", None) or 0)
    if rope_kind(rope) == "longrope":
        writer.add_rope_scaling_attn_factors(longrope_attention_factor(config))


def _linear_scaling(writer, rope: dict) -> None:
    if rope_kind(rope) == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))


def longrope_attention_factor(config) -> float:
    """The factor LongRoPE multiplies cos and sin by, as Hugging Face computes it (its `attention_factor`, else
    sqrt(1 + ln(factor) / ln(original context)), factor the context's growth): llama.cpp's rope.scaling.attn_factor."""
    rope = rope_parameters(config)
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = rope.get("factor") or config.max_position_embeddings / _original_context(config)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(_original_context(config)))


# ---------------------------------------------------------------- tensors


def stored_value(model_type: str, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """An unquantized tensor as llama.cpp's graph reads it: Gemma's norm weights as 1 + weight, in float32 (what
    Hugging Face's Gemma RMSNorm multiplies by; llama.cpp's norms multiply by the weight)."""
    if model_type in GEMMA and key.endswith("norm.weight"):
        return tensor.float() + 1.0
    return tensor


def extra_tensors(config) -> dict[str, np.ndarray]:
    """Tensors llama.cpp reads that no module holds: Phi-3 LongRoPE's per-dimension factors (float32)."""
    rope = rope_parameters(config)
    if config.model_type != "phi3" or rope_kind(rope) != "longrope":
        return {}
    return {"rope_factors_long.weight": np.asarray(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.asarray(rope["short_factor"], dtype=np.float32)}


# ---------------------------------------------------------------- config readers


def rope_parameters(config) -> dict:
    """The rope parameters in either of transformers' spellings (`rope_parameters` in 5.x, `rope_theta` /
    `rope_scaling` before)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        if getattr(config, "rope_theta", None) is not None:
            params["rope_theta"] = config.rope_theta
    return params



def rope_kind(rope: dict) -> str:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    return "longrope" if kind == "su" else kind


def gemma3_rope(config) -> tuple[dict, dict]:
    """(the global layers' rope parameters, the sliding layers'), from either of transformers' spellings."""
    rope = rope_parameters(config)
    if "full_attention" in rope or "sliding_attention" in rope:
        return dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    return rope, {"rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}


def layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or (2 if config.model_type == "gemma2" else 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config.num_hidden_layers)]


def _original_context(config) -> int:
    rope = rope_parameters(config)
    return int(rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
               or config.max_position_embeddings)


def _phi3_rope_dims(config) -> int:
    """llama.cpp's converter's rope dimension count: int(partial rotary factor x hidden) // heads."""
    factor = rope_parameters(config).get("partial_rotary_factor", 1.0)
    return int(factor * config.hidden_size) // config.num_attention_heads
