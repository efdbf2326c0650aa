"""The eval table fits the terminal: short model names, one line per model, and a legend with the full paths."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from quantkit.evaluation.evaluate import ModelReport, PerplexityResult
from quantkit.evaluation.tasks import TaskResult
import quantkit.cli.eval as eval_cmd

LONG = "/home/someone/experiments/2025-11-qat-sweep/run-{i}/checkpoints/final-model-with-a-long-name-{i}"


def report(label: str, recipe: str | None = None, fmt: str | None = None, size: int | None = 123_456_789,
           tasks: tuple[str, ...] = ()) -> ModelReport:
    return ModelReport(path=label, label=label, recipe=recipe, format=fmt, size_bytes=size,
                       perplexity=PerplexityResult(1234.567, 7.1, 1000, 1.0, 123_456.0, 512),
                       tasks={t: TaskResult("acc", 0.6234, 0.01, 500) for t in tasks})


def render(monkeypatch, reports: list[ModelReport], width: int = 80) -> list[str]:
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    monkeypatch.setattr(eval_cmd, "out", console)
    eval_cmd.print_table(reports, reports[0].label)
    return console.file.getvalue().splitlines()


def rows(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("│")]


@pytest.mark.parametrize("tasks", [(), ("arc_easy", "hellaswag")])
def test_five_long_paths_fit_80_columns_one_line_per_model(monkeypatch, tasks):
    reports = [report(LONG.format(i=i), tasks=tasks) for i in range(4)]
    reports.append(report(LONG.format(i=0) + "+int8-dynamic-act-int4-weight", "int8-dynamic-act-int4-weight", "torchao",
                          size=None, tasks=tasks))
    lines = render(monkeypatch, reports)
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    assert [row.split()[1] for row in rows(lines)] == ["M1", "M2", "M3", "M4", "M5"]
    header = next(line for line in lines if "model" in line and "perplexity" in line)
    assert all(task in header for task in tasks)
    start = next(i for i, line in enumerate(lines) if line.startswith("M1 "))
    legend = "".join(line.strip() for line in lines[start:]).replace(" ", "")  # paths fold over several lines
    assert all(f"M{i}{r.label}" in legend for i, r in enumerate(reports, 1))
    assert "(int8-dynamic-act-int4-weight/torchao)" in legend


def test_directory_names_when_they_are_distinct_and_fit(monkeypatch):
    reports = [report("runs/plain/final"), report("runs/qat-int4", "int4-weight-only", "compressed-tensors"),
               report("Qwen/Qwen3-0.6B")]
    lines = render(monkeypatch, reports)
    assert [row.split()[1] for row in rows(lines)] == ["plain", "qat-int4", "Qwen3-0.6B"]  # a run's final: the run's name
    assert any(line.split() == ["qat-int4", "runs/qat-int4", "(int4-weight-only", "/", "compressed-tensors)"] for line in lines)


def test_names_that_collide_are_numbered(monkeypatch):
    lines = render(monkeypatch, [report("a/model"), report("b/model")])
    assert [row.split()[1] for row in rows(lines)] == ["M1", "M2"]
    assert [line.split() for line in lines if line.startswith("M")] == [["M1", "a/model"], ["M2", "b/model"]]


def test_no_legend_when_the_names_are_the_models_as_given(monkeypatch):
    lines = render(monkeypatch, [report("base"), report("other")])
    assert [row.split()[1] for row in rows(lines)] == ["base", "other"]
    assert not [line for line in lines if line.startswith(("base ", "other "))]


def test_a_preview_keeps_its_recipe_in_its_name():
    preview = report("runs/base+int4-weight-only", "int4-weight-only", "compressed-tensors", size=None)
    assert eval_cmd.short_name(preview) == "base+int4-weight-only"
    assert eval_cmd.short_name(report("./base/")) == "base" and eval_cmd.short_name(report(".")) == "."


def test_data_shorter_than_one_window_says_how_many_tokens_were_scored(monkeypatch):
    tiny = report("tiny")
    tiny.perplexity = PerplexityResult(1078.2, 6.98, 1, 0.01, 200.0, 64)  # 2 tokens of data: 1 scored
    lines = render(monkeypatch, [tiny])
    assert [row.split("│")[3].strip() for row in rows(lines)] == ["1078.200*"]
    note = " ".join(" ".join(line.split()) for line in lines if not line.startswith(("│", "┏", "┃", "┡", "└")))
    assert ("* tiny: scored on 1 token only, as the data is shorter than one 64-token window: a perplexity of so few "
            "tokens says little; pass more text") in note


def test_a_full_window_needs_no_note(monkeypatch):
    full = report("full")
    full.perplexity = PerplexityResult(30.0, 3.4, 63, 0.01, 200.0, 64)  # --max-samples 1: one full window
    lines = render(monkeypatch, [full])
    assert [row.split("│")[3].strip() for row in rows(lines)] == ["30.000"]
    assert not [line for line in lines if line.startswith("*")]


def test_kl_divergence_columns_name_the_reference_beside_the_others_or_under_them(monkeypatch):
    from quantkit.evaluation.divergence import DivergenceResult

    reports = [report("base"), report("base-int4", "int4-weight-only", "compressed-tensors"), report("base-int8")]
    reports[1].kl_divergence = DivergenceResult("base", 0.01234567, 0.0098766, 0.123456, 0.87654, 1.0234567, 1000)
    reports[2].kl_divergence = DivergenceResult("base", 0.0, 0.0, 0.0, 1.0, 1.0, 1000)
    wide = render(monkeypatch, reports, width=200)
    header = next(line for line in wide if "model" in line and "perplexity" in line)
    assert [c.strip() for c in header.split("┃")[6:11]] == ["KLD mean", "KLD median", "KLD p99", "top-1", "ppl ratio"]
    assert [[c.strip() for c in row.split("│")[6:11]] for row in rows(wide)] == [
        ["reference", "", "", "", ""],
        ["0.01235", "0.009877", "0.1235", "87.65%", "1.0235"],
        ["0", "0", "0", "100.00%", "1.0000"],
    ]
    assert "KL divergence (nats per token), top-1 agreement and perplexity ratio are relative to base" in " ".join(
        " ".join(line.split()) for line in wide)
    narrow = render(monkeypatch, reports)  # too narrow for them beside the others: a table of their own, under it
    assert max(map(len, narrow)) <= 80
    results, divergence = rows(narrow)[:3], rows(narrow)[3:]
    assert [row.split()[1] for row in results] == ["base", "base-int4", "base-int8"] and "reference" not in results[0]
    assert any(line.strip() == "KL divergence" for line in narrow)
    assert [[c.strip() for c in row.split("│")[1:7]] for row in divergence] == [
        ["base", "reference", "", "", "", ""],
        ["base-int4", "0.01235", "0.009877", "0.1235", "87.65%", "1.0235"],
        ["base-int8", "0", "0", "0", "100.00%", "1.0000"],
    ]


def test_no_kl_divergence_columns_unless_measured(monkeypatch):
    header = next(line for line in render(monkeypatch, [report("a"), report("b")], width=200) if "model" in line)
    assert "KLD" not in header and "top-1" not in header
