"""`quantkit eval` with .gguf files: checked before anything loads, one line and exit 2 when a path is wrong or
llama-cpp-python is missing, and the table's GGUF rows (n/a where llama.cpp cannot give a number, a note where the
tokens differ). The library is patched; tests/integration/test_eval_gguf.py runs llama.cpp itself."""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import pytest
from rich.console import Console
from typer.testing import CliRunner

from quantkit.cli.main import app
from quantkit.evaluation.evaluate import ModelReport, PerplexityResult
from quantkit.evaluation.gguf import MAGIC
from quantkit.evaluation.tasks import TaskResult
import quantkit.cli.eval as eval_cmd
import quantkit.evaluation.evaluate

runner = CliRunner()


def report(label: str, ppl: float, runtime: str = "transformers", digest: str = "d1", note: str | None = None,
           tasks: dict | None = None) -> ModelReport:
    return ModelReport(label, label, None, "gguf Q8_0" if runtime != "transformers" else None, 1000,
                       PerplexityResult(ppl, 2.3, 100, 1.0, 500.0, 64, digest), tasks=tasks or {}, runtime=runtime,
                       tokens_note=note)


@pytest.fixture
def llama_cpp(monkeypatch):
    fake = type(sys)("llama_cpp")
    fake.llama_supports_gpu_offload = lambda: False
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    return fake


@pytest.fixture
def fake_compare(monkeypatch, tiny_model_dir):
    calls = []

    def fake(models, data, **kwargs):
        calls.append(SimpleNamespace(models=models, data=data, **kwargs))
        return [report(m, 10.0) if i == 0 else report(m, 10.8, "llama.cpp (llama-cpp-python 0.3)") for i, m in enumerate(models)]

    monkeypatch.setattr(quantkit.evaluation.evaluate, "compare", fake)
    return calls


@pytest.fixture
def model_gguf(tmp_path) -> str:
    path = tmp_path / "model-Q8_0.gguf"
    path.write_bytes(MAGIC + bytes(60))
    return str(path)


def one_line(result) -> str:
    (line,) = result.output.strip().splitlines()
    return line


def test_without_llama_cpp_python_one_line_names_the_extra(monkeypatch, fake_compare, tiny_model_dir, model_gguf):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` fails as if it were not installed
    result = runner.invoke(app, ["eval", str(tiny_model_dir), model_gguf, "--data", "t.txt"])
    assert result.exit_code == 2 and not fake_compare
    line = one_line(result)
    assert line.startswith("error: evaluating a .gguf file needs llama-cpp-python") and "pip install 'quantkit-llm[gguf]'" in line


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text("{}"), "is not a GGUF file"),
    (lambda p: p.mkdir(), "is a directory"),
])
def test_a_bad_gguf_path_is_one_line_and_exit_2(llama_cpp, fake_compare, tiny_model_dir, tmp_path, make, message):
    path = tmp_path / "m.gguf"
    make(path)
    result = runner.invoke(app, ["eval", str(tiny_model_dir), str(path), "--data", "t.txt"])
    assert result.exit_code == 2 and not fake_compare
    assert message in one_line(result)


@pytest.mark.parametrize("args, message", [
    (["--tp", "2"], "evaluate it without --tp"),
    (["--tasks", "arc_easy", "--baseline", "B", "--max-acc-drop", "1"], "gate it with --max-ppl-increase"),
])
def test_options_a_gguf_cannot_take_are_refused(llama_cpp, fake_compare, tiny_model_dir, model_gguf, args, message):
    args = [a.replace("B", str(tiny_model_dir)) for a in args]
    result = runner.invoke(app, ["eval", str(tiny_model_dir), model_gguf, "--data", "t.txt", *args])
    assert result.exit_code == 2 and message in one_line(result) and not fake_compare


def test_a_gguf_goes_to_compare_and_the_gate_works_on_it(llama_cpp, fake_compare, tiny_model_dir, model_gguf):
    result = runner.invoke(app, ["eval", str(tiny_model_dir), model_gguf, "--data", "t.txt"])
    assert result.exit_code == 0, result.output
    assert fake_compare[0].models == [str(tiny_model_dir), model_gguf]
    gated = runner.invoke(app, ["eval", str(tiny_model_dir), model_gguf, "--data", "t.txt",
                                "--baseline", str(tiny_model_dir), "--max-ppl-increase", "5"])
    assert gated.exit_code == 3 and "model-Q8_0.gguf: perplexity 10.8 is +8.00% over" in gated.output
    as_baseline = runner.invoke(app, ["eval", model_gguf, str(tiny_model_dir), "--data", "t.txt",
                                      "--baseline", model_gguf, "--max-ppl-increase", "10"])
    assert as_baseline.exit_code == 0, as_baseline.output
    assert fake_compare[-1].models == [model_gguf, str(tiny_model_dir)]


def render(monkeypatch, reports: list[ModelReport], width: int = 120) -> list[str]:
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    monkeypatch.setattr(eval_cmd, "out", console)
    eval_cmd.print_table(reports, reports[0].label)
    return console.file.getvalue().splitlines()


def test_gguf_rows_say_where_they_ran_and_n_a_for_task_scores(monkeypatch):
    scores = {"arc_easy": TaskResult("acc", 0.6, 0.01, 100)}
    lines = render(monkeypatch, [report("base", 10.0, tasks=scores), report("base-Q8_0.gguf", 10.1, "llama.cpp (llama-cpp-python 0.3.36)")])
    row = next(line for line in lines if line.startswith("│ base-Q8_0.gguf"))
    assert [cell.strip() for cell in row.split("│")[3:7]] == ["10.100", "+1.00%", "500", "n/a"], row
    caption = " ".join(" ".join(lines).split())
    assert ".gguf files run in llama.cpp (llama-cpp-python 0.3.36), without task scores (n/a)" in caption
    assert not [line for line in lines if line.startswith("*")]


def test_rows_on_other_tokens_are_marked_and_their_change_is_n_a(monkeypatch):
    note = "tokenized by llama.cpp (90 tokens, base: 100): its vocabulary does not read base's ids back as the text"
    lines = render(monkeypatch, [report("base", 10.0), report("other.gguf", 9.0, "llama.cpp", "d2", note),
                                 report("same.gguf", 10.2, "llama.cpp", note="llama.cpp's own tokenizer splits the text differently")])
    other = next(line for line in lines if line.startswith("│ other.gguf"))
    assert "9.000*" in other and " n/a " in other
    assert "10.200*" in next(line for line in lines if line.startswith("│ same.gguf"))
    notes = " ".join(line.strip() for line in lines if not line.startswith(("│", "┃", "┏", "┡", "└")))
    assert f"* other.gguf: {note}; its perplexity does not compare with base's" in notes
    assert "* same.gguf: llama.cpp's own tokenizer splits the text differently" in notes
