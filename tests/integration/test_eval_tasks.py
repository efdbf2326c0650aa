"""`quantkit eval --tasks` through the real CLI: lm-eval task scores beside perplexity for a float model, its
written int4 artifact and an in-memory preview, on a local task; task errors as one line."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("lm_eval", reason="the `tasks` extra: pip install 'quantkit-llm[tasks]'")

QUANTKIT = [sys.executable, "-m", "quantkit.cli.main"]


def run(*args, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "COLUMNS": "80", **(env or {})}
    full_env.pop("QUANTKIT_DEBUG", None)
    return subprocess.run([*QUANTKIT, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=full_env)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A multiple-choice task over 30 local JSONL rows (lm-eval's YAML format, dataset_path: json)."""
    folder = tmp_path_factory.mktemp("tasks")
    rng = random.Random(0)
    words = "river stone light night king queen castle garden winter summer ship sea".split()
    rows = [{"question": f"The {rng.choice(words)} saw the", "choices": rng.sample(words, 4), "answer": rng.randrange(4)}
            for _ in range(30)]
    (folder / "choice.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "choice.yaml").write_text(
        f"task: quantkit_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'choice.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    return folder


def test_task_scores_beside_perplexity_for_artifacts_and_previews(tiny_model_dir, text_file, task_dir, tmp_path):
    artifact = tmp_path / "a-rather-long-directory-name-for-the-int4-artifact"
    assert run("finalize", tiny_model_dir, artifact, "-q", "int4-weight-only", "--quiet").returncode == 0
    report = tmp_path / "r.json"
    done = run("eval", tiny_model_dir, artifact, "--data", text_file, "--seq-len", "64", "-q", "int8-weight-only",
               "--tasks", "quantkit_choice", "--tasks-dir", task_dir, "--limit", "12",
               "--baseline", tiny_model_dir, "--max-acc-drop", "100", "--json", report)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # lm-eval's logging, warnings and progress bars are silenced
    lines = done.stdout.splitlines()
    assert lines[0].strip() == "quantkit eval" and max(map(len, lines)) <= 80, done.stdout
    assert "quantkit_choice" in done.stdout and "M3  " in done.stdout
    document = json.loads(report.read_text())
    assert [r["recipe"] for r in document["results"]] == [None, "int8-weight-only", "int4-weight-only"]
    for result in document["results"]:
        score = result["tasks"]["quantkit_choice"]
        assert (score["metric"], score["samples"]) == ("acc", 12) and 0 <= score["value"] <= 1
    assert document["gate"]["max_acc_drop_points"] == 100 and document["gate"]["passed"] is True


@pytest.mark.parametrize("args, env, words", [
    (["--tasks", "arc_easy", "--limit", "5"], {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
     ["task 'arc_easy'", "'allenai/ai2_arc'", "not in the local Hugging Face datasets cache"]),
    (["--tasks", "arc_easyy"], {}, ["unknown task 'arc_easyy'; did you mean arc_easy", "--tasks-dir"]),
])
def test_task_errors_are_one_line(tiny_model_dir, text_file, tmp_path, args, env, words):
    done = run("eval", tiny_model_dir, "--data", text_file, *args, env={"HF_HOME": str(tmp_path / "hf"), **env})
    assert done.returncode == 2, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith("error:") and all(word in line for word in words), line
