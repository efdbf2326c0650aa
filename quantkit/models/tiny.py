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


SPECIALS = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def complete_merges(vocab: dict[str, int], skip: set[str]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces of `vocab`, as transformers converts a SentencePiece BPE model to
    tokenizer.json (`generate_merges` with scores): SentencePiece merges any two neighbours that make a piece, a
    BPE over listed merges only the listed ones. Pieces in vocabulary order, within a piece the longer left part
    first; `skip` (special and byte tokens) neither make nor take part in merges."""
    merges = []
    for piece in sorted(vocab, key=vocab.get):
        if piece in skip:
            continue
        splits = [(piece[:k], piece[k:]) for k in range(len(piece) - 1, 0, -1)]
        merges += [(left, right) for left, right in splits if vocab.get(left) is not None and vocab.get(right) is not None
                   and left not in skip and right not in skip]
    return merges


def train_spm_tokenizer(text: str, vocab_size: int):
    """A Llama-2-style tokenizer trained on `text`: a BPE over `▁`-marked words with byte fallback (`<unk>`, `<s>`,
    `</s>`, then the 256 byte tokens `<0x00>`..`<0xFF>`, then the pieces), its merges completed as SentencePiece
    merges (`complete_merges`), a prefix `▁` and spaces as `▁` (normalizer), `<s>` before every text. Built with
    `tokenizers` alone: no sentencepiece needed."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.BPE(unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(BYTES), special_tokens=SPECIALS, show_progress=False)
    words.train_from_iterator(text.splitlines() or [text], trainer=trainer)
    pieces = [p for p, _ in sorted(words.get_vocab().items(), key=lambda item: item[1]) if p not in SPECIALS]
    vocab = {piece: i for i, piece in enumerate(SPECIALS + BYTES + pieces)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=complete_merges(vocab, set(SPECIALS + BYTES)), unk_token="<unk>",
                                     fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in SPECIALS])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


TOKENIZERS = {"byte-level": train_tokenizer, "sentencepiece": train_spm_tokenizer}


def build_tiny_llama(out_dir: str | Path, text: str, seed: int = 0, dtype: str = "float32", max_shard_size: str | None = None,
                     tokenizer: str = "byte-level", **overrides: Any) -> Path:
    return build_tiny_model(out_dir, text, "llama", seed, dtype, max_shard_size, tokenizer, **overrides)


def build_tiny_model(
    out_dir: str | Path, text: str, model_type: str = "llama", seed: int = 0, dtype: str = "float32",
    max_shard_size: str | None = None, tokenizer: str = "byte-level", **overrides: Any
) -> Path:
    """A tiny causal LM of `model_type` (llama, qwen2, mistral, ...) from a config, random weights; saved in
    safetensors files of at most `max_shard_size` (transformers' default: one file); its tokenizer one of
    TOKENIZERS (byte-level BPE, or Llama-2-style SentencePiece BPE), trained on `text`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    params = {**TINY_LLAMA, **overrides}
    tokenizer = TOKENIZERS[tokenizer](text, params["vocab_size"])
    params["vocab_size"] = len(tokenizer)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **params, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(out_dir)
    return out_dir
