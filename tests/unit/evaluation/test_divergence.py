"""quantkit.evaluation.divergence: the per-token KL divergence and top-1 agreement against torch's kl_div and a worked
example; the reference's logits recorded in one chunking and compared in another; every scoring path (lm_head by
chunks, full logits, llama.cpp's scores) handing the same positions' logits in the same order."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from quantkit.data import eval_windows
from quantkit.errors import UsageError
from quantkit.evaluation import nll
from quantkit.evaluation.divergence import Comparison, kl_divergence
from quantkit.evaluation.evaluate import perplexity, score_windows
from quantkit.models.tiny import TINY_LLAMA


def _logits(rows: int = 37, vocab: int = 300, seed: int = 0, scale: float = 4.0) -> torch.Tensor:
    return scale * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- the math


def test_kl_divergence_equals_torchs_kl_div_per_token():
    reference = _logits(seed=0)
    other = reference + _logits(seed=1, scale=2.0)  # a perturbed copy: some argmaxes move, most stay
    kld, agree = kl_divergence(reference, other)
    expected = F.kl_div(F.log_softmax(other, -1), F.log_softmax(reference, -1), reduction="none", log_target=True).sum(-1)
    assert kld.shape == agree.shape == (37,)
    torch.testing.assert_close(kld, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(agree, reference.argmax(-1) == other.argmax(-1))
    assert 0 < int(agree.sum()) < 37  # some argmaxes agree, some do not: the check above can fail both ways


def test_identical_logits_give_zero_and_full_agreement():
    logits = _logits()
    kld, agree = kl_divergence(logits, logits.clone())
    assert torch.equal(kld, torch.zeros(37)) and bool(agree.all())
    shifted, _ = kl_divergence(logits, logits + 3.0)  # softmax ignores a constant added to every logit
    assert float(shifted.abs().max()) < 1e-5


def test_a_worked_two_token_example():
    """P = (0.8, 0.2), Q = (0.2, 0.8): KL(P || Q) = 0.8 ln 4 + 0.2 ln(1/4) = 0.6 ln 4, in nats; and the other way
    round the same, by symmetry. The argmaxes differ."""
    p = torch.tensor([[math.log(4.0), 0.0]])
    q = torch.tensor([[0.0, math.log(4.0)]])
    kld, agree = kl_divergence(p, q)
    assert kld.item() == pytest.approx(0.6 * math.log(4.0), rel=1e-6) and not agree.item()
    half = torch.tensor([[0.0, 0.0]])  # P = (1/2, 1/2), Q = (0.8, 0.2): 0.5 ln(0.5 / 0.8) + 0.5 ln(0.5 / 0.2)
    assert kl_divergence(half, p)[0].item() == pytest.approx(0.5 * math.log(0.625) + 0.5 * math.log(2.5), rel=1e-6)


def test_a_token_the_reference_never_predicts_adds_nothing():
    """A -inf logit (a masked token) has probability 0 in the reference: its term is 0, not NaN."""
    reference = torch.tensor([[2.0, 1.0, float("-inf")]])
    other = torch.tensor([[1.0, 2.0, 0.5]])
    kld, _ = kl_divergence(reference, other)
    p = torch.softmax(reference[0, :2], -1)
    q = torch.softmax(other[0], -1)[:2]
    assert kld.item() == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-5)


def test_shapes_that_differ_are_refused():
    with pytest.raises(ValueError, match="shape"):
        kl_divergence(_logits(vocab=300), _logits(vocab=301))


# ---------------------------------------------------------------- recorded in one chunking, compared in another


def _observe(observer, logits: torch.Tensor, chunk: int, digest: str = "d") -> None:
    observer.start(digest, logits.shape[0])
    for start in range(0, logits.shape[0], chunk):
        observer(logits[start:start + chunk])


def test_the_reference_is_recorded_and_each_later_row_compared_whatever_the_chunks(tmp_path):
    reference, first, second = _logits(seed=0), _logits(seed=1), _logits(seed=2)
    with Comparison(directory=tmp_path) as comparison:
        _observe(comparison.observer("ref"), reference, chunk=5)
        _observe(comparison.observer("a"), first, chunk=3)
        _observe(comparison.observer("b"), second, chunk=37)
        assert len(list(tmp_path.iterdir())) == 1  # the recording's directory
    assert not list(tmp_path.iterdir())  # removed on leaving
    none, a, b = comparison.results([10.0, 12.0, 9.0])
    assert none is None
    for found, logits, ratio in ((a, first, 1.2), (b, second, 0.9)):
        kld, agree = kl_divergence(reference, logits)
        assert (found.reference, found.tokens) == ("ref", 37)
        assert found.mean == pytest.approx(kld.double().mean().item(), rel=1e-6)
        assert found.median == pytest.approx(kld.double().median().item(), rel=1e-6)  # 37 values: the middle one
        assert found.p99 == pytest.approx(torch.quantile(kld.double(), 0.99).item(), rel=1e-6)
        assert found.top1_agreement == pytest.approx(agree.double().mean().item())
        assert found.perplexity_ratio == pytest.approx(ratio)


def test_a_row_on_other_tokens_or_another_vocabulary_is_refused_in_one_line(tmp_path):
    with Comparison(directory=tmp_path) as comparison:
        _observe(comparison.observer("ref"), _logits(), chunk=8, digest="d1")
        with pytest.raises(UsageError, match=r"^b is scored on other tokens than ref \(another tokenizer"):
            _observe(comparison.observer("b"), _logits(), chunk=8, digest="d2")
        with pytest.raises(UsageError, match=r"^c's logits span 301 tokens and ref's 300: KL divergence compares"):
            _observe(comparison.observer("c"), _logits(vocab=301), chunk=8, digest="d1")


def test_a_recording_the_disk_cannot_hold_is_refused_before_it_is_written(tmp_path, monkeypatch):
    import shutil

    from quantkit.evaluation import divergence

    monkeypatch.setattr(divergence.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with Comparison(directory=tmp_path) as comparison:
        recording = comparison.observer("ref")
        with pytest.raises(UsageError, match=r"keeps ref's logits of 37 scored tokens x 300 \(0.0 GB\) in .* 0.0 GB free; "
                                             r"pass --max-samples N"):
            _observe(recording, _logits(), chunk=8)
        assert recording.path.read_bytes() == b""


# ---------------------------------------------------------------- every scoring path observes the same positions


def _tiny(seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY_LLAMA)).eval()


class LogitsOf:
    """A stand-in for llama_cpp.Llama with logits_all (as tests/unit/evaluation/test_gguf.py's): `scores` are a
    transformers model's logits."""

    def __init__(self, model, n_ctx: int):
        self.model, self.scores = model, torch.zeros(n_ctx, model.config.vocab_size).numpy()

    def reset(self):
        pass

    def eval(self, tokens: list[int]):
        self.scores[: len(tokens)] = self.model(input_ids=torch.tensor([tokens])).logits[0].numpy()


def _full_logits(model, ids: torch.Tensor, windows) -> torch.Tensor:
    """The scored positions' logits, window by window, from the model's own forward."""
    rows = []
    with torch.inference_mode():
        for begin, end, target_begin in windows:
            logits = model(input_ids=ids[None, begin:end]).logits[0, :-1]
            rows.append(logits[target_begin - begin - 1:])
    return torch.cat(rows)


def test_every_scoring_path_hands_over_the_same_positions_in_the_same_order(tmp_path):
    """The reference scored by lm_head chunks (2 windows a batch, 7 positions a chunk), then the same model by its
    full logits and by llama.cpp's path: divergence 0, agreement 1; another model: the divergence of its
    logits at exactly those positions."""
    from quantkit.evaluation.gguf import windows_nll

    model, other = _tiny(0), _tiny(1)
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (300,), generator=torch.Generator().manual_seed(2))
    seq_len, stride = 64, 40
    windows = eval_windows(ids.numel(), seq_len, stride)
    chunked = nll.nll_function(model, ids)
    assert chunked.func is nll.chunked_nll
    with Comparison(directory=tmp_path) as comparison, torch.inference_mode():
        score_windows(partial(nll.chunked_nll, *chunked.args[:2], 7), ids, windows, seq_len, batch_size=2,
                      logits=comparison.observer("chunked"))
        score_windows(partial(nll.full_logits_nll, model), ids, windows, seq_len, batch_size=3,
                      logits=comparison.observer("full logits"))
        score_windows(partial(windows_nll, LogitsOf(model, seq_len), 5), ids, windows, seq_len,
                      logits=comparison.observer("llama.cpp's scores"))
        result = perplexity(other, ids, seq_len=seq_len, stride=stride, logits=comparison.observer("other"))
    _, full, cpp, found = comparison.results([1.0, 1.0, 1.0, result.perplexity])
    scored = sum(end - target_begin for _, end, target_begin in windows)
    for same in (full, cpp):
        assert same.tokens == scored and same.top1_agreement == 1.0 and same.mean < 1e-6 and same.p99 < 1e-5
    kld, agree = kl_divergence(_full_logits(model, ids, windows), _full_logits(other, ids, windows))
    assert found.tokens == scored and found.mean > 0.01
    assert found.mean == pytest.approx(kld.double().mean().item(), rel=1e-4)
    assert found.top1_agreement == pytest.approx(agree.double().mean().item())


def test_without_kl_divergence_nothing_is_observed_or_written(tmp_path):
    with Comparison(enabled=False, directory=tmp_path) as comparison:
        assert comparison.observer("ref") is None and comparison.observer("a") is None
        assert not list(tmp_path.iterdir())
    assert comparison.results([10.0, 11.0]) == [None, None]
