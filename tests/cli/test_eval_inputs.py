"""`quantkit eval`'s inputs: --text-field reaches the data, --baseline names one of MODEL by path however it is
written, and a --seq-len beyond a model's positions is one line and exit 2. The library is patched where the test
is about what the command passes; tests/unit/evaluation/test_evaluate.py measures."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from quantkit.cli.main import app
from quantkit.evaluation.evaluate import ModelReport, PerplexityResult
import quantkit.evaluation.evaluate

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def one_line(result) -> str:
    (line,) = result.output.strip().splitlines()
    return line


@pytest.fixture
def fake_compare(monkeypatch):
    """compare() recorded; each model a report, the first at perplexity 10 and the others 10.8. Model paths are
    taken as given (tests/unit/models proves resolve_source)."""
    from quantkit.models import sources

    monkeypatch.setattr(sources, "resolve_source", lambda src, revision=None: src)
    calls = []

    def fake(models, data, **kwargs):
        calls.append(SimpleNamespace(models=models, data=data, **kwargs))
        return [ModelReport(m, m, None, None, 10, PerplexityResult(10.0 if i == 0 else 10.8, 2.3, 100, 1.0, 100.0, 64))
                for i, m in enumerate(models)]

    monkeypatch.setattr(quantkit.evaluation.evaluate, "compare", fake)
    return calls


def test_text_field_reaches_compare(fake_compare):
    assert invoke("eval", "a", "--data", "d.jsonl", "--text-field", "content").exit_code == 0
    assert invoke("eval", "a", "--data", "d.jsonl").exit_code == 0
    assert [call.text_field for call in fake_compare] == ["content", "text"]


def test_without_seq_len_compare_picks_each_models_own(fake_compare):
    assert invoke("eval", "a", "--data", "t.txt").exit_code == 0
    assert fake_compare[0].seq_len is None  # compare's default: 512, or the model's positions where fewer


def test_baseline_is_the_model_at_the_same_path_however_written(fake_compare, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "base" / "final").mkdir(parents=True)
    (tmp_path / "q").mkdir()
    report = tmp_path / "r.json"
    result = invoke("eval", "runs/base/final", "q", "--data", "t.txt", "--baseline", "./runs/base/final/",
                    "--max-ppl-increase", "5", "--json", report)
    assert result.exit_code == 3, result.output  # q is 8% over the baseline
    assert fake_compare[0].models == ["runs/base/final", "q"]  # measured once, not again as a third model
    gate = json.loads(report.read_text())["gate"]
    assert gate["baseline"] == "runs/base/final" and gate["failures"] == [
        "q: perplexity 10.8 is +8.00% over runs/base/final (10); the limit is +5%"]


def test_a_baseline_that_is_not_one_of_the_models_is_refused(fake_compare):
    result = invoke("eval", "a", "b", "--data", "t.txt", "--baseline", "c", "--max-ppl-increase", "5")
    assert result.exit_code == 2 and not fake_compare
    assert one_line(result) == "error: --baseline c is not one of the models; pass it as a MODEL too"


def test_hub_ids_match_by_name(fake_compare):
    result = invoke("eval", "org/base", "org/base-int4", "--data", "t.txt", "--baseline", "org/base", "--max-ppl-increase", "10")
    assert result.exit_code == 0, result.output
    assert fake_compare[0].models == ["org/base", "org/base-int4"]


def test_a_seq_len_beyond_the_models_positions_is_one_line_and_exit_2(tiny_model_dir, text_file, monkeypatch):
    import quantkit.evaluation.evaluate as evaluate

    monkeypatch.setattr(evaluate, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    result = invoke("eval", tiny_model_dir, "--data", text_file, "--seq-len", "600", "--threads", "1", "--quiet")
    assert result.exit_code == 2
    assert one_line(result) == (f"error: --seq-len 600 is beyond {tiny_model_dir}'s 512 positions "
                                "(max_position_embeddings); use at most 512")


def test_with_tp_the_seq_len_is_checked_before_any_rank_is_launched(tiny_model_dir, text_file, monkeypatch):
    from quantkit.cli import launch
    from quantkit.evaluation import tensor_parallel

    monkeypatch.setattr(tensor_parallel, "check", lambda path, ranks, trust_remote_code: None)
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    result = invoke("eval", tiny_model_dir, "--data", text_file, "--seq-len", "513", "--tp", "2", "--device", "cpu")
    assert result.exit_code == 2
    assert one_line(result).startswith(f"error: --seq-len 513 is beyond {tiny_model_dir}'s 512 positions")


def test_calibration_sizes_reach_compare(fake_compare):
    """-q previews calibrate as finalize does: --num-samples, and --calib-seq-len (finalize's --seq-len; eval's
    --seq-len is the window)."""
    result = invoke("eval", "a", "--data", "t.txt", "-q", "gptq-w4a16", "--calib-data", "c.txt", "--num-samples", "4",
                    "--calib-seq-len", "64", "--seq-len", "128")
    assert result.exit_code == 0, result.output
    call = fake_compare[0]
    assert (call.seq_len, call.calibration.num_samples, call.calibration.seq_len) == (128, 4, 64)
    assert invoke("eval", "a", "--data", "t.txt", "-q", "gptq-w4a16", "--num-samples", "4").exit_code == 0
    assert fake_compare[1].calibration.num_samples == 4  # the recipe's own dataset, fewer samples
    assert invoke("eval", "a", "--data", "t.txt").exit_code == 0 and fake_compare[2].calibration is None


def test_too_little_calibration_text_names_evals_options(tiny_model_dir, text_file, tmp_path):
    """The library names the option that set the calibration length: eval's --calib-seq-len, not its window's."""
    short = tmp_path / "short.txt"
    short.write_text("a few words, not nearly enough for the recipe's samples\n" * 20)
    result = invoke("eval", tiny_model_dir, "--data", text_file, "-q", "gptq-w4a16", "--calib-data", short,
                    "--seq-len", "64", "--calib-seq-len", "32")
    assert result.exit_code == 2
    line = one_line(result)
    assert "; --num-samples 128 x --calib-seq-len 32 needs at least 4097" in line
    assert "at this --calib-seq-len" in line and " --seq-len" not in line


# ---------------------------------------------------------------- --kl-divergence and --max-kld


@pytest.fixture
def fake_divergence(monkeypatch):
    """compare() recorded; with kl_divergence, every report after the first a mean divergence of 0.05 from it."""
    from quantkit.evaluation.divergence import DivergenceResult
    from quantkit.models import sources

    monkeypatch.setattr(sources, "resolve_source", lambda src, revision=None: src)
    calls = []

    def fake(models, data, **kwargs):
        calls.append(SimpleNamespace(models=models, data=data, **kwargs))
        reports = [ModelReport(m, m, None, None, 10, PerplexityResult(10.0, 2.3, 100, 1.0, 100.0, 64)) for m in models]
        for report in reports[1:] if kwargs["kl_divergence"] else []:
            report.kl_divergence = DivergenceResult(models[0], 0.05, 0.04, 0.2, 0.9, 1.0, 100)
        return reports

    monkeypatch.setattr(quantkit.evaluation.evaluate, "compare", fake)
    return calls


def test_kl_divergence_reaches_compare_and_json(fake_divergence, tmp_path):
    report = tmp_path / "r.json"
    assert invoke("eval", "a", "b", "--data", "t.txt", "--kl-divergence", "--json", report).exit_code == 0
    assert invoke("eval", "a", "b", "--data", "t.txt").exit_code == 0
    assert [call.kl_divergence for call in fake_divergence] == [True, False]
    document = json.loads(report.read_text())
    assert [r["kl_divergence"] for r in document["results"]] == [None, {
        "reference": "a", "mean": 0.05, "median": 0.04, "p99": 0.2, "top1_agreement": 0.9, "perplexity_ratio": 1.0,
        "tokens": 100}]
    assert document["gate"] is None


def test_max_kld_gates_the_mean_divergence_without_a_baseline(fake_divergence, tmp_path):
    report = tmp_path / "r.json"
    failed = invoke("eval", "a", "b", "--data", "t.txt", "--kl-divergence", "--max-kld", "0.049", "--json", report, "--quiet")
    assert failed.exit_code == 3
    assert one_line(failed) == "error: b: mean KL divergence 0.05 from a; the limit is 0.049"
    gate = json.loads(report.read_text())["gate"]
    assert (gate["baseline"], gate["max_kld"], gate["passed"]) == (None, 0.049, False)
    passed = invoke("eval", "a", "b", "--data", "t.txt", "--kl-divergence", "--max-kld", "0.05", "--json", report)
    assert passed.exit_code == 0, passed.output
    assert json.loads(report.read_text())["gate"] == {"baseline": None, "max_ppl_increase_pct": None, "max_acc_drop_points": None,
                                                      "max_kld": 0.05, "passed": True, "failures": []}


@pytest.mark.parametrize("args, message", [
    (["a", "b", "--max-kld", "0.1"], "error: --max-kld gates the KL divergence from the first MODEL; pass --kl-divergence too"),
    (["a", "b", "--kl-divergence", "--max-kld", "0.1", "--baseline", "a"],
     "error: --baseline needs a limit to gate on: --max-ppl-increase PCT and/or --max-acc-drop POINTS (--max-kld needs no "
     "--baseline: it compares with the first MODEL)"),
])
def test_kl_divergence_usage_errors_are_one_line_and_exit_2(fake_divergence, args, message):
    result = invoke("eval", *args, "--data", "t.txt")
    assert result.exit_code == 2 and not fake_divergence
    assert one_line(result).startswith(message)


def test_one_model_and_a_recipe_preview_is_something_to_compare(fake_divergence):
    assert invoke("eval", "a", "-q", "int4-weight-only", "--data", "t.txt", "--kl-divergence").exit_code == 0
    assert fake_divergence[0].kl_divergence and fake_divergence[0].recipes == ["int4-weight-only"]
