"""GGUF's tokenizer: the vocabulary and how text is split before it, described as llama.cpp's converter describes
it (`describe_tokenizer`), or refused where quantkit cannot describe it exactly."""

from __future__ import annotations

import json
from pathlib import Path

from quantkit.errors import FormatError


def _gguf():
    from quantkit.export.gguf import _gguf as load

    return load()


# The pre-tokenizer regexes of tokenizer.json (its `Split` pattern) llama.cpp implements, by the name llama.cpp
# gives them (llama-vocab.cpp). Used where llama.cpp's converter would hash the tokenizer's output against its
# table of known vocabularies: naming the regex itself covers every vocabulary that splits text the same way.
PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}


def pre_tokenizer(tokenizer_json: dict) -> str:
    """llama.cpp's name for the way tokenizer.json splits text before BPE, or a refusal: a GPT-2 style byte-level
    BPE (ByteLevel with its own regex) is `gpt-2`; a Split by a known regex then ByteLevel is that regex's name."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        if pattern in PRE_TOKENIZERS:
            return PRE_TOKENIZERS[pattern]
    raise FormatError(f"the tokenizer's pre-tokenizer ({json.dumps(pre)[:120]}) is not one quantkit can name for "
                      "llama.cpp; use --format compressed-tensors")


def describe_tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """The vocabulary, as llama.cpp's converter writes a byte-level BPE (`gpt2`) one: every id up to the model's
    vocab_size (ids the tokenizer lacks are UNUSED padding), added tokens CONTROL when special, USER_DEFINED
    otherwise; merges, special ids and the chat template through gguf's SpecialVocab. A SentencePiece-style
    (byte-fallback) tokenizer is refused: written as llama.cpp's `llama` model (gguf's LlamaHfVocab), a test
    vocabulary tokenized differently in llama.cpp (9,863 tokens against 9,915 on 20 KB of WikiText)."""
    gguf = _gguf()
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FormatError("GGUF embeds the tokenizer, and the model has no tokenizer.json; add one to SRC")
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise FormatError(f"the tokenizer is a {model.get('type')} model; quantkit writes BPE tokenizers to GGUF: "
                          "use --format compressed-tensors")
    if model.get("byte_fallback"):  # SentencePiece-style: llama.cpp's `llama` tokenizer scores tokens, not merges
        raise FormatError("the tokenizer is a SentencePiece-style BPE (byte fallback), which quantkit cannot yet "
                          "describe to llama.cpp exactly; use --format compressed-tensors")
    pre = pre_tokenizer(spec)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    reverse = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    if reverse and max(reverse) >= vocab_size:
        raise FormatError(f"the tokenizer has ids up to {max(reverse)}, beyond the model's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        token = reverse.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if decoder[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer)
