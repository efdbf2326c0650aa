"""What mlx-lm's Qwen3-MoE, Gemma2, Gemma3 and Phi-3 models need beyond the Llama family's: stacked experts, config
keys, and the configs they cannot compute.

Written as `mlx_lm.convert` writes these architectures (mlx-lm 0.32's models/qwen3_moe.py, gemma2.py,
gemma3_text.py, phi3.py), so that mlx-lm computes what the Hugging Face model computes:
- Qwen3-MoE's experts are mlx-lm's `switch_mlp`: one [experts, out, in] tensor per projection and part
  (`mlp.switch_mlp.gate_proj.{weight,scales,biases}`), which mlx-lm's `sanitize` stacks only for float weights;
  every expert of a projection on one grid. `num_experts` is written (transformers 5 writes `num_local_experts`).
  The router stays in full precision (mlx-lm's `convert` quantizes it to 8 bits; its loader takes either).
- Gemma's norms are stored as Hugging Face stores them (mlx-lm's RMSNorm multiplies by 1 + weight, as Hugging
  Face's), its tied lm_head is the embedding (`as_linear`).
- Gemma3's RoPE bases (global `rope_theta`, local `rope_local_base_freq`), the global layers' scaling, and which
  layers slide (`sliding_window_pattern`: mlx-lm slides every layer but each pattern-th) at the top of config.json.
- Phi-3's fused qkv_proj and gate_up_proj are mlx-lm's as they are; `partial_rotary_factor` at the top.

A config mlx-lm would compute differently is refused (`refusal`) before any weight is read. mlx-lm's Gemma2 and
Phi-3 attend over the whole context where Hugging Face slides a window: the same model up to the window, a note
in the summary (`notes`) beyond it.
"""

from __future__ import annotations

import re

import torch

from quantkit.errors import ExportError
from quantkit.export.gguf_archs import gemma3_rope, layer_types, rope_kind, rope_parameters

EXPERTS = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)(?P<part>\.\w+)?$")
GELU_TANH = "gelu_pytorch_tanh"  # mlx-lm's Gemma MLPs: nn.gelu_approx


def refusal(config) -> str | None:
    """Why mlx-lm's model for `config`'s architecture would compute another model than Hugging Face's, or None."""
    checks = {"qwen3_moe": _qwen3_moe_refusal, "gemma2": _gemma2_refusal, "gemma3_text": _gemma3_refusal,
              "phi3": _phi3_refusal}
    check = checks.get(config.model_type)
    return check(config) if check else None


def _qwen3_moe_refusal(config) -> str | None:
    if rope_kind(rope_parameters(config)) != "default":
        return f"RoPE scaling '{rope_kind(rope_parameters(config))}': mlx-lm's Qwen3-MoE rotates without scaling"
    if getattr(config, "use_sliding_window", False):
        return "a sliding window: mlx-lm's Qwen3-MoE attends over the whole context"
    if getattr(config, "attention_bias", False):
        return "attention_bias: mlx-lm's Qwen3-MoE attention has no biases"
    return None


def _gemma_refusal(config) -> str | None:
    """What Gemma2 and Gemma3 share: the GELU, the attention without biases."""
    if config.hidden_activation != GELU_TANH:
        return f"hidden_activation {config.hidden_activation}: mlx-lm's Gemma MLP is GELU's tanh approximation"
    if getattr(config, "attention_bias", False):
        return "attention_bias: mlx-lm's Gemma attention has no biases"
    return None


def _gemma2_refusal(config) -> str | None:
    if config.attn_logit_softcapping is None or config.final_logit_softcapping is None:
        return "no logit soft-capping: mlx-lm's Gemma2 always caps attention and final logits"
    if not config.tie_word_embeddings:
        return "an lm_head apart from the embedding: mlx-lm's Gemma2 computes logits with the embedding"
    if rope_kind(rope_parameters(config)) != "default":
        return f"RoPE scaling '{rope_kind(rope_parameters(config))}': mlx-lm's Gemma2 rotates without scaling"
    return _gemma_refusal(config)


def _gemma3_refusal(config) -> str | None:
    if config.attn_logit_softcapping is not None or config.final_logit_softcapping is not None:
        return "logit soft-capping: mlx-lm's Gemma3 caps neither attention nor final logits"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention: mlx-lm's Gemma3 is causal"
    full, local = gemma3_rope(config)
    if rope_kind(full) not in ("default", "linear"):
        return f"RoPE scaling '{rope_kind(full)}' on the global layers: quantkit describes default and linear to mlx-lm"
    if rope_kind(local) != "default":
        return f"RoPE scaling '{rope_kind(local)}' on the sliding layers: mlx-lm's Gemma3 leaves them unscaled"
    if sliding_window_pattern(config) is None:
        return (f"layer types {layer_types(config)}: mlx-lm's Gemma3 slides every layer but each n-th "
                "(sliding_window_pattern), the last of each n global")
    return _gemma_refusal(config)


def _phi3_refusal(config) -> str | None:
    if config.hidden_act != "silu":
        return f"hidden_act {config.hidden_act}: mlx-lm's Phi-3 MLP is SwiGLU"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        return f"head_dim {head_dim}: mlx-lm's Phi-3 takes hidden_size / heads"
    if rope_kind(rope_parameters(config)) != "default":
        return (f"RoPE scaling '{rope_kind(rope_parameters(config))}': mlx-lm's Phi-3 LongRoPE rotates by the long "
                "factors at every length (Hugging Face: the short ones within the original context)")
    return None


def sliding_window_pattern(config) -> int | None:
    """mlx-lm's Gemma3 `sliding_window_pattern` n for the config's layer types (layer i global where (i + 1) % n
    is 0, every other sliding), or None where no n gives them or none is global (mlx-lm then reads layer n - 1's
    cache, which is not there)."""
    types = layer_types(config)
    if "full_attention" not in types:
        return None
    n = types.index("full_attention") + 1
    expected = ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(len(types))]
    return n if types == expected else None


def notes(config) -> list[str]:
    """The summary's caveats: where mlx-lm attends beyond the window the Hugging Face model slides."""
    window = getattr(config, "sliding_window", None)
    sliding = config.model_type == "phi3" or "sliding_attention" in layer_types(config)
    if config.model_type in ("gemma2", "phi3") and window and sliding and window < config.max_position_embeddings:
        return [f"mlx-lm's {config.model_type} attends over the whole context where this model slides a window of "
                f"{window} tokens: the same model on prompts up to {window} tokens, another beyond"]
    return []


def config_keys(config) -> dict:
    """Keys mlx-lm's model reads at the top of config.json that transformers 5 writes elsewhere or not at all."""
    if config.model_type == "qwen3_moe":
        return {"num_experts": config.num_experts}
    if config.model_type == "phi3":
        return {"partial_rotary_factor": rope_parameters(config).get("partial_rotary_factor", 1.0)}
    if config.model_type != "gemma3_text":
        return {}
    full, local = gemma3_rope(config)
    keys = {"rope_theta": full.get("rope_theta", 1_000_000.0), "rope_local_base_freq": local.get("rope_theta", 10000.0),
            "sliding_window_pattern": sliding_window_pattern(config)}
    if rope_kind(full) != "default":
        keys["rope_scaling"] = {"type": rope_kind(full), "factor": full["factor"]}
    return keys


def switch_name(name: str) -> str:
    """mlx-lm's name of an expert projection, module or tensor: `mlp.experts.3.up_proj` -> `mlp.switch_mlp.up_proj`."""
    found = EXPERTS.match(name)
    return f"{found['block']}.switch_mlp.{found['proj']}{found['part'] or ''}" if found else name


def stacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with each expert projection's tensors stacked into mlx-lm's switch_mlp ([experts, ...], by index)."""
    out, experts = {}, {}
    for key, value in tensors.items():
        found = EXPERTS.match(key)
        if found is None:
            out[key] = value
        else:
            experts.setdefault(switch_name(key), {})[int(found["expert"])] = value
    for key, by_index in experts.items():
        parts = [by_index.get(i) for i in range(len(by_index))]
        if any(p is None or p.shape != parts[0].shape or p.dtype != parts[0].dtype for p in parts):
            raise ExportError(f"{key}: the experts' tensors differ in number, shape or dtype (a quantkit bug: the plan "
                              "should give each projection's experts one grid)")
        out[key] = torch.stack(parts)
    return out


def mixed_experts(plan) -> str | None:
    """Why the plan's experts cannot be stacked (one projection's experts on more than one grid), or None."""
    grids: dict[str, set] = {}
    for entry in plan:
        if EXPERTS.match(entry.name):
            grids.setdefault(switch_name(entry.name), set()).add(entry.scheme)
    mixed = sorted(name for name, schemes in grids.items() if len(schemes) > 1)
    if mixed:
        return (f"{mixed[0]}: its experts are on more than one grid, and mlx-lm stacks a projection's experts into "
                "one tensor (switch_mlp); give them one tensor type")
    return None
