"""quantkit.evaluation.gguf without llama.cpp: which paths are GGUF files, the missing extra, which ids a GGUF model
is fed, and the gate and windows of rows scored on other tokens."""

from __future__ import annotations

import sys

import pytest
import torch

from quantkit.errors import HardwareError, SourceModelError, UsageError
from quantkit.evaluation import gguf
from quantkit.evaluation.evaluate import ModelReport, PerplexityResult, gate, plan_windows, windows_digest


def gguf_file(path, body: bytes = b"\x03\x00\x00\x00") -> str:
    path.write_bytes(gguf.MAGIC + body)
    return str(path)


def test_a_gguf_path_is_one_named_so():
    from quantkit.export.gguf_reader import detect  # GGUF's reader: what `eval` runs in llama.cpp

    assert detect("m/model-Q4_0.gguf") and detect("M.GGUF")
    assert not detect("m/model") and not detect("org/name")


@pytest.mark.parametrize("make, message", [
    (lambda p: p, "does not exist"),
    (lambda p: p.mkdir() or p, "is a directory"),
    (lambda p: (p.write_text("not a model\n"), p)[1], "is not a GGUF file"),
    (lambda p: (p.write_bytes(b""), p)[1], "is not a GGUF file"),
])
def test_a_bad_gguf_path_is_one_line(tmp_path, make, message):
    path = make(tmp_path / "m.gguf")
    with pytest.raises(SourceModelError, match=message) as raised:
        gguf.check_gguf_file(path)
    assert raised.value.exit_code == 2 and "\n" not in str(raised.value)
    assert gguf.check_gguf_file(gguf_file(tmp_path / "ok.gguf")).name == "ok.gguf"


def test_without_the_extra_the_error_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` fails as if it were not installed
    with pytest.raises(HardwareError, match=r"pip install 'quantkit-llm\[gguf\]'") as raised:
        gguf.require_llama_cpp()
    assert raised.value.exit_code == 2


def test_options_a_gguf_cannot_take_are_refused_before_the_extra_is_needed(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    model = gguf_file(tmp_path / "m.gguf")
    gguf.check_options(["./plain", "org/name"], tp=4, max_acc_drop=1.0)  # no .gguf: nothing to check
    with pytest.raises(UsageError, match="evaluate it without --tp"):
        gguf.check_options(["./plain", model], tp=2)
    with pytest.raises(UsageError, match="gate it with --max-ppl-increase"):
        gguf.check_options([model], max_acc_drop=1.0)
    with pytest.raises(HardwareError, match="quantkit-llm"):
        gguf.check_options([model])


def test_cuda_is_refused_where_llama_cpp_has_no_gpu_support(monkeypatch, tmp_path):
    fake = type(sys)("llama_cpp")
    fake.llama_supports_gpu_offload = lambda: False
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    model = gguf_file(tmp_path / "m.gguf")
    gguf.check_options([model], device="auto")
    gguf.check_options([model], device="cpu")
    with pytest.raises(HardwareError, match="--device cuda:1: this llama-cpp-python has no GPU support"):
        gguf.check_options([model], device="cuda:1")


# ---------------------------------------------------------------- which ids


class Vocab:
    """A stand-in for llama_cpp.Llama(vocab_only=True): one id per character of a small alphabet, or per word."""

    def __init__(self, alphabet: str, by_word: bool = False):
        self.alphabet, self.by_word = alphabet, by_word

    def n_vocab(self) -> int:
        return len(self.alphabet) + (100 if self.by_word else 0)

    def tokenize(self, text: bytes, add_bos: bool, special: bool) -> list[int]:
        assert not add_bos  # the Hugging Face rows are scored without a BOS, and so is a GGUF
        chars = [self.alphabet.index(c) for c in text.decode()]
        return [len(self.alphabet) + len(text.split())] if self.by_word else chars

    def detokenize(self, ids: list[int], special: bool = False) -> bytes:
        return "".join(self.alphabet[i] for i in ids).encode()


def test_llama_cpps_own_ids_when_they_agree_or_there_is_nothing_to_agree_with():
    vocab = Vocab("ab ")
    assert gguf.choose_ids(vocab, "ab ba", None) == gguf.ChosenIds([0, 1, 2, 1, 0], None)
    assert gguf.choose_ids(vocab, "ab ba", [0, 1, 2, 1, 0], "./m") == gguf.ChosenIds([0, 1, 2, 1, 0], None)


def test_the_reference_ids_when_the_vocabulary_reads_them_back_as_the_text():
    vocab = Vocab("ab ", by_word=True)  # splits otherwise, but id i still means alphabet[i]
    vocab.tokenize = lambda text, add_bos, special: [0, 1, 2, 1, 1]  # differs from the reference at token 4
    chosen = gguf.choose_ids(vocab, "ab ba", [0, 1, 2, 1, 0], "./m")
    assert chosen.ids == [0, 1, 2, 1, 0]
    assert chosen.note.startswith("llama.cpp's own tokenizer splits the text differently (5 tokens, ./m: 5; first at token 4)")
    assert "scored on ./m's ids" in chosen.note


@pytest.mark.parametrize("reference", [[0, 1, 2, 1], [0, 1, 2, 1, 9]])  # another text; an id beyond the vocabulary
def test_llama_cpps_own_ids_and_a_note_when_the_vocabularies_differ(reference):
    chosen = gguf.choose_ids(Vocab("ab "), "ab ba", reference, "./m")
    assert chosen.ids == [0, 1, 2, 1, 0]
    assert chosen.note == (f"tokenized by llama.cpp (5 tokens, ./m: {len(reference)}): its vocabulary does not read ./m's "
                           "ids back as the text")


# ---------------------------------------------------------------- windows and the gate


def test_plan_windows_clips_to_the_context_and_digests_the_tokens_scored():
    assert plan_windows(100, 64, 32, limit=16) == (16, plan_windows(100, 16, 16)[1])
    ids = torch.arange(100)
    _, windows = plan_windows(100, 32, max_samples=2)
    assert windows_digest(ids, windows) == windows_digest(torch.cat([ids[:63], -ids[63:]]), windows)  # past the last window
    assert windows_digest(ids, windows) != windows_digest(ids.flip(0), windows)
    assert windows_digest(ids, windows) != windows_digest(ids, plan_windows(100, 32, 16, max_samples=2)[1])


def report(label: str, ppl: float, digest: str = "d1", note: str | None = None) -> ModelReport:
    return ModelReport(label, label, None, "gguf Q8_0", 1, PerplexityResult(ppl, 0.0, 10, 1.0, 1.0, 8, digest),
                       runtime="llama.cpp", tokens_note=note)


def test_the_gate_compares_only_rows_scored_on_the_same_tokens():
    assert gate([report("a", 10.0), report("b.gguf", 10.4)], "a", max_increase_pct=5) == []
    assert gate([report("a", 10.0, ""), report("b.gguf", 10.4, "d2")], "a", max_increase_pct=5) == []  # digest unknown
    (failure,) = gate([report("a", 10.0), report("b.gguf", 9.0, "d2", "tokenized by llama.cpp")], "a", max_increase_pct=5)
    assert failure == ("b.gguf: scored on other tokens than a: tokenized by llama.cpp; perplexities over different tokens do not "
                       "compare, so the gate cannot pass it")


# ---------------------------------------------------------------- the loss, from llama.cpp's logits


class LogitsOf:
    """A stand-in for a llama_cpp.Llama with logits_all: `eval` fills `scores` with a transformers model's logits."""

    def __init__(self, model, n_ctx: int):
        self.model, self.scores, self.fresh = model, torch.zeros(n_ctx, model.config.vocab_size).numpy(), False

    def n_vocab(self) -> int:
        return self.model.config.vocab_size

    def reset(self):
        self.fresh = True

    def eval(self, tokens: list[int]):
        assert self.fresh, "each window is decoded from an empty cache"
        self.scores[: len(tokens)] = self.model(input_ids=torch.tensor([tokens])).logits[0].numpy()
        self.fresh = False


@pytest.mark.parametrize("seq_len, stride, rows", [(64, None, 1000), (64, 16, 7), (50, 49, 1)])
def test_llama_cpps_logits_give_the_perplexity_of_the_same_logits_in_transformers(tiny_model_dir, text_file, seq_len, stride, rows):
    from functools import partial

    from quantkit.data import tokenize
    from quantkit.evaluation.evaluate import load_eval_model, perplexity, score_windows
    from quantkit.evaluation.gguf import windows_nll as _gguf_nll  # moved from evaluate: GGUF's engine

    model, tokenizer = load_eval_model(tiny_model_dir)
    ids = tokenize(tokenizer, [text_file.read_text()])[:400]
    expected = perplexity(model, ids, seq_len=seq_len, stride=stride)
    _, windows = plan_windows(ids.numel(), seq_len, stride)
    with torch.inference_mode():
        got = score_windows(partial(_gguf_nll, LogitsOf(model, seq_len), rows), ids, windows, seq_len)
    assert (got.tokens, got.seq_len, got.windows_digest) == (expected.tokens, expected.seq_len, expected.windows_digest)
    assert got.nll == pytest.approx(expected.nll, rel=1e-6)
