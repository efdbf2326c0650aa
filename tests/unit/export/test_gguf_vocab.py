"""A SentencePiece-style tokenizer in GGUF (export/gguf_vocab.py): llama.cpp's `llama` model with scores that make
its merges Hugging Face's, the token types and flags llama.cpp reads; and the refusals, in one line, of tokenizers
llama.cpp could split differently."""

import json

import pytest

gguf = pytest.importorskip("gguf")

from quantkit.errors import FormatError  # noqa: E402
from quantkit.export.gguf_vocab import SPACE, adds_space_prefix, describe_tokenizer, merge_scores  # noqa: E402
from quantkit.finalization.finalize import finalize  # noqa: E402
from quantkit.quant import registry  # noqa: E402

REFUSAL = "llama.cpp could tokenize text differently from transformers; use --format compressed-tensors"


@pytest.fixture(scope="module")
def spm_model_dir(tmp_path_factory):
    """A tiny Llama with a Llama-2-style tokenizer (byte fallback, `▁` for spaces, <unk> <s> </s>, 256 byte tokens)."""
    from conftest import make_text
    from quantkit.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "spm-llama", make_text(3000), tokenizer="sentencepiece")


def test_a_token_scores_minus_the_rank_of_its_first_merge():
    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc"]
    merges = [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]
    assert merge_scores(tokens, merges, {"<unk>"}) == [0.0, 0.0, 0.0, 0.0, -0.0, -1.0, -2.0]


def test_two_pieces_that_make_a_token_but_are_not_its_merge_are_refused():
    """llama.cpp would merge a + bc into abc; Hugging Face's BPE, which lists only ab + c, would not."""
    with pytest.raises(FormatError, match=f"'a' \\+ 'bc' make the token 'abc' but are not one of its merges, so {REFUSAL}"):
        merge_scores(["a", "b", "c", "ab", "bc", "abc"], [("a", "b"), ("b", "c"), ("ab", "c")], set())
    with pytest.raises(FormatError, match="'x' \\+ 'y' make the token 'xy'"):  # single characters merge in llama.cpp
        merge_scores(["a", "b", "ab", "xy"], [("a", "b")], set())


def test_merges_of_one_token_ranked_apart_are_refused():
    merges = [("a", "b"), ("b", "c"), ("ab", "c"), ("b", "a"), ("a", "bc")]
    with pytest.raises(FormatError, match="the merges that make 'abc' are not ranked together \\(ranks 2 and 4\\)"):
        merge_scores(["a", "b", "c", "ab", "bc", "ba", "abc"], merges, set())


def test_tokens_that_hold_an_added_token_are_not_made_by_merges():
    """Both tokenizers cut `<unk>` out of the text first: `▁<unk>` needs no merge; an added token with a `▁` does."""
    tokens = ["<unk>", SPACE, "<", "u", f"{SPACE}<unk>"]
    assert merge_scores(tokens, [], {"<unk>"}) == [0.0] * 5
    with pytest.raises(FormatError, match="make the token"):
        merge_scores([*tokens, f"{SPACE}<"], [], {"<unk>"})


def normalizer(*steps):
    return {"type": "Sequence", "normalizers": list(steps)}


PREPEND = {"type": "Prepend", "prepend": SPACE}
REPLACE = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}


def metaspace(scheme: str, split: bool = False) -> dict:
    return {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": scheme, "split": split}


def test_the_space_prefix_is_read_from_the_normalizer():
    assert adds_space_prefix({"normalizer": normalizer(PREPEND, REPLACE), "pre_tokenizer": None}) is True  # Llama 2's file
    assert adds_space_prefix({"normalizer": REPLACE, "pre_tokenizer": None}) is False
    gemma = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
    assert adds_space_prefix({"normalizer": REPLACE, "pre_tokenizer": gemma}) is False  # splits on spaces none are left of
    assert adds_space_prefix({"normalizer": None, "pre_tokenizer": metaspace("never")}) is False


@pytest.mark.parametrize("spec, why", [
    ({"normalizer": None, "pre_tokenizer": metaspace("always")}, "prepend_scheme 'always'.*starts with a space"),
    ({"normalizer": None, "pre_tokenizer": metaspace("first")}, "prepend_scheme 'first'.*follows a special token"),
    ({"normalizer": None, "pre_tokenizer": metaspace("never", split=True)}, "splits the text into words"),
    ({"normalizer": normalizer({"type": "NFKC"}, REPLACE), "pre_tokenizer": None}, "not SentencePiece's spaces"),
])
def test_a_prefix_llama_cpp_cannot_reproduce_is_refused(spec, why):
    """transformers' Metaspace adds no `▁` before a text that starts with a space (" Hello": `▁Hello`), where
    llama.cpp's add_space_prefix always adds one (`▁`, `▁Hello`)."""
    with pytest.raises(FormatError, match=f"{why}.*{REFUSAL}"):
        adds_space_prefix(spec)


def test_the_header_is_llama_cpps_sentencepiece_vocabulary(spm_model_dir, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "spm.gguf"
    finalize(spm_model_dir, out, registry.resolve("gguf-q8-0"))
    fields = gguf.GGUFReader(out).fields
    tokenizer = AutoTokenizer.from_pretrained(spm_model_dir)
    spec = json.loads((spm_model_dir / "tokenizer.json").read_text())
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert all(tokens[i] == token for token, i in tokenizer.get_vocab().items()) and len(tokens) == len(tokenizer)
    first_rank = {}
    for rank, (left, right) in enumerate(spec["model"]["merges"]):
        first_rank.setdefault(left + right, rank)
    assert len(first_rank) < len(spec["model"]["merges"])  # some tokens are made by several merges
    assert fields["tokenizer.ggml.scores"].contents() == [-float(first_rank.get(token, 0)) for token in tokens]
    types = fields["tokenizer.ggml.token_type"].contents()
    T = gguf.TokenType
    assert types[:3] == [T.UNKNOWN, T.CONTROL, T.CONTROL] and tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)] and set(types[3:259]) == {T.BYTE}
    assert set(types[259:]) == {T.NORMAL}
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is True
    assert fields["tokenizer.ggml.add_bos_token"].contents() is True and fields["tokenizer.ggml.add_eos_token"].contents() is False
    assert (fields["tokenizer.ggml.bos_token_id"].contents(), fields["tokenizer.ggml.eos_token_id"].contents(),
            fields["tokenizer.ggml.unknown_token_id"].contents()) == (1, 2, 0)
    assert "tokenizer.ggml.merges" not in fields


def copy_model(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_merges_transformers_trained_are_refused(spm_model_dir, tmp_path):
    """A BPE as `tokenizers` trains it lists only the merges it learned; llama.cpp merges any two pieces that make
    a token. The tiny tokenizer with one merge of a token made by several taken out: refused, in one line."""
    src = copy_model(spm_model_dir, tmp_path / "learned")
    spec = json.loads((src / "tokenizer.json").read_text())
    merges = spec["model"]["merges"]
    made = [left + right for left, right in merges]
    dropped = next(i for i, token in enumerate(made) if made.count(token) > 1)
    spec["model"]["merges"] = merges[:dropped] + merges[dropped + 1:]
    (src / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(FormatError, match=f"make the token {made[dropped]!r} but are not one of its merges, so {REFUSAL}") as refused:
        describe_tokenizer(None, src, 512)
    assert "\n" not in str(refused.value)


def test_a_llama_class_tokenizer_as_transformers_5_rebuilds_it_is_refused(spm_model_dir, tmp_path):
    """tokenizer_class LlamaTokenizer (Llama 2, Mistral): transformers 5 replaces tokenizer.json's normalizer by a
    Metaspace, which llama.cpp's space prefix cannot follow."""
    src = copy_model(spm_model_dir, tmp_path / "llama-class")
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer", "legacy": False}))
    with pytest.raises(FormatError, match=f"Metaspace \\(prepend_scheme 'first'\\).*{REFUSAL}"):
        finalize(src, tmp_path / "m.gguf", registry.resolve("gguf-q8-0"))
    assert not (tmp_path / "m.gguf").exists()


def test_a_normalizer_that_does_more_than_mark_spaces_is_refused():
    other = {"type": "Replace", "pattern": {"String": "x"}, "content": "y"}
    for steps in ([other, REPLACE], [PREPEND, REPLACE, PREPEND], [PREPEND]):
        with pytest.raises(FormatError, match="not SentencePiece's spaces"):
            adds_space_prefix({"normalizer": normalizer(*steps), "pre_tokenizer": None})


def test_a_tokenizer_is_refused_before_any_weight_is_read(spm_model_dir, tmp_path):
    """The tokenizer is described (and refused) by finalize's checks (`checks.prepare`: config and safetensors
    headers, no weight), not only when the file is written after the quantization."""
    from quantkit.finalization.checks import prepare

    src = copy_model(spm_model_dir, tmp_path / "llama-class")
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer", "legacy": False}))
    with pytest.raises(FormatError, match=REFUSAL):
        prepare(src, registry.resolve("gguf-q8-0"))
