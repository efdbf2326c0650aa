"""quantkit.evaluation.evaluate: strided perplexity against transformers' own loss, reports, and the gate."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

from quantkit.data import eval_windows, tokenize
from quantkit.errors import SourceModelError, UsageError
from quantkit.evaluation.divergence import DivergenceResult
from quantkit.evaluation.evaluate import ModelReport, PerplexityResult, compare, gate, load_eval_model, make_report, perplexity
from quantkit.models.loading import weights_size

_SYLLABLES = "ka lo mi ren sta vor pel dun the and of qua tiz lay wei ght ro und".split()


def _text(n_words: int, seed: int = 0) -> str:
    """Deterministic pseudo-English from a fixed vocabulary of made-up words."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 3))) for _ in range(150)]
    words = rng.choices(vocab, weights=[1 / (i + 1) for i in range(len(vocab))], k=n_words)
    sentences = [" ".join(words[i : i + 9]).capitalize() + "." for i in range(0, n_words, 9)]
    return "\n".join(sentences)


@pytest.fixture(scope="module")
def eval_model_dir(tmp_path_factory) -> Path:
    from quantkit.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("eval-models") / "tiny", _text(3000))


@pytest.fixture(scope="module")
def model_and_tokenizer(eval_model_dir):
    return load_eval_model(eval_model_dir)


@pytest.fixture(scope="module")
def model(model_and_tokenizer):
    return model_and_tokenizer[0]


@pytest.fixture(scope="module")
def ids(model_and_tokenizer) -> torch.Tensor:
    ids = tokenize(model_and_tokenizer[1], [_text(600, seed=1), _text(300, seed=2)])
    assert 600 < ids.numel()  # long enough for several windows and for clipping to max_position_embeddings
    return ids


def _reference_nll_sum(model, ids: torch.Tensor, windows) -> tuple[float, int]:
    """Window by window with transformers' own (mean) loss, scaled back to a sum."""
    total, count = 0.0, 0
    with torch.no_grad():
        for begin, end, target_begin in windows:
            inputs = ids[begin:end][None]
            labels = inputs.clone()
            labels[:, : target_begin - begin] = -100
            scored = end - target_begin
            total += model(input_ids=inputs, labels=labels).loss.item() * scored
            count += scored
    return total, count


# ---------------------------------------------------------------- perplexity


def test_one_window_equals_transformers_loss(model, ids):
    short = ids[:200]
    result = perplexity(model, short, seq_len=256)
    with torch.no_grad():
        reference = math.exp(model(input_ids=short[None], labels=short[None]).loss.item())
    assert result.tokens == 199
    assert result.perplexity == pytest.approx(reference, rel=1e-5)
    assert result.nll == pytest.approx(math.log(reference), rel=1e-5)


@pytest.mark.parametrize("seq_len, stride", [(64, None), (64, 16), (100, 99)])
def test_strided_windows_equal_the_reference_sum(model, ids, seq_len, stride):
    windows = eval_windows(ids.numel(), seq_len, stride, None)
    total, count = _reference_nll_sum(model, ids, windows)
    result = perplexity(model, ids, seq_len=seq_len, stride=stride)
    assert result.tokens == count == ids.numel() - 1
    assert result.nll == pytest.approx(total / count, rel=1e-5)


@pytest.mark.parametrize("seq_len, stride", [(64, None), (64, 16), (50, 50)])
def test_batching_does_not_change_the_result(model, ids, seq_len, stride):
    single = perplexity(model, ids, seq_len=seq_len, stride=stride, batch_size=1)
    for batch_size in (2, 3):
        batched = perplexity(model, ids, seq_len=seq_len, stride=stride, batch_size=batch_size)
        assert batched.tokens == single.tokens == ids.numel() - 1
        assert batched.perplexity == pytest.approx(single.perplexity, rel=1e-5)


def test_stride_equal_to_seq_len_is_the_default(model, ids):
    assert perplexity(model, ids, seq_len=64).nll == pytest.approx(perplexity(model, ids, seq_len=64, stride=64).nll, rel=1e-6)


def test_max_samples_scores_only_the_first_windows(model, ids):
    result = perplexity(model, ids, seq_len=64, stride=32, max_samples=3)
    assert result.tokens == 63 + 32 + 32


def test_seq_len_is_clipped_to_max_position_embeddings(model, ids):
    assert model.config.max_position_embeddings == 512
    result = perplexity(model, ids, seq_len=100_000, stride=256)
    assert result.seq_len == 512
    assert result.tokens == ids.numel() - 1
    clipped = perplexity(model, ids, seq_len=512, stride=256)
    assert result.nll == pytest.approx(clipped.nll, rel=1e-6)


def test_timing_fields(model, ids):
    result = perplexity(model, ids[:300], seq_len=64)
    windows = eval_windows(300, 64, None, None)
    fed = sum(end - begin for begin, end, _ in windows)
    assert result.seconds > 0
    assert result.tokens_per_second == pytest.approx(fed / result.seconds)


def test_bad_arguments(model, ids):
    with pytest.raises(UsageError, match="batch_size"):
        perplexity(model, ids, batch_size=0)
    with pytest.raises(UsageError, match="1-D token stream"):
        perplexity(model, ids[None])


# ---------------------------------------------------------------- loading and reports


def test_directory_without_tokenizer(eval_model_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(eval_model_dir / name, bare / name)
    with pytest.raises(SourceModelError, match="has no tokenizer files; pass --tokenizer DIR"):
        load_eval_model(bare)
    model, tokenizer = load_eval_model(bare, tokenizer_path=eval_model_dir)
    assert len(tokenizer) == model.config.vocab_size


def test_not_a_model_directory(tmp_path):
    with pytest.raises(SourceModelError, match="does not exist"):
        load_eval_model(tmp_path / "missing")


def _result(ppl: float) -> PerplexityResult:
    return PerplexityResult(perplexity=ppl, nll=math.log(ppl), tokens=100, seconds=1.0, tokens_per_second=100.0)


def test_report_reads_quantkit_json(eval_model_dir, tmp_path):
    quantized = tmp_path / "quantized"
    shutil.copytree(eval_model_dir, quantized)
    (quantized / "quantkit.json").write_text(json.dumps({"recipe": {"name": "w4a16"}, "format": "torchao"}))
    report = make_report(quantized, "w4", _result(12.0))
    assert (report.recipe, report.format, report.label) == ("w4a16", "torchao", "w4")
    assert report.size_bytes == weights_size(quantized) > 0
    assert make_report(quantized, "w4", _result(12.0), recipe="preview").recipe == "preview"


def test_report_of_a_plain_model_and_to_dict(eval_model_dir):
    report = make_report(eval_model_dir, "base", _result(10.0))
    assert (report.recipe, report.format) == (None, None)
    as_dict = json.loads(json.dumps(report.to_dict()))
    assert as_dict["perplexity"]["perplexity"] == 10.0
    assert as_dict["path"] == str(eval_model_dir) and as_dict["label"] == "base"


# ---------------------------------------------------------------- gate


def _report(label: str, ppl: float) -> ModelReport:
    return ModelReport(path=f"/models/{label}", label=label, recipe=None, format=None, size_bytes=1, perplexity=_result(ppl))


def test_gate_fails_only_models_above_the_threshold():
    reports = [_report("base", 10.0), _report("ok", 10.4), _report("edge", 10.5), _report("bad", 10.6), _report("better", 9.0)]
    failures = gate(reports, "base", max_increase_pct=5.0)
    assert len(failures) == 1
    assert failures[0].startswith("bad: perplexity 10.6 is +6.00% over base (10)")


def test_gate_passes_when_all_within_budget():
    assert gate([_report("base", 10.0), _report("q", 10.1)], "base", 5.0) == []
    assert gate([_report("base", 10.0)], "base", 0.0) == []


def test_gate_fails_non_finite_perplexity():
    failures = gate([_report("base", 10.0), _report("nan", float("nan")), _report("inf", float("inf"))], "base", 50.0)
    assert [f.split(":")[0] for f in failures] == ["nan", "inf"]


def test_gate_unknown_baseline():
    with pytest.raises(UsageError, match=r"baseline 'fp16' is not among the evaluated models \(base, q\)"):
        gate([_report("base", 10.0), _report("q", 10.1)], "fp16", 5.0)


def _diverged(label: str, mean: float) -> ModelReport:
    report = _report(label, 10.0)
    report.kl_divergence = DivergenceResult("base", mean, mean, 2 * mean, 0.9, 1.01, 100)
    return report


def test_the_kl_gate_fails_models_whose_mean_divergence_is_over_the_limit_without_a_baseline():
    reports = [_report("base", 10.0), _diverged("ok", 0.01), _diverged("edge", 0.02), _diverged("bad", 0.03),
               _diverged("nan", float("nan"))]
    assert gate(reports, None, max_kld=0.02) == ["bad: mean KL divergence 0.03 from base; the limit is 0.02",
                                                 "nan: mean KL divergence nan from base; the limit is 0.02"]
    assert gate(reports[:3], None, max_kld=0.02) == []  # the reference row has no divergence: nothing to gate
    both = gate(reports[:4], "base", max_increase_pct=0.0, max_kld=0.025)  # ppl all equal: only the divergence fails
    assert both == ["bad: mean KL divergence 0.03 from base; the limit is 0.025"]


# ---------------------------------------------------------------- compare


@pytest.fixture
def keep_threads():
    """compare() sets torch's thread count for the process; put it back for the other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_compare_models_and_a_preview_recipe(eval_model_dir, tmp_path, keep_threads):
    data = tmp_path / "eval.txt"
    data.write_text(_text(400, seed=3))
    source = str(eval_model_dir)
    reports = compare([source], str(data), recipes=["int8-weight-only"], seq_len=64, threads=1)
    assert [r.label for r in reports] == [source, f"{source}+int8-weight-only"]
    base, preview = reports
    assert (base.recipe, base.format, base.size_bytes) == (None, None, weights_size(eval_model_dir))
    assert (preview.path, preview.recipe, preview.format) == (source, "int8-weight-only", "compressed-tensors")
    assert preview.size_bytes is None  # nothing was written
    assert preview.perplexity.tokens == base.perplexity.tokens
    assert preview.perplexity.perplexity != base.perplexity.perplexity
    assert gate(reports, source, 100.0) == []
    # the in-memory preview measures exactly what `finalize` writes
    from quantkit.finalization.finalize import finalize
    from quantkit.quant.registry import resolve

    written = finalize(eval_model_dir, tmp_path / "int8", resolve("int8-weight-only"))
    (artifact,) = compare([str(written.dst)], str(data), seq_len=64, threads=1)
    assert artifact.perplexity.perplexity == preview.perplexity.perplexity
    assert artifact.recipe == "int8-weight-only" and 0 < artifact.size_bytes < base.size_bytes


def test_a_qat_model_is_measured_under_its_recipe_and_under_another(eval_model_dir, tmp_path, keep_threads):
    """`eval QAT_MODEL -q OTHER`: a measurement, not an artifact, so another recipe than the one QAT trained for is
    measured (as `finalize --force-recipe` would quantize), and its own recipe is its convert step."""
    import shutil

    from quantkit.quant.registry import resolve

    src = tmp_path / "qat"
    shutil.copytree(eval_model_dir, src)
    (src / "quantkit.json").write_text(json.dumps({"qat": {"recipe": resolve("int4-weight-only").to_dict()}}))
    data = tmp_path / "eval.txt"
    data.write_text(_text(400, seed=3))
    reports = compare([str(src)], str(data), recipes=["int4-weight-only", "int8-weight-only"], seq_len=64, threads=1)
    assert [r.recipe for r in reports] == [None, "int4-weight-only", "int8-weight-only"]
    assert len({r.perplexity.perplexity for r in reports}) == 3


def test_quantize_with_only_quantized_models_is_refused_naming_them(eval_model_dir, tmp_path, keep_threads):
    """-q previews full-precision models; when every model is quantized already, nothing would take it: one line,
    before any model loads (with a full-precision model beside them, the quantized ones are measured as they are)."""
    from quantkit.finalization.finalize import finalize
    from quantkit.quant.registry import resolve

    data = tmp_path / "eval.txt"
    data.write_text(_text(400, seed=3))
    written = finalize(eval_model_dir, tmp_path / "int8", resolve("int8-weight-only")).dst
    with pytest.raises(UsageError, match=r"every model here is quantized already: .*int8 \(compressed-tensors\); evaluate"):
        compare([str(written)], str(data), recipes=["int4-weight-only"], seq_len=64, threads=1)
    reports = compare([str(eval_model_dir), str(written)], str(data), recipes=["int4-weight-only"], seq_len=64, threads=1)
    assert [r.recipe for r in reports] == [None, "int4-weight-only", "int8-weight-only"]


def test_compare_measures_each_model_on_the_same_tokens(eval_model_dir, tmp_path, keep_threads):
    data = tmp_path / "eval.jsonl"
    data.write_text("\n".join(json.dumps({"text": _text(100, seed=s)}) for s in range(4)))
    first, second = compare([str(eval_model_dir), str(eval_model_dir)], str(data), seq_len=64, threads=1)
    assert first.perplexity.perplexity == second.perplexity.perplexity


def test_compare_with_kl_divergence_compares_every_later_row_with_the_first(eval_model_dir, tmp_path, keep_threads):
    """The same model again: divergence 0, agreement 1; its int4 previews (each model's): above 0, with the
    perplexities' ratio."""
    data = tmp_path / "eval.txt"
    data.write_text(_text(400, seed=3))
    source = str(eval_model_dir)
    base, preview, again, other_preview = compare([source, source], str(data), recipes=["int4-weight-only"], seq_len=64,
                                                  threads=1, kl_divergence=True)
    assert [r.label for r in (base, preview, again)] == [source, f"{source}+int4-weight-only", source]
    assert base.kl_divergence is None and other_preview.kl_divergence == preview.kl_divergence
    assert (again.kl_divergence.mean, again.kl_divergence.p99, again.kl_divergence.top1_agreement) == (0.0, 0.0, 1.0)
    assert again.kl_divergence.perplexity_ratio == 1.0 and again.kl_divergence.tokens == base.perplexity.tokens
    found = preview.kl_divergence
    assert found.reference == source and found.mean > 0 and found.p99 >= found.median > 0 and found.top1_agreement < 1
    assert found.perplexity_ratio == pytest.approx(preview.perplexity.perplexity / base.perplexity.perplexity)
    assert json.loads(json.dumps(preview.to_dict()))["kl_divergence"]["mean"] == found.mean
    assert compare([source], str(data), seq_len=64, threads=1)[0].kl_divergence is None  # only when asked for


def test_kl_divergence_of_one_model_alone_is_refused_before_it_loads(eval_model_dir, tmp_path, monkeypatch):
    import quantkit.evaluation.evaluate as evaluate

    monkeypatch.setattr(evaluate, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(UsageError, match=r"^--kl-divergence compares each model with the first MODEL \(the reference\): "
                                         r"pass at least one more MODEL, or -q RECIPE$"):
        compare([str(eval_model_dir)], str(tmp_path / "unread.txt"), kl_divergence=True)


def test_a_torchao_artifact_whose_kernels_need_a_gpu_is_refused_on_the_cpu_in_one_line(tmp_path):
    import json

    import pytest

    from quantkit.errors import HardwareError
    from quantkit.evaluation.evaluate import _check_kernels_run_on
    from quantkit.quant.registry import resolve

    made = {"format": "torchao", "recipe": resolve("float8-dynamic-act-float8-weight").to_dict()}
    (tmp_path / "quantkit.json").write_text(json.dumps(made))
    with pytest.raises(HardwareError, match=r"compute capability 8.9\+; evaluate it on such a GPU \(--device cuda\)"):
        _check_kernels_run_on(tmp_path, "cpu")
    _check_kernels_run_on(tmp_path, "cuda")  # checked there by the kernels themselves
    made["format"] = "compressed-tensors"  # vLLM's format: dequantized on the CPU by plain transformers
    (tmp_path / "quantkit.json").write_text(json.dumps(made))
    _check_kernels_run_on(tmp_path, "cpu")


def test_compare_reads_the_text_field_asked_for_and_names_the_option_when_it_is_missing(eval_model_dir, tmp_path, keep_threads):
    data = tmp_path / "eval.jsonl"
    data.write_text("\n".join(json.dumps({"content": _text(100, seed=s)}) for s in range(4)))
    with pytest.raises(UsageError, match=r"eval\.jsonl:1 has no field 'text' \(fields: content\); pass --text-field NAME$"):
        compare([str(eval_model_dir)], str(data), seq_len=64, threads=1)
    (report,) = compare([str(eval_model_dir)], str(data), seq_len=64, threads=1, text_field="content")
    assert report.perplexity.tokens > 64


@pytest.fixture
def short_model_dir(eval_model_dir, tmp_path) -> Path:
    """The tiny Llama with 128 positions (max_position_embeddings) instead of 512: the same weights (RoPE has no
    position table)."""
    short = tmp_path / "short"
    shutil.copytree(eval_model_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    return short


def test_a_seq_len_beyond_a_models_positions_is_refused_before_any_weights_load(eval_model_dir, short_model_dir, tmp_path,
                                                                                 keep_threads, monkeypatch):
    import quantkit.evaluation.evaluate as evaluate

    data = tmp_path / "eval.txt"
    data.write_text(_text(400, seed=3))
    monkeypatch.setattr(evaluate, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(UsageError) as info:
        compare([str(eval_model_dir), str(short_model_dir)], str(data), seq_len=200, threads=1)
    assert str(info.value) == (f"--seq-len 200 is beyond {short_model_dir}'s 128 positions (max_position_embeddings); "
                               "use at most 128")


def test_without_a_seq_len_each_model_takes_512_tokens_or_its_positions(eval_model_dir, short_model_dir, tmp_path, keep_threads):
    data = tmp_path / "eval.txt"
    data.write_text(_text(400, seed=3))
    full, short = compare([str(eval_model_dir), str(short_model_dir)], str(data), threads=1, max_samples=1)
    assert (full.perplexity.seq_len, short.perplexity.seq_len) == (512, 128)
    (exact,) = compare([str(short_model_dir)], str(data), seq_len=128, threads=1, max_samples=1)
    assert exact.perplexity.perplexity == short.perplexity.perplexity
