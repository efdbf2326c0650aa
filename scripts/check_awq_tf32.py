"""Does TF32 change what AWQ chooses? Its lone-Linear blocks (o_proj, down_proj) score each candidate by
tr(dW H dW^T), which a CUDA GPU multiplies in TF32 (`algorithms.awq.hessian_error`). This script computes, on the
CPU, every candidate's error of every o and down projection of a model three ways: float64, float32 (the CPU's
product), and float32 with the product's inputs rounded to TF32's 10-bit mantissa (to nearest, and truncated),
then prints per block the best candidate of each, the largest relative change of an error, and the gap between
the best candidate and the next (a change below it cannot change the choice).

    .venv/bin/python scripts/check_awq_tf32.py MODEL [MODEL ...] --data ../shared/data/wikitext-2/valid.txt
"""

from __future__ import annotations

import argparse

import torch

from quantkit.algorithms.methods.awq import AWQArgs
from quantkit.algorithms.awq import candidate_scales, scaled_candidate
from quantkit.data import load_texts, tokenize
from quantkit.models.loading import load_model, load_tokenizer
from quantkit.quant import registry
from quantkit.grids.observers import ChannelAbsMean, HessianObserver


def tf32(x: torch.Tensor, mode: str) -> torch.Tensor:
    """float32 values with the 13 low mantissa bits dropped: truncated, or rounded to nearest even."""
    bits = x.float().contiguous().view(torch.int32)
    if mode == "to nearest":
        bits = bits + 0xFFF + ((bits >> 13) & 1)
    return (bits & ~0x1FFF).view(torch.float32)


def errors(weight: torch.Tensor, candidates: list[torch.Tensor], xtx: torch.Tensor, how: str) -> list[float]:
    found = []
    for candidate in candidates:
        delta = candidate.float() - weight.float()
        if how == "float64":
            found.append(float((delta.double() @ xtx.double() * delta.double()).sum()))
        elif how == "float32":
            found.append(float((delta @ xtx * delta).sum(dtype=torch.float64)))
        else:
            found.append(float((tf32(delta, how) @ tf32(xtx, how) * delta).sum(dtype=torch.float64)))
    return found


def statistics(model, ids: torch.Tensor, batch: int) -> dict:
    """(layer, "o" / "down") -> (its input's Hessian, mean |x|), over the tokens `ids` [samples, seq_len]."""
    found = {}

    def hook(key):
        def observe(module, args):
            hessian, act = found.setdefault(key, (HessianObserver(), ChannelAbsMean()))
            hessian.update(args[0])
            act.update(args[0])
        return observe

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.o_proj.register_forward_pre_hook(hook((i, "o")))
        layer.mlp.down_proj.register_forward_pre_hook(hook((i, "down")))
    with torch.no_grad():
        for start in range(0, ids.shape[0], batch):
            model(ids[start : start + batch])
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--data", required=True, help="a text file (calibration tokens)")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--recipe", default="awq-w4a16")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    spec = registry.resolve(args.recipe).scheme.weights
    for path in args.models:
        model = load_model(path, dtype=args.dtype).eval()
        ids = tokenize(load_tokenizer(path), load_texts(args.data))[: args.num_samples * args.seq_len]
        ids = ids.reshape(-1, args.seq_len)
        for (i, kind), (hessian, act) in sorted(statistics(model, ids, 8).items()):
            layer = model.model.layers[i]
            weight = (layer.self_attn.o_proj if kind == "o" else layer.mlp.down_proj).weight.data
            candidates = [scaled_candidate(weight, spec, s) for s in candidate_scales(act.mean(), AWQArgs())]
            xtx = hessian.xtx()
            exact = errors(weight, candidates, xtx, "float64")
            first, second = sorted(exact)[:2]
            row = [f"{path} layer {i} {kind}: float64 best {exact.index(first)}"]
            for how in ("float32", "to nearest", "truncated"):
                found = errors(weight, candidates, xtx, how)
                change = max(abs(a / b - 1) for a, b in zip(found, exact))
                row.append(f"{how} best {found.index(min(found))}, largest change {change:.1e}")
            print("; ".join(row) + f"; gap to the next {second / first - 1:.1e}", flush=True)


if __name__ == "__main__":
    main()
