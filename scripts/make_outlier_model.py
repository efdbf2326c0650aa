"""Make a copy of a small Llama that computes the same function but has activation outliers, for the rotation
benchmark (trained small models rarely have the ×50-×100 outlier channels large ones grow, which rotations fix).

    python scripts/make_outlier_model.py SRC DST [--channels 4] [--factor 64] [--seed 0]

In each decoder layer, `--channels` channels (a seeded choice, per norm) of input_layernorm's and
post_attention_layernorm's weight are multiplied by `--factor`, and the same input columns of every Linear reading
that norm's output (q/k/v_proj; gate/up_proj) divided by it: those Linears' inputs then have ×factor channels
while their outputs are unchanged. The final norm is left alone: it feeds lm_head, which is usually not quantized,
and a tied lm_head shares its weight with the embedding. A power-of-two factor (the default, 64) scales exactly in
any float dtype, so DST, saved in SRC's dtype, is SRC with exponents shifted.

Checked before DST is written: the logits on random token sequences match SRC's within 1e-4 (relative to their
largest magnitude, in float32). Prints, per layer and norm, the largest |input| of the Linears it feeds and the
outlier ratio (largest channel max / median channel max), before and after.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def norm_readers(model) -> dict[str, tuple[torch.nn.Module, list[torch.nn.Linear]]]:
    """Each decoder layer norm by name, with the Linears reading its output (Llama's wiring)."""
    readers = {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        readers[f"{i}.input_layernorm"] = (layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj])
        readers[f"{i}.post_attention_layernorm"] = (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj])
    return readers


@torch.no_grad()
def run(model, readers, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The logits, and per norm the max |x| of each channel of its output (the input of the Linears it feeds)."""
    channel_max: dict[str, torch.Tensor] = {}

    def record(name):
        return lambda module, args: channel_max.__setitem__(name, args[0].abs().flatten(0, -2).amax(0))

    hooks = [linears[0].register_forward_pre_hook(record(name)) for name, (_, linears) in readers.items()]
    try:
        return model(tokens).logits, channel_max
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def add_outliers(readers, channels: int, factor: float, seed: int) -> dict[str, list[int]]:
    """Scale `channels` channels of each norm's output by `factor` and the reading columns by 1/factor."""
    generator, chosen = torch.Generator().manual_seed(seed), {}
    for name, (norm, linears) in readers.items():
        picked = torch.randperm(norm.weight.numel(), generator=generator)[:channels]
        norm.weight[picked] *= factor
        for linear in linears:
            linear.weight[:, picked] /= factor
        chosen[name] = sorted(picked.tolist())
    return chosen


def outlier_ratio(channel_max: torch.Tensor) -> float:
    return (channel_max.max() / channel_max.median()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="a small Hugging Face Llama directory")
    parser.add_argument("dst", type=Path, help="where to write the outlier model (must not exist)")
    parser.add_argument("--channels", type=int, default=4, help="outlier channels per norm (default 4)")
    parser.add_argument("--factor", type=float, default=64.0, help="their scale (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="which channels, and the check's token sequences")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest relative logit change allowed")
    args = parser.parse_args()
    if args.dst.exists():
        sys.exit(f"{args.dst} exists: choose a new directory")

    source_dtype = AutoConfig.from_pretrained(args.src).dtype or torch.float32  # loading in float32 overwrites it
    model = AutoModelForCausalLM.from_pretrained(args.src, dtype=torch.float32).eval()
    readers = norm_readers(model)
    tokens = torch.randint(model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(args.seed))

    logits_before, before = run(model, readers, tokens)
    chosen = add_outliers(readers, args.channels, args.factor, args.seed)
    logits_after, after = run(model, readers, tokens)

    print(f"{'norm':<28} {'channels':<22} {'max|x| before':>13} {'after':>9} {'ratio':>6}   outlier ratio before → after")
    for name in readers:
        top_before, top_after = before[name].max().item(), after[name].max().item()
        print(f"{name:<28} {str(chosen[name]):<22} {top_before:>13.3g} {top_after:>9.3g} {top_after / top_before:>6.1f}"
              f"   {outlier_ratio(before[name]):.1f} → {outlier_ratio(after[name]):.1f}")
    change = ((logits_after - logits_before).abs().max() / logits_before.abs().max()).item()
    print(f"largest logit change: {change:.2e} of the largest logit (allowed {args.tolerance:g})")
    if not change <= args.tolerance:
        sys.exit("the outlier model computes another function: nothing written")

    model.to(source_dtype).save_pretrained(args.dst)
    copied = [name for name in TOKENIZER_FILES if (args.src / name).is_file()]
    for name in copied:
        shutil.copy2(args.src / name, args.dst / name)
    print(f"wrote {args.dst} ({source_dtype}; tokenizer files copied: {', '.join(copied) or 'none found in SRC'})")


if __name__ == "__main__":
    main()
