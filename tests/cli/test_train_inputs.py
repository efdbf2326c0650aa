"""`quantkit train`: config mistakes are one line and exit 2 before anything runs; what a resumed run takes from
its checkpoint is said in one line; the closing line is honest about what was trained."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import quantkit.training.loop
from quantkit.cli.main import app
from quantkit.cli.train import summary

runner = CliRunner()


@pytest.fixture
def fake_train(monkeypatch):
    """The loop, patched: it says one resume note and returns a resumed run's result."""
    calls = []

    def fake(config, **kwargs):
        calls.append(SimpleNamespace(config=config, **kwargs))
        kwargs["note"]("resuming QAT with --qat-recipe int4-weight-only, as the checkpoint c was trained")
        return SimpleNamespace(steps=20, start_step=10, seconds=1.0, final_loss=2.0, eval_perplexity=None,
                               tokens_per_second=100.0, final_dir=Path("o/final"), output_dir=Path("o"),
                               qat_recipe="int4-weight-only")

    monkeypatch.setattr(quantkit.training.loop, "train", fake)
    return calls


def one_line_usage_error(result, says: str) -> None:
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], result.output


@pytest.mark.parametrize("text, says", [
    ("", "is empty; a training config needs at least model:"),
    ("model: {path: m}\n", "the config has no 'data' section"),
    ("data: {train: t.txt}\n", "the config has no 'model' section"),
    ("model: {config: {model_type: llama, hidden_sizee: 64}, tokenizer: t}\ndata: {train: t.txt}\n",
     "unknown key 'model.config.hidden_sizee' for model_type llama; did you mean 'hidden_size'?"),
    ("model: {config: {model_type: llamaX}, tokenizer: t}\ndata: {train: t.txt}\n", "unknown model_type llamaX; did you mean llama"),
    ("model: {config: {model_type: llama, hidden_size: 64, num_attention_heads: 5}, tokenizer: t}\ndata: {train: t.txt}\n",
     "model.config: The hidden size (64) is not a multiple of the number of attention heads (5)."),
    ("model: {path: m}\ndata: {train: t.txt, seq_len: 1}\n", "data.seq_len: must be >= 2"),
])
def test_config_mistakes_are_one_line_usage_errors(fake_train, tmp_path, text, says):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    one_line_usage_error(runner.invoke(app, ["train", str(path)]), says)
    assert not fake_train


def test_a_directory_is_not_a_config(fake_train, tmp_path):
    one_line_usage_error(runner.invoke(app, ["train", str(tmp_path)]), "is a directory; pass the training config, a YAML file")


def test_the_resume_note_is_printed_and_the_json_has_the_resumed_recipe(fake_train, tmp_path, monkeypatch):
    from quantkit.models import sources

    monkeypatch.setattr(sources, "resolve_source", lambda src, revision=None: Path(src))
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: m}\ndata: {train: t.txt}\ntrain: {global_batch_size: 8}\n")
    result = runner.invoke(app, ["train", str(path), "--resume", "latest", "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "resuming QAT with --qat-recipe int4-weight-only" in result.output
    assert "trained 10 steps (steps 11-20, resumed at step 10)" in result.output
    import json

    document = json.loads((tmp_path / "r.json").read_text())
    assert (document["qat_recipe"], document["start_step"], document["steps"]) == ("int4-weight-only", 10, 20)
    quiet = runner.invoke(app, ["train", str(path), "--resume", "latest", "--quiet"])
    assert quiet.exit_code == 0 and quiet.output == ""


def test_nothing_trained_is_said_without_nan_or_throughput():
    result = SimpleNamespace(steps=20, start_step=20, seconds=0.5, final_loss=None, eval_perplexity=12.5,
                             tokens_per_second=None, final_dir=Path("o/final"), output_dir=Path("o"))
    line = summary(result)
    assert line.startswith("nothing to train: the checkpoint is at step 20, which is max_steps; its weights are the "
                           "final model (eval perplexity 12.500)")
    assert "nan" not in line and "tok" not in line
    fresh = summary(SimpleNamespace(**{**vars(result), "start_step": 0, "final_loss": 2.0, "tokens_per_second": 9.0}))
    assert fresh.startswith("trained 20 steps in 0.5 s (final loss 2.0000, eval perplexity 12.500)")
