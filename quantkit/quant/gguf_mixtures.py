"""llama.cpp's named GGUF mixtures: which tensor gets which GGML type.

The rules are llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp; read at llama.cpp commit 0c1e570, the
source llama-cpp-python 0.3.36 vendors and scripts/build_llama_cpp.sh builds, which holds these rules as b11434
did) for dense and MoE decoder models, restated (n layers, layer i; g query heads per KV head):

| tensor | Q2_K_S | Q2_K | Q3_K_S | Q3_K_M | Q3_K_L | Q4_K_S | Q4_K_M | Q5_K_S | Q5_K_M | Q6_K |
|---|---|---|---|---|---|---|---|---|---|---|
| most Linears | Q2_K | Q2_K | Q3_K | Q3_K | Q3_K | Q4_K | Q4_K | Q5_K | Q5_K | Q6_K |
| attn_v, attn_qkv | Q4_K if g >= 4, else Q2_K | Q4_K if g >= 4, else Q3_K | Q3_K | Q5_K for i < 2, else Q4_K | Q5_K | Q5_K for i < 4, else Q4_K | Q6_K where more_bits(i, n), else Q4_K | Q5_K | Q6_K where more_bits(i, n), else Q5_K | Q6_K |
| ffn_down | Q4_K for i < n/8, else Q2_K | Q3_K | Q3_K | Q5_K for i < n/16, else Q4_K | Q5_K | Q5_K for i < n/8, else Q4_K | Q6_K where more_bits(i, n), else Q4_K | Q5_K | Q6_K where more_bits(i, n), else Q5_K | Q6_K |
| attn_output | Q2_K | Q3_K | Q3_K | Q4_K | Q5_K | Q4_K | Q4_K | Q5_K | Q5_K | Q6_K |
| output (lm_head) | Q6_K | Q6_K | Q6_K | Q6_K | Q6_K | Q6_K | Q6_K | Q6_K | Q6_K | Q6_K |
| token_embd | Q2_K | Q2_K | Q3_K | Q3_K | Q3_K | Q4_K | Q4_K | Q5_K | Q5_K | Q6_K |

more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2 (integer division, as C computes it). Q4_K_S's
"i < 4" is llama.cpp's count of the attn_v tensors seen so far, which is the layer index (one attn_v a layer). A
tied token_embd takes the output's type (llama.cpp writes no separate output then). Q2_K_S is one of the mixtures
llama.cpp refuses to write without an importance matrix (`NEEDS_DATA`: its Q2_K tensors, `tensor_requires_imatrix`);
quantkit refuses it without calibration data (`finalization.request`).

The i-quant mixtures (`IQ_MIXTURES`; recipes gguf-iq2-m and gguf-iq3-m, the others by a recipe's `mixture:` key on
the base type's grid; "imatrix": written from calibration data, as quantkit's calibrated recipes are):

| tensor | IQ1_M | IQ2_XXS | IQ2_M | IQ3_XXS | IQ3_M | IQ4_XS |
|---|---|---|---|---|---|---|
| most Linears | IQ1_M | IQ2_XXS | IQ2_S | IQ3_XXS | IQ3_S | IQ4_XS |
| attn_v, attn_qkv | Q4_K if g >= 4 or 4+ experts, else Q2_K | as IQ1_M | Q4_K if g >= 4 or 4+ experts, else IQ3_S | Q4_K if g >= 4, else IQ3_XXS (IQ3_S without an imatrix) | Q4_K | Q5_K if g >= 4 |
| attn_q, attn_k | IQ1_M | IQ2_XXS | IQ2_S | IQ2_S | IQ3_S | IQ4_XS |
| ffn_down | Q2_K for i < n/8 | Q2_K for i < n/8 | IQ3_S for i < n/8 | (without an imatrix: Q4_K for i < n/8, else Q3_K) | Q4_K for i < n/8 | (without an imatrix: Q5_K for i < n/8) |
| attn_output | IQ2_XXS | IQ2_XXS | IQ3_S | IQ3_S | Q4_K | IQ4_XS |
| output (lm_head) | Q5_K | Q5_K | Q5_K | Q5_K | Q6_K | Q6_K |
| token_embd | Q2_K | Q2_K | IQ3_S | IQ3_S | IQ3_S | IQ4_XS |

IQ1_M, IQ2_XXS, IQ2_M and IQ3_XXS need an importance matrix in llama.cpp (their IQ1/IQ2/IQ3_XXS tensors).

MXFP4_MOE (llama.cpp's `LLAMA_FTYPE_MOSTLY_MXFP4_MOE`): an MoE model's stacked experts (ffn_*_exps, the 3-D
tensors) in MXFP4, every other Linear, output and token_embd in Q8_0. On a dense model llama.cpp's rule leaves
no tensor in MXFP4 (all Q8_0: the file gguf-q8-0 writes); quantkit puts a dense model's decoder Linears in MXFP4
instead, output and token_embd in Q8_0 as llama.cpp does, so that the mixture is an MXFP4 file on any model.

Left out, as they apply to none of the architectures quantkit writes to GGUF or to none of these mixtures:
llama.cpp's rules for Falcon, for its 70B model type and for 8-expert MoE models (Mixtral: llama.cpp puts attn_v
and attn_k in Q8_0 and attn_output in Q5_K there; quantkit's mixtures follow the dense rules). A fused attn_qkv
(Phi-3's qkv_proj) is attn_v to these rules (`category_is_attn_v`: their ATTENTION_QKV branch comes after it, and
never runs for these mixtures); a fused gate/up (Phi-3's gate_up_proj) is ffn_up. Pure data and arithmetic: no gguf.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from quantkit.grids.schemes import K_QUANT_TYPES, Granularity, ScaleDtype, WeightSpec

# mixture -> its base type (llama.cpp's default type of the file type: `llama_ftype_get_default_type`)
IQ_MIXTURES = {"IQ1_M": "IQ1_M", "IQ2_XXS": "IQ2_XXS", "IQ2_M": "IQ2_S", "IQ3_XXS": "IQ3_XXS", "IQ3_M": "IQ3_S",
               "IQ4_XS": "IQ4_XS"}
MIXTURES = {"Q2_K_S": "Q2_K", "Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
            "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
            **IQ_MIXTURES, "MXFP4_MOE": "MXFP4"}
# mixtures llama.cpp refuses to write without an importance matrix
NEEDS_DATA = frozenset({"Q2_K_S", "IQ1_M", "IQ2_XXS", "IQ2_M", "IQ3_XXS"})


class Place(NamedTuple):
    """Where a tensor sits: decoder layer `layer` (None outside the layers) of `layers`, `gqa` query heads per KV
    head, `experts` routed experts per MoE layer (0: a dense model); `imatrix`: written from calibration data
    (llama-quantize --imatrix)."""

    layer: int | None
    layers: int
    gqa: int
    experts: int = 0
    imatrix: bool = True


Rule = Callable[[Place], str]

# role -> mixture -> its rule, for the roles whose type is not the base type (the tables above); where a mixture
# has none, `output` is Q6_K and token_embd the base type.
RULES: dict[str, dict[str, Rule]] = {
    "attn_v": {
        "Q2_K_S": lambda p: "Q4_K" if p.gqa >= 4 else "Q2_K",
        "Q2_K": lambda p: "Q4_K" if p.gqa >= 4 else "Q3_K",
        "Q3_K_M": lambda p: "Q5_K" if p.layer < 2 else "Q4_K",
        "Q3_K_L": lambda p: "Q5_K",
        "Q4_K_S": lambda p: "Q5_K" if p.layer < 4 else "Q4_K",
        "Q4_K_M": lambda p: "Q6_K" if more_bits(p.layer, p.layers) else "Q4_K",
        "Q5_K_M": lambda p: "Q6_K" if more_bits(p.layer, p.layers) else "Q5_K",
        "IQ1_M": lambda p: "Q4_K" if p.gqa >= 4 or p.experts >= 4 else "Q2_K",
        "IQ2_XXS": lambda p: "Q4_K" if p.gqa >= 4 or p.experts >= 4 else "Q2_K",
        "IQ2_M": lambda p: "Q4_K" if p.gqa >= 4 or p.experts >= 4 else "IQ3_S",
        "IQ3_XXS": lambda p: "Q4_K" if p.gqa >= 4 else "IQ3_XXS" if p.imatrix else "IQ3_S",
        "IQ3_M": lambda p: "Q4_K",
        "IQ4_XS": lambda p: "Q5_K" if p.gqa >= 4 else "IQ4_XS",
    },
    "attn_q": {"IQ3_XXS": lambda p: "IQ2_S"},
    "attn_k": {"IQ3_XXS": lambda p: "IQ2_S"},
    "ffn_down": {
        "Q2_K_S": lambda p: "Q4_K" if p.layer < p.layers // 8 else "Q2_K",
        "Q2_K": lambda p: "Q3_K",
        "Q3_K_M": lambda p: "Q5_K" if p.layer < p.layers // 16 else "Q4_K",
        "Q3_K_L": lambda p: "Q5_K",
        "Q4_K_S": lambda p: "Q5_K" if p.layer < p.layers // 8 else "Q4_K",
        "Q4_K_M": lambda p: "Q6_K" if more_bits(p.layer, p.layers) else "Q4_K",
        "Q5_K_M": lambda p: "Q6_K" if more_bits(p.layer, p.layers) else "Q5_K",
        "IQ1_M": lambda p: "Q2_K" if p.layer < p.layers // 8 else "IQ1_M",
        "IQ2_XXS": lambda p: "Q2_K" if p.layer < p.layers // 8 else "IQ2_XXS",
        "IQ2_M": lambda p: "IQ3_S" if p.layer < p.layers // 8 else "IQ2_S",
        "IQ3_XXS": lambda p: "IQ3_XXS" if p.imatrix else "Q4_K" if p.layer < p.layers // 8 else "Q3_K",
        "IQ3_M": lambda p: "Q4_K" if p.layer < p.layers // 8 else "IQ3_S",
        "IQ4_XS": lambda p: "Q5_K" if p.layer < p.layers // 8 and not p.imatrix else "IQ4_XS",
    },
    "attn_output": {"Q2_K": lambda p: "Q3_K", "Q3_K_M": lambda p: "Q4_K", "Q3_K_L": lambda p: "Q5_K",
                    "IQ1_M": lambda p: "IQ2_XXS", "IQ2_M": lambda p: "IQ3_S", "IQ3_XXS": lambda p: "IQ3_S",
                    "IQ3_M": lambda p: "Q4_K"},
    "output": {name: lambda p: "Q5_K" for name in ("IQ1_M", "IQ2_XXS", "IQ2_M", "IQ3_XXS")},
    "token_embd": {"IQ1_M": lambda p: "Q2_K", "IQ2_XXS": lambda p: "Q2_K", "IQ2_M": lambda p: "IQ3_S",
                   "IQ3_XXS": lambda p: "IQ3_S"},
}
RULES["attn_qkv"] = RULES["attn_v"]  # llama.cpp's category_is_attn_v


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


def tensor_type(mixture: str, role: str, layer: int | None, n_layers: int, gqa: int, experts: int = 0,
                imatrix: bool = True) -> str:
    """The GGML type llama.cpp gives a tensor of `role` ('attn_v', 'ffn_down', 'ffn_down_exps', 'output',
    'token_embd', ...) in decoder layer `layer` of `n_layers` under `mixture` (MIXTURES); `gqa`: query
    heads per KV head; `experts`: routed experts per MoE layer (0: dense); `imatrix`: written from calibration data.
    An expert stack (`_exps`) takes its projection's rule."""
    place = Place(layer, n_layers, gqa, experts, imatrix)
    if mixture == "MXFP4_MOE":
        return _mxfp4_moe(role, place)
    rule = RULES.get(role.removesuffix("_exps"), {}).get(mixture)
    if rule:
        return rule(place)
    return "Q6_K" if role == "output" else MIXTURES[mixture]


def _mxfp4_moe(role: str, place: Place) -> str:
    """llama.cpp's MXFP4_MOE: the expert stacks MXFP4, the rest Q8_0; a dense model's decoder Linears MXFP4 (the
    module's docstring)."""
    if role.endswith("_exps") or (place.experts == 0 and role not in ("output", "token_embd")):
        return "MXFP4"
    return "Q8_0"


def k_spec(type_name: str) -> WeightSpec:
    """The WeightSpec of a K type's grid (schemes.K_QUANT_TYPES)."""
    dtype, group, symmetric = next(key for key, name in K_QUANT_TYPES.items() if name == type_name)
    return WeightSpec(dtype, Granularity.GROUP, group, symmetric=symmetric, scale_dtype=ScaleDtype.K_QUANT)


def role_of(name: str) -> tuple[str | None, int | None]:
    """(role, decoder layer index) of a planned Linear's name (`model.layers.3.mlp.down_proj` -> ffn_down; an MoE
    expert's projection is the stack llama.cpp writes it into, ffn_*_exps), or (None, None)."""
    from quantkit.models.architectures import expert_projection

    layer = next((int(p) for p in name.split(".") if p.isdigit()), None)
    if (expert := expert_projection(name)) is not None:
        return f"ffn_{expert[2]}_exps", layer
    role = next((role for tail, role in roles().items() if name == tail or name.endswith(f".{tail}")), None)
    return (role, layer) if role else (None, None)
