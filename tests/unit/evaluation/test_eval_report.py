"""`eval --report FILE.html`: the results table added to the budget page `finalize --report` wrote (once, however
often eval runs), else a page of its own; every string escaped, nothing fetched, written all at once. The browser's
view of the two together is tests/unit/budget/test_report.py's."""

from __future__ import annotations

import os
import re

import pytest

from quantkit.budget.planner import BudgetPlan
from quantkit.budget.report import GENERATOR, render
from quantkit.budget.sensitivity import Sensitivity
from quantkit.evaluation import report as page
from quantkit.evaluation.divergence import DivergenceResult
from quantkit.evaluation.evaluate import ModelReport, PerplexityResult
from quantkit.evaluation.tasks import TaskResult
from quantkit.quant import registry


def budget_page() -> str:
    errors = {"lm_head": {"Q4_K": 0.01, "Q8_0": 0.001}, "token_embd": {"Q4_K": 0.02, "Q8_0": 0.002}}
    measured = Sensitivity(errors, errors, {}, {}, tokens=256)
    return render(BudgetPlan(registry.resolve("gguf-q4-k-m"), {"lm_head": "Q8_0", "token_embd": "Q4_K"}, 6.5, 6.49, 1000,
                             1230, 0.012, measured))


def reports(second: float = 10.8, label: str = "runs/q4", note: str | None = None) -> list[ModelReport]:
    base = ModelReport("runs/base", "runs/base", None, None, 3 << 20, PerplexityResult(10.0, 2.3, 100, 1.0, 1234.0, 64))
    other = ModelReport(label, label, "gguf-q4-k-m", "gguf", 1 << 20, PerplexityResult(second, 2.4, 100, 1.0, 2345.0, 64),
                        tokens_note=note, runtime="llama.cpp")
    other.kl_divergence = DivergenceResult("runs/base", 0.05, 0.04, 0.2, 0.9, second / 10.0, 100)
    return [base, other]


def sections(text: str) -> list[str]:
    return re.findall(r'<section id="eval">.*?</section>', text, re.DOTALL)


def test_the_section_goes_at_the_end_of_a_budget_pages_body(tmp_path):
    path = tmp_path / "budget.html"
    path.write_text(budget_page())
    assert page.write(path, reports(), data="wiki.test.txt") is True
    text = path.read_text()
    (found,) = sections(text)
    assert text == budget_page().replace("</body>", found + "\n</body>")  # the budget page itself untouched
    assert '<svg id="heatmap"' in text and text.index(found) > text.index("<h2>Tensors</h2>")
    cells = re.findall(r"<td>(.*?)</td>", found)
    assert cells[:10] == ["runs/base", "3.0 MiB", "10.000", "baseline", "1,234", "reference", "", "", "", ""]
    assert cells[10:] == ["runs/q4<br><small>gguf-q4-k-m / gguf</small>", "1.0 MiB", "10.800", "+8.00%", "2,345",
                          "0.05", "0.04", "0.2", "90.00%", "1.0800"]
    assert re.findall(r"<th>(.*?)</th>", found) == ["model", "size", "perplexity", "change", "tokens/s", "KLD mean",
                                                    "KLD median", "KLD p99", "top-1", "ppl ratio"]
    assert "Perplexity on wiki.test.txt; change relative to runs/base; KL divergence" in found


def test_a_second_run_replaces_the_section(tmp_path):
    path = tmp_path / "budget.html"
    path.write_text(budget_page())
    page.write(path, reports(10.8))
    page.write(path, reports(12.0))
    (found,) = sections(path.read_text())
    assert "+20.00%" in found and "+8.00%" not in found
    once = tmp_path / "once.html"
    once.write_text(budget_page())
    page.write(once, reports(12.0))
    assert path.read_text() == once.read_text()


def test_an_older_budget_page_without_the_generator_is_known_by_its_charts(tmp_path):
    path = tmp_path / "budget.html"
    path.write_text(budget_page().replace(f'<meta name="generator" content="{GENERATOR}">\n', ""))
    assert GENERATOR not in path.read_text()
    assert page.write(path, reports()) is True and '<svg id="heatmap"' in path.read_text()


@pytest.mark.parametrize("before", [None, "<!DOCTYPE html><html><body><p>someone else's page</p></body></html>", b"\xff\xfe"])
def test_otherwise_the_table_is_a_page_of_its_own(tmp_path, before):
    path = tmp_path / "eval.html"
    if isinstance(before, str):
        path.write_text(before)
    elif before is not None:
        path.write_bytes(before)
    assert page.write(path, reports()) is False
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>") and f'content="{page.GENERATOR}"' in text and "someone" not in text
    assert len(sections(text)) == 1 and "<svg" not in text
    page.write(path, reports(12.0))  # again: still one table, the new one
    assert len(sections(path.read_text())) == 1 and "+20.00%" in path.read_text()


def test_every_string_is_escaped_and_nothing_is_fetched(tmp_path):
    path = tmp_path / "budget.html"
    path.write_text(budget_page())
    hostile = reports(label='<script src="http://x/a.js"></script>', note="</section><img src=x onerror=alert(1)>")
    hostile[1].recipe = "<b>r</b>"
    for _ in range(2):  # the hostile note's </section> does not end the section: it is replaced whole
        page.write(path, hostile, data="a&b.txt")
    text = path.read_text()
    tags = set(re.findall(r"<(\w+)", page.section(hostile)))
    assert tags == {"section", "h2", "p", "table", "tr", "th", "td", "br", "small", "ul", "li"}, tags
    assert "<script" not in text and "<img" not in text and "<b>" not in text and not re.search(r"<[^>]*(src|href)=", text)
    assert "&lt;script src=&quot;http://x/a.js&quot;&gt;" in text and "&lt;b&gt;r&lt;/b&gt;" in text
    assert "Perplexity on a&amp;b.txt" in text
    assert len(sections(text)) == 1 and "@import" not in text


def test_task_and_sharded_columns_are_the_terminals(tmp_path):
    rows = reports()
    for r in rows:
        r.tensor_parallel, r.weight_bytes_per_rank, r.peak_rss_per_rank = 2, [1 << 20, 2 << 20], [5 << 20, 6 << 20]
        r.kl_divergence = None
    rows[0].tasks = {"arc_easy": TaskResult("acc", 0.6234, 0.01, 500)}
    found = page.section(rows)
    assert re.findall(r"<th>(.*?)</th>", found) == ["model", "size", "perplexity", "change", "tokens/s", "weights / rank",
                                                    "peak RSS / rank", "arc_easy"]
    assert re.findall(r"<td>(.*?)</td>", found)[5:8] == ["2.0 MiB", "6.0 MiB", "62.3"]
    assert re.findall(r"<td>(.*?)</td>", found)[-1] == "n/a"  # llama.cpp's row: lm-eval scores transformers models only


def test_a_failed_write_leaves_the_page_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "budget.html"
    path.write_text(budget_page())

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        page.write(path, reports())
    assert path.read_text() == budget_page() and os.listdir(tmp_path) == ["budget.html"]
