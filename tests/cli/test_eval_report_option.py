"""`quantkit eval ... --report FILE.html`: a wrong FILE is one line and exit 2 before any model loads; the page holds
the numbers --json holds (the same reports, nothing measured again); only rank 0 writes. The page itself is
tests/unit/evaluation/test_eval_report.py's."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import quantkit.evaluation.evaluate
from quantkit.budget.report import GENERATOR
from quantkit.cli.main import app
from quantkit.evaluation.divergence import DivergenceResult
from quantkit.evaluation.evaluate import ModelReport, PerplexityResult
from quantkit.runtime import environment

runner = CliRunner()
BUDGET_PAGE = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n<meta name="generator" content="{GENERATOR}">\n'
               '</head><body>\n<svg id="budget"></svg><svg id="heatmap"></svg>\n</body></html>\n')


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def fake_compare(monkeypatch):
    """compare() recorded: the first model at perplexity 10, the others 10.8 and a KL divergence from it."""
    from quantkit.models import sources

    monkeypatch.setattr(sources, "resolve_source", lambda src, revision=None: src)
    calls = []

    def fake(models, data, **kwargs):
        calls.append(SimpleNamespace(models=models, data=data, **kwargs))
        reports = [ModelReport(m, m, None, None, 10, PerplexityResult(10.0 if i == 0 else 10.8, 2.3, 100, 1.0, 100.0, 64))
                   for i, m in enumerate(models)]
        for report in reports[1:]:
            report.kl_divergence = DivergenceResult(models[0], 0.05, 0.04, 0.2, 0.9, 1.08, 100)
        return reports

    monkeypatch.setattr(quantkit.evaluation.evaluate, "compare", fake)
    return calls


def test_the_table_goes_into_the_budget_page(fake_compare, tmp_path):
    path, document = tmp_path / "budget.html", tmp_path / "r.json"
    path.write_text(BUDGET_PAGE)
    result = invoke("eval", "base", "q", "--data", "t.txt", "--kl-divergence", "--report", path, "--json", document)
    assert result.exit_code == 0, result.output
    assert f"report: {path} (the Evaluation section of its budget page)" in result.output
    text = path.read_text()
    assert text.startswith(BUDGET_PAGE.split("</body>")[0]) and text.count('<section id="eval">') == 1
    cells = re.findall(r"<td>(.*?)</td>", text)
    results = json.loads(document.read_text())["results"]
    assert cells[0] == results[0]["label"] and cells[2] == f"{results[0]['perplexity']['perplexity']:.3f}"
    assert cells[10:15] == ["q", "10 B", "10.800", "+8.00%", "100"] and cells[15] == f"{results[1]['kl_divergence']['mean']:.4g}"


@pytest.mark.parametrize("name, message", [
    ("missing/eval.html", "error: --report {path}: {parent} does not exist; create it or give another path"),
    ("a-dir", "error: --report {path} is a directory; give a file, e.g. {path}/eval.html"),
    ("eval.txt", "error: --report {path}: the report is a web page, named .html, e.g. eval.html"),
])
def test_a_wrong_report_path_is_one_line_before_any_model_loads(fake_compare, tmp_path, name, message):
    (tmp_path / "a-dir").mkdir()
    path = tmp_path / name
    result = invoke("eval", "base", "--data", "t.txt", "--report", path)
    assert result.exit_code == 2 and not fake_compare
    (line,) = result.output.strip().splitlines()
    assert line == message.format(path=path, parent=path.parent)


def test_only_rank_0_writes(fake_compare, tmp_path, monkeypatch):
    monkeypatch.setattr(environment, "is_main_process", lambda: False)
    path = tmp_path / "eval.html"
    assert invoke("eval", "base", "--data", "t.txt", "--report", path).exit_code == 0
    assert fake_compare and not path.exists()


def test_a_tiny_model_measured_once_into_a_page_of_its_own(tiny_model_dir, text_file, tmp_path):
    path, document = tmp_path / "eval.html", tmp_path / "r.json"
    result = invoke("eval", tiny_model_dir, tiny_model_dir, "--data", text_file, "--kl-divergence", "--seq-len", "64",
                    "--max-samples", "2", "--threads", "1", "--device", "cpu", "--report", path, "--json", document)
    assert result.exit_code == 0, result.output
    results, cells = json.loads(document.read_text())["results"], re.findall(r"<td>(.*?)</td>", path.read_text())
    assert [cells[2], cells[12]] == [f"{r['perplexity']['perplexity']:.3f}" for r in results]
    assert cells[15:17] == [f"{results[1]['kl_divergence']['mean']:.4g}", f"{results[1]['kl_divergence']['median']:.4g}"]
