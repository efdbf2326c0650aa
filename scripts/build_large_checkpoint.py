"""Build a real-sized checkpoint of random bf16 weights, shard by shard: a Llama-3.1-8B or a Qwen3-30B-A3B shape.

    python scripts/build_large_checkpoint.py --shape llama-3.1-8b                 # 16 GB, 4 shards
    python scripts/build_large_checkpoint.py --shape llama-3.1-8b --layers 3      # the same model, 3 decoder layers
    python scripts/build_large_checkpoint.py --shape qwen3-30b-a3b --layers 4     # 128 experts a layer, 8 active

The model's config.json is the published model's (its rope scaling, its vocabulary size, untied lm_head), with
`--layers` decoder layers; generation_config.json and a byte-level BPE tokenizer trained on `--text`
(`quantkit.models.tiny.train_tokenizer`; its vocabulary is smaller than the config's, which the weights keep)
go beside it. Weights are drawn from N(0, 0.02^2) (norms are ones), straight in bf16, in chunks of rows, each
chunk with its own generator seeded from the tensor's name: the same bytes for any thread count. `--threads`
threads draw the next tensors while the main thread writes the current one (`quantkit.export.shards.ShardWriter`,
tensor by tensor into `--shard-gb` shards with model.safetensors.index.json), so memory stays at a few hundred MB
whatever the model's size. The checkpoint is built into DIR.building and renamed to DIR, under `--cache`
(default ~/.cache/quantkit-bench) as `SHAPE` or `SHAPE-NL`; an existing one is reused. Prints its path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import harness

STD = 0.02
CHUNK_ELEMENTS = 1 << 24  # a generator's share of a tensor: 16 M elements, 32 MB of bf16
LOOKAHEAD_BYTES = 1 << 30  # drawn ahead of the writer

LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
SHAPES = {"llama-3.1-8b": LLAMA_3_1_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}


def tensor_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint as it is stored on the hub, in the order written (layer by layer)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    found = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        found += [(f"{layer}.input_layernorm.weight", (hidden,)), (f"{layer}.post_attention_layernorm.weight", (hidden,)),
                  (f"{layer}.self_attn.q_proj.weight", (q, hidden)), (f"{layer}.self_attn.k_proj.weight", (kv, hidden)),
                  (f"{layer}.self_attn.v_proj.weight", (kv, hidden)), (f"{layer}.self_attn.o_proj.weight", (hidden, q))]
        if config["model_type"] == "qwen3_moe":
            found += [(f"{layer}.self_attn.q_norm.weight", (head_dim,)), (f"{layer}.self_attn.k_norm.weight", (head_dim,)),
                      (f"{layer}.mlp.gate.weight", (config["num_experts"], hidden))]
            found += _mlp(f"{layer}.mlp.experts.{{}}", hidden, config["moe_intermediate_size"], config["num_experts"])
        else:
            found += _mlp(f"{layer}.mlp", hidden, config["intermediate_size"])
    return found + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def _mlp(prefix: str, hidden: int, intermediate: int, experts: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    names = [prefix.format(e) for e in range(experts)] if experts else [prefix]
    return [(f"{name}.{proj}.weight", shape) for name in names for proj, shape in
            (("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)), ("down_proj", (hidden, intermediate)))]


def draw(name: str, shape: tuple[int, ...], pool: ThreadPoolExecutor, seed: int):
    """The tensor `name` (bf16): ones for a norm (1-D), else N(0, STD^2) in chunks of rows drawn in `pool`, each
    with a generator seeded from (seed, name, chunk). Returns it and the futures filling it."""
    import torch

    tensor = torch.empty(shape, dtype=torch.bfloat16)
    if len(shape) == 1:
        return tensor.fill_(1.0), []
    rows = max(1, CHUNK_ELEMENTS // shape[1])
    return tensor, [pool.submit(_fill, tensor[start:start + rows], _seed(seed, name, start))
                    for start in range(0, shape[0], rows)]


def _fill(chunk, seed: int) -> None:
    import torch

    chunk.normal_(0.0, STD, generator=torch.Generator().manual_seed(seed))


def _seed(seed: int, name: str, start: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}:{start}".encode()).digest()[:8], "little") >> 1


def write_weights(out: Path, config: dict, threads: int, shard_bytes: int, seed: int = 0) -> int:
    """The checkpoint's safetensors shards (and index) in `out`, drawn `threads` at a time ahead of the writer."""
    import torch

    from quantkit.export.shards import ShardWriter

    torch.set_num_threads(1)
    shapes = tensor_shapes(config)
    total = sum(2 * math.prod(shape) for _, shape in shapes)
    writer = ShardWriter(out, max_shard_size=shard_bytes, expected_bytes=total)
    pending: deque = deque()  # drawn (or being drawn), not written yet
    written = 0
    started = time.perf_counter()

    def write_first() -> None:
        nonlocal written
        name, tensor, fills = pending.popleft()
        for fill in fills:
            fill.result()
        writer.add({name: tensor})
        written += tensor.nbytes
        _progress(written, total, started)

    with ThreadPoolExecutor(threads) as pool:
        for name, shape in shapes:
            pending.append((name, *draw(name, shape, pool, seed)))
            while sum(tensor.nbytes for _, tensor, _ in pending) > LOOKAHEAD_BYTES:
                write_first()
        while pending:
            write_first()
    writer.finish()
    print(file=sys.stderr)
    return total


def _progress(written: int, total: int, started: float) -> None:
    print(f"\r  {written / 1e9:.1f} / {total / 1e9:.1f} GB, {time.perf_counter() - started:.0f} s", end="",
          file=sys.stderr, flush=True)


def write_tokenizer_and_configs(out: Path, config: dict, text: Path, vocab: int) -> None:
    """The tokenizer (trained on `text`), config.json (its token ids) and generation_config.json."""
    from quantkit.models.tiny import train_tokenizer

    tokenizer = train_tokenizer(harness.tokenizer_text(text, generate_if_missing=True), vocab)
    tokenizer.save_pretrained(out)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    (out / "config.json").write_text(json.dumps({**config, **ids}, indent=2) + "\n")
    generation = {**ids, "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def build(shape: str, layers: int | None = None, cache: Path = Path.home() / ".cache" / "quantkit-bench",
          text: Path = harness.WIKITEXT / "valid.txt", threads: int | None = None, shard_gb: float = 5.0,
          tokenizer_vocab: int = 8192) -> Path:
    """The checkpoint of `shape` with `layers` decoder layers (default: all), built once under `cache`."""
    config = dict(SHAPES[shape])
    if layers is not None:
        config.update(num_hidden_layers=layers, **({"max_window_layers": layers} if "max_window_layers" in config else {}))
    dst = cache / (shape if layers is None else f"{shape}-{layers}L")
    if (dst / "config.json").is_file():
        return dst
    tmp = dst.with_name(dst.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    print(f"building {dst} ...", file=sys.stderr)
    write_weights(tmp, config, threads or os.cpu_count() or 1, int(shard_gb * 1e9))
    write_tokenizer_and_configs(tmp, config, text, tokenizer_vocab)  # config.json last: it marks a finished build
    tmp.rename(dst)
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=list(SHAPES), default="llama-3.1-8b")
    p.add_argument("--layers", type=int, help="decoder layers (default: the published model's)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "quantkit-bench")
    p.add_argument("--text", type=Path, default=harness.WIKITEXT / "valid.txt", help="the tokenizer's training text")
    p.add_argument("--threads", type=int, help="threads drawing the weights (default: every CPU)")
    p.add_argument("--shard-gb", type=float, default=5.0)
    p.add_argument("--tokenizer-vocab", type=int, default=8192)
    args = p.parse_args(argv)
    print(build(args.shape, args.layers, args.cache, args.text, args.threads, args.shard_gb, args.tokenizer_vocab))


if __name__ == "__main__":
    main()
