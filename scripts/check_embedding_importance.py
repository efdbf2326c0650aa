"""How much a GGUF K type's token embedding alone costs a model, under each importance for llama.cpp's search.

    python scripts/check_embedding_importance.py MODEL_DIR [--data TEXT] [--types Q3_K Q2_K]

The float model with only its token embedding put on the grid (and back), KL divergence from the float model's
next-token distributions on `--windows` windows of `--ctx` tokens of `--data`, in torch. Importances: llama.cpp's
reference quantizer (none), a unit importance (quantkit's calibrated K mixtures), and two weightings by what reads the
embedding: each column by the squared norm weight times the squared column norms of the Linears reading that norm,
over the first decoder layer's two norms (J0), or over every layer's and the final norm with lm_head (Jall).
A Llama-wired model (input_layernorm -> q/k/v_proj, post_attention_layernorm -> gate/up_proj).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit.grids.k_grids import quantize_k


def reader_importance(model, layers, final: bool) -> torch.Tensor:
    def weighted(norm, linears):
        return norm.weight.float() ** 2 * sum((linear.weight.float() ** 2).sum(0) for linear in linears)

    importance = torch.zeros(model.model.embed_tokens.weight.shape[1])
    for i in layers:
        layer = model.model.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        importance += weighted(layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj))
        importance += weighted(layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))
    if final:
        importance += weighted(model.model.norm, (model.lm_head,))
    return importance / importance.mean()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/wikitext-2/test.txt")
    p.add_argument("--types", nargs="+", default=["Q3_K", "Q2_K"])
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--windows", type=int, default=16)
    args = p.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokens = AutoTokenizer.from_pretrained(args.model)(args.data.read_text()[:400_000], return_tensors="pt").input_ids[0]
    windows = tokens[: args.ctx * args.windows].view(args.windows, args.ctx)
    embedding = model.model.embed_tokens.weight.data.clone()

    @torch.no_grad()
    def log_probs():
        return torch.log_softmax(model(windows).logits.float(), -1)

    reference = log_probs()
    importances = {"reference (none)": None, "unit": torch.ones(embedding.shape[1]),
                   "J0": reader_importance(model, [0], False),
                   "Jall": reader_importance(model, range(len(model.model.layers)), True)}
    for name, importance in importances.items():
        if importance is not None:
            print(f"{name}: importance {importance.min():.3f} .. {importance.max():.3f} of its mean")
    for kind in args.types:
        for name, importance in importances.items():
            found = quantize_k(embedding, gguf.GGMLQuantizationType[kind], importance)
            model.model.embed_tokens.weight.data = found.qparams.dequantize(found.codes, dtype=torch.float32)
            kld = (reference.exp() * (reference - log_probs())).sum(-1).mean().item()
            print(f"{kind} {name}: KLD {kld:.6f}", flush=True)
        model.model.embed_tokens.weight.data = embedding.clone()


if __name__ == "__main__":
    main()
