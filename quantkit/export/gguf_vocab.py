"""GGUF's tokenizer: the vocabulary and how text is split before it, described as llama.cpp's converter describes
it (`describe_tokenizer`), or refused where quantkit cannot describe it exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

from quantkit.errors import FormatError


def _gguf():
    import gguf

    return gguf


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
    """The vocabulary, as llama.cpp's converter writes it: a byte-level BPE as llama.cpp's `gpt2` model with its
    merges (`describe_byte_level`), a SentencePiece-style BPE (byte fallback) as its `llama` model with scores
    (`describe_sentencepiece`); each refused, in one line, where llama.cpp would tokenize text differently."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FormatError("GGUF embeds the tokenizer, and the model has no tokenizer.json; add one to SRC")
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise FormatError(f"the tokenizer is a {model.get('type')} model; quantkit writes BPE tokenizers to GGUF: "
                          "use --format compressed-tensors")
    if model.get("byte_fallback"):
        describe_sentencepiece(writer, folder, vocab_size)
    else:
        describe_byte_level(writer, folder, vocab_size, pre_tokenizer(spec))


def token_table(tokenizer, vocab_size: int, sentencepiece: bool) -> tuple[list[str], list]:
    """(texts, types) of every id up to the model's vocab_size: ids the tokenizer lacks are UNUSED padding, added
    tokens CONTROL when special, USER_DEFINED otherwise, the rest NORMAL; for SentencePiece, also the unknown token
    UNKNOWN and `<0xXX>` BYTE (llama.cpp's byte fallback finds them by that type)."""
    gguf = _gguf()
    reverse = {i: token for token, i in tokenizer.get_vocab().items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    if reverse and max(reverse) >= vocab_size:
        raise FormatError(f"the tokenizer has ids up to {max(reverse)}, beyond the model's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        token = reverse.get(i)
        tokens.append(f"[PAD{i}]" if token is None else token)
        if token is None:
            types.append(gguf.TokenType.UNUSED)
        elif sentencepiece and i == tokenizer.unk_token_id:
            types.append(gguf.TokenType.UNKNOWN)
        elif token in added:
            types.append(gguf.TokenType.CONTROL if decoder[i].special else gguf.TokenType.USER_DEFINED)
        elif sentencepiece and token in BYTE_TOKENS:
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


class _Discard:
    """A writer that keeps nothing: `describe_tokenizer` run for its refusals alone (`check_tokenizer`)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def check_tokenizer(folder: Path, vocab_size: int) -> None:
    """Refuse, before any weight is read, a tokenizer `describe_tokenizer` would refuse after the quantization."""
    describe_tokenizer(_Discard(), Path(folder), vocab_size)


def describe_byte_level(writer, folder: Path, vocab_size: int, pre: str) -> None:
    """A byte-level BPE as llama.cpp's `gpt2` model: the token table, the named pre-tokenizer, and merges, special
    ids and the chat template through gguf's SpecialVocab."""
    from transformers import AutoTokenizer

    tokens, types = token_table(AutoTokenizer.from_pretrained(folder), vocab_size, sentencepiece=False)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    _gguf().SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer)


# ---------------------------------------------------------------- SentencePiece-style BPE (llama.cpp's `llama`)

BYTE_TOKENS = {f"<0x{b:02X}>": b for b in range(256)}
SPACE = "\u2581"  # SentencePiece's `▁`, which stands for a space in its pieces


def describe_sentencepiece(writer, folder: Path, vocab_size: int) -> None:
    """A SentencePiece-style BPE as llama.cpp's `llama` model (its SPM tokenizer), exactly as transformers
    tokenizes: llama.cpp merges any two neighbours that make a token, highest score first, where Hugging Face
    applies listed merges by rank; the scores written (`merge_scores`) make the two the same, and a vocabulary
    whose merges no scores can reproduce is refused. Read from the tokenizer as transformers loads it (its class
    may rebuild tokenizer.json's normalizer), with the BOS/EOS it adds around a text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise FormatError("transformers loads the tokenizer without its tokenizer.json (a slow tokenizer), which "
                          "quantkit cannot describe to llama.cpp; use --format compressed-tensors")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    check_spm_model(spec.get("model") or {})
    check_added_tokens(spec.get("added_tokens") or [])
    space_prefix = adds_space_prefix(spec)
    tokens, types = token_table(tokenizer, vocab_size, sentencepiece=True)
    partitioned = {added["content"] for added in spec.get("added_tokens") or []}
    scores = merge_scores(tokens, read_merges(spec["model"]), partitioned)
    add_bos, add_eos = added_around(tokenizer)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(space_prefix)
    special = _gguf().SpecialVocab(folder, load_merges=False, n_vocab=len(tokens))
    special.add_special_token = {"bos": add_bos, "eos": add_eos}
    special.add_to_gguf(writer)


def _refuse(why: str) -> FormatError:
    return FormatError(f"{why}, so llama.cpp could tokenize text differently from transformers; "
                       "use --format compressed-tensors")


def check_spm_model(model: dict) -> None:
    """A byte-fallback BPE that llama.cpp's SPM tokenizer can follow: no dropout, no whole-word shortcut
    (ignore_merges), no subword affixes, and all 256 byte tokens (llama.cpp's fallback for any character)."""
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise _refuse(f"the tokenizer's BPE sets {key} ({model[key]!r})")
    if model.get("ignore_merges"):
        raise _refuse("the tokenizer's BPE sets ignore_merges (a word in the vocabulary is one token)")
    missing = sorted(set(BYTE_TOKENS) - set(model.get("vocab") or {}))
    if missing:
        raise _refuse(f"the tokenizer lacks {len(missing)} of the 256 byte tokens (first {missing[0]})")


def check_added_tokens(added_tokens: list[dict]) -> None:
    """Added tokens matched in the raw text, as llama.cpp matches them: not after normalization, and no strip."""
    for added in added_tokens:
        flags = [flag for flag in ("normalized", "lstrip", "rstrip", "single_word") if added.get(flag)]
        if flags:
            raise _refuse(f"the added token {added['content']!r} is matched with {', '.join(flags)}")


def _steps(component: dict | None, sequence_key: str) -> list[dict]:
    if not component:
        return []
    return component[sequence_key] if component.get("type") == "Sequence" else [component]


PREPEND = {"type": "Prepend", "prepend": SPACE}
REPLACE = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
SPLIT_ON_SPACES = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}


def adds_space_prefix(spec: dict) -> bool:
    """llama.cpp's add_space_prefix for the way transformers' tokenizer marks spaces, or a refusal: spaces as `▁`
    with a `▁` before every text (a Prepend normalizer: before one that starts with a space too, as llama.cpp),
    or without one (a Replace normalizer alone, or Metaspace that never prepends). A Metaspace that prepends
    (prepend_scheme always/first, transformers' Llama class) adds none before a text that starts with a space,
    and `first` none after a special token: llama.cpp always adds one."""
    normalizers = _steps(spec.get("normalizer"), "normalizers")
    pre = _steps(spec.get("pre_tokenizer"), "pretokenizers")
    if pre in ([], [SPLIT_ON_SPACES]) and normalizers and all(step in (PREPEND, REPLACE) for step in normalizers):
        if normalizers in ([PREPEND, REPLACE], [REPLACE, PREPEND]):
            return True
        if normalizers == [REPLACE]:  # a split on spaces after none are left (Gemma's) changes nothing
            return False
    elif not normalizers and len(pre) == 1 and pre[0].get("type") == "Metaspace" and pre[0].get("replacement") == SPACE:
        scheme = pre[0].get("prepend_scheme", "always" if pre[0].get("add_prefix_space", True) else "never")
        if pre[0].get("split", True):
            raise _refuse("the tokenizer's Metaspace splits the text into words (llama.cpp's SPM does not)")
        if scheme == "never":
            return False
        raise _refuse(f"transformers' tokenizer prepends `▁` by a Metaspace (prepend_scheme {scheme!r}), none before "
                      "a text that starts with a space" + (" or follows a special token" if scheme == "first" else ""))
    raise _refuse(f"the tokenizer's normalizer ({json.dumps(spec.get('normalizer'))[:80]}) and pre-tokenizer "
                  f"({json.dumps(spec.get('pre_tokenizer'))[:80]}) are not SentencePiece's spaces as `▁`")


def read_merges(model: dict) -> list[tuple[str, str]]:
    """tokenizer.json's merges, pairs in either of its layouts ("a b" or ["a", "b"]), in rank order."""
    return [tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge) for merge in model.get("merges") or []]


def merge_scores(tokens: list[str], merges: list[tuple[str, str]], partitioned: set[str]) -> list[float]:
    """Scores under which llama.cpp's SPM tokenizer merges as Hugging Face's BPE does: minus the rank of the first
    merge that makes the token (0 for those no merge makes), as SentencePiece's own BPE scores follow its merge
    order. llama.cpp merges the two neighbours that make the highest-scored token, whichever they are; Hugging Face
    only listed merges, the lowest rank first. Refused where every two pieces that make a token are not a listed
    merge (`unlisted_pair`: a BPE trained by `tokenizers` lists only the merges it learned), or where a token's
    merges are not ranked together (`merge_groups`): no score per token could then follow the ranks.
    `partitioned`: added tokens, cut out of the text before either tokenizer sees it."""
    ranks = {merge: rank for rank, merge in reversed(list(enumerate(merges)))}
    groups = merge_groups(merges)
    problem = unlisted_pair(tokens, ranks, partitioned)
    if problem:
        raise _refuse(problem)
    if len(merges) >= 2 ** 24:  # float32 scores hold every rank below that exactly
        raise _refuse(f"the tokenizer has {len(merges):,} merges, more than float32 scores tell apart")
    return [-float(groups[token][0]) if token in groups else 0.0 for token in tokens]


def merge_groups(merges: list[tuple[str, str]]) -> dict[str, tuple[int, int]]:
    """(first, last) rank of the merges that make each token, or a refusal where a token's merges are not ranked
    together: one score per token could then not follow the ranks."""
    groups: dict[str, tuple[int, int]] = {}
    previous = None
    for rank, (left, right) in enumerate(merges):
        token = left + right
        if token != previous and token in groups:
            raise _refuse(f"the merges that make {token!r} are not ranked together (ranks {groups[token][0]} and {rank})")
        groups[token] = (groups.get(token, (rank, rank))[0], rank)
        previous = token
    return groups


def unlisted_pair(tokens: list[str], ranks: dict[tuple[str, str], int], partitioned: set[str]) -> str | None:
    """Two neighbours llama.cpp would merge and Hugging Face would not: pieces (tokens, or single characters) that
    make a token, not a listed merge. Tokens that hold an added token without a `▁` are left out: both cut added
    tokens out of the text first, so no text makes them."""
    cut_out = [text for text in partitioned if SPACE not in text]
    holds_added = re.compile("|".join(map(re.escape, cut_out))) if cut_out else None
    known = set(tokens)
    for token in tokens:
        if holds_added and holds_added.search(token):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if (left in known or len(left) == 1) and (right in known or len(right) == 1) and (left, right) not in ranks:
                return f"{left!r} + {right!r} make the token {token!r} but are not one of its merges"
    return None


def added_around(tokenizer) -> tuple[bool, bool]:
    """(add_bos, add_eos): whether transformers' tokenizer puts its BOS before and its EOS after a text; refused
    where it adds anything else (llama.cpp's SPM adds only those)."""
    bare = tokenizer("Hello", add_special_tokens=False).input_ids
    full = tokenizer("Hello").input_ids
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
    before, after = (full[:at], full[at + len(bare):]) if at is not None else (full, [])
    if at is None or before not in ([], [tokenizer.bos_token_id]) or after not in ([], [tokenizer.eos_token_id]):
        raise _refuse(f"transformers' tokenizer adds {tokenizer.convert_ids_to_tokens(full)} around 'Hello', not only BOS/EOS")
    return bool(before), bool(after)
