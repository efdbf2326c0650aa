"""A SentencePiece-style tokenizer written to GGUF by quantkit tokenizes in llama.cpp exactly as in transformers:
the same ids, BOS included, on text with leading spaces, newlines, digits, characters outside the vocabulary (byte
fallback) and special tokens. Needs llama-cpp-python (the `gguf` extra)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.llama_cpp_python]

llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python: pip install 'quantkit-llm[gguf]'")

TEXTS = [
    "Hello world",
    " one leading space",
    "   three leading spaces, and  two  inside",
    "line one\nline two\n\n\tindented\n",
    "digits 0123456789, 3.14159 and 2026-11-27",
    "outside the vocabulary: naïve café, 東京, Ωμέγα, 😀🦙",
    "<s>special tokens</s> in the text </s>  and after",
    "<unk> is special too; <0x41> is only text",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    """(the tiny SentencePiece-style Llama, its Q8_0 GGUF by quantkit's writer)."""
    from conftest import make_text
    from quantkit.finalization.finalize import finalize
    from quantkit.models.tiny import build_tiny_llama
    from quantkit.quant import registry

    root = tmp_path_factory.mktemp("spm")
    src = build_tiny_llama(root / "spm-llama", make_text(3000), tokenizer="sentencepiece", vocab_size=1024)
    out = root / "spm-Q8_0.gguf"
    finalize(src, out, registry.resolve("gguf-q8-0"))
    return src, out


@pytest.mark.parametrize("text", TEXTS)
def test_llama_cpp_tokenizes_as_transformers(spm_gguf, text):
    from transformers import AutoTokenizer

    src, out = spm_gguf
    expected = AutoTokenizer.from_pretrained(src)(text).input_ids  # BOS first: add_bos_token in the header
    vocab = llama_cpp.Llama(model_path=str(out), vocab_only=True, verbose=False)
    assert vocab.tokenize(text.encode("utf-8"), add_bos=True, special=True) == expected


def test_the_texts_use_byte_fallback_and_special_tokens(spm_gguf):
    """The texts above reach what they are meant to: byte tokens, special tokens, a `▁` alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spm_gguf[0])
    pieces = {piece for text in TEXTS for piece in tokenizer.convert_ids_to_tokens(tokenizer(text).input_ids)}
    assert {"<0xF0>", "<0x0A>", "<s>", "</s>", "<unk>", "\u2581"} <= pieces


def test_wikitext_like_text_tokenizes_the_same(spm_gguf, text_file):
    from transformers import AutoTokenizer

    src, out = spm_gguf
    text = text_file.read_text()
    vocab = llama_cpp.Llama(model_path=str(out), vocab_only=True, verbose=False)
    assert vocab.tokenize(text.encode("utf-8"), add_bos=True, special=True) == AutoTokenizer.from_pretrained(src)(text).input_ids


def test_strings_glued_from_its_pieces_tokenize_the_same(spm_gguf):
    """Pieces glued at random (words run together, spaces anywhere): where llama.cpp's merge order would show
    against Hugging Face's if the scores did not follow the merges (every score -1000, as gguf's LlamaHfVocab
    writes them: 52 of these 500 differ)."""
    import random

    from transformers import AutoTokenizer

    src, out = spm_gguf
    tokenizer = AutoTokenizer.from_pretrained(src)
    pieces = sorted(token.replace("\u2581", " ") for token in tokenizer.get_vocab() if not token.startswith("<"))
    rng = random.Random(0)
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(2, 6))) for _ in range(500)]
    vocab = llama_cpp.Llama(model_path=str(out), vocab_only=True, verbose=False)
    differ = [text for text in texts if vocab.tokenize(text.encode("utf-8"), add_bos=True, special=True) != tokenizer(text).input_ids]
    assert differ == []
