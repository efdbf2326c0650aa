"""Tiny models built from a config, with a tokenizer trained on local text: for the demo, tests and benchmarks.

Nothing is downloaded. `build_tiny_llama(out_dir, text)` writes a Hugging Face model directory
(config.json, model.safetensors, tokenizer files) that every quantkit command accepts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, vocab_size=512,
)


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE tokenizer trained on `text` (byte fallback: every string is encodable)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines() or [text], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build_tiny_llama(out_dir: str | Path, text: str, seed: int = 0, dtype: str = "float32", max_shard_size: str | None = None,
                     **overrides: Any) -> Path:
    return build_tiny_model(out_dir, text, "llama", seed, dtype, max_shard_size, **overrides)


def build_tiny_model(
    out_dir: str | Path, text: str, model_type: str = "llama", seed: int = 0, dtype: str = "float32",
    max_shard_size: str | None = None, **overrides: Any
) -> Path:
    """A tiny causal LM of `model_type` (llama, qwen2, mistral, ...) from a config, random weights; saved in
    safetensors files of at most `max_shard_size` (transformers' default: one file)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    params = {**TINY_LLAMA, **overrides}
    tokenizer = train_tokenizer(text, params["vocab_size"])
    params["vocab_size"] = len(tokenizer)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **params, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(out_dir)
    return out_dir
