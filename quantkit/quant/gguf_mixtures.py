"""llama.cpp's named GGUF mixtures (Q4_K_M, Q5_K_M, Q3_K_M, Q2_K): which tensor gets which GGML type.

The rules are llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp, b11434) for dense decoder models, restated:

| tensor | Q2_K | Q3_K_M | Q4_K_M | Q5_K_M |
|---|---|---|---|---|
| most Linears | Q2_K | Q3_K | Q4_K | Q5_K |
| attn_v, attn_qkv (layer i of n) | Q4_K if 4+ query heads share a KV head, else Q3_K | Q5_K for i < 2, else Q4_K | Q6_K where more_bits(i, n), else Q4_K | Q6_K where more_bits(i, n), else Q5_K |
| ffn_down (layer i of n) | Q3_K | Q5_K for i < n/16, else Q4_K | Q6_K where more_bits(i, n), else Q4_K | Q6_K where more_bits(i, n), else Q5_K |
| attn_output | Q3_K | Q4_K | Q4_K | Q5_K |
| output (lm_head) | Q6_K | Q6_K | Q6_K | Q6_K |
| token_embd | Q2_K | Q3_K | Q4_K | Q5_K |

more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2 (integer division, as C computes it). A tied
token_embd takes the output's type (llama.cpp writes no separate output then). Left out, as they apply to none of
the architectures quantkit writes to GGUF: llama.cpp's rules for Falcon, for 8-expert MoE models and for its 70B
model type. A fused attn_qkv (Phi-3's qkv_proj) is attn_v to these rules (`category_is_attn_v`: their
ATTENTION_QKV branch comes after it, and never runs for these mixtures); a fused gate/up (Phi-3's gate_up_proj) is
ffn_up. Pure data and arithmetic: no gguf.
"""

from __future__ import annotations

from quantkit.grids.schemes import K_QUANT_TYPES, Granularity, ScaleDtype, WeightSpec

MIXTURES = {"Q2_K": "Q2_K", "Q3_K_M": "Q3_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}  # mixture -> its base type


def roles() -> dict[str, str]:
    """A decoder Linear's role in llama.cpp's rules, by its name's tail (the Llama-style and Phi-3-style wirings of
    models.architectures, imported here only: the registry reads MIXTURES without torch)."""
    from quantkit.models.architectures import LLAMA, PHI3

    return {LLAMA.q: "attn_q", LLAMA.k: "attn_k", LLAMA.v: "attn_v", LLAMA.o: "attn_output", LLAMA.gate: "ffn_gate",
            LLAMA.up: "ffn_up", LLAMA.down: "ffn_down", PHI3.q: "attn_qkv", PHI3.up: "ffn_up", "lm_head": "output"}


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or _c_mod(i - n // 8, 3) == 2


def _c_mod(a: int, b: int) -> int:
    return a - b * int(a / b)  # C's % (truncates toward zero)


def tensor_type(mixture: str, role: str, layer: int | None, n_layers: int, gqa: int) -> str:
    """The GGML type llama.cpp gives a tensor of `role` ('attn_v', 'ffn_down', 'output', 'token_embd', ...) in
    decoder layer `layer` of `n_layers` under `mixture`; `gqa`: query heads per KV head."""
    base = MIXTURES[mixture]
    if role == "output":
        return "Q6_K"
    if role in ("attn_v", "attn_qkv"):
        if mixture == "Q2_K":
            return "Q4_K" if gqa >= 4 else "Q3_K"
        if mixture == "Q3_K_M":
            return "Q5_K" if layer < 2 else "Q4_K"
        return "Q6_K" if more_bits(layer, n_layers) else base
    if role == "ffn_down":
        if mixture == "Q2_K":
            return "Q3_K"
        if mixture == "Q3_K_M":
            return "Q5_K" if layer < n_layers // 16 else "Q4_K"
        return "Q6_K" if more_bits(layer, n_layers) else base
    if role == "attn_output":
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K"}.get(mixture, base)
    return base


def k_spec(type_name: str) -> WeightSpec:
    """The WeightSpec of a K type's grid (schemes.K_QUANT_TYPES)."""
    dtype, group, symmetric = next(key for key, name in K_QUANT_TYPES.items() if name == type_name)
    return WeightSpec(dtype, Granularity.GROUP, group, symmetric=symmetric, scale_dtype=ScaleDtype.K_QUANT)


def role_of(name: str) -> tuple[str | None, int | None]:
    """(role, decoder layer index) of a planned Linear's name (`model.layers.3.mlp.down_proj`; an MoE expert's
    projections are the MLP's: llama.cpp stacks them into ffn_*_exps, which its rules treat as ffn_*), or (None, None)."""
    from quantkit.models.architectures import expert_projection

    layer = next((int(p) for p in name.split(".") if p.isdigit()), None)
    if (expert := expert_projection(name)) is not None:
        return f"ffn_{expert[2]}", layer
    role = next((role for tail, role in roles().items() if name == tail or name.endswith(f".{tail}")), None)
    return (role, layer) if role else (None, None)
