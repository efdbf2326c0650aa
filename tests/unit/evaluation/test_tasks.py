"""quantkit.evaluation.tasks: lm-eval task scores against accuracy computed by hand, and the errors for bad task input.

Every task here is local: a few dozen JSONL rows written by the test and an lm-eval YAML over them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="the `tasks` extra: pip install 'quantkit-llm[tasks]'")

from quantkit.errors import DataError, UsageError  # noqa: E402
from quantkit.evaluation.evaluate import ModelReport, PerplexityResult, gate, load_eval_model  # noqa: E402
from quantkit.evaluation.tasks import TaskOptions, TaskResult, load_tasks, parse_names  # noqa: E402

TASK = "quantkit_choice"
WORDS = "river stone light night morning king queen castle garden winter summer ship sea wind song bread".split()


def choice_rows(n: int = 16, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"question": f"The {rng.choice(WORDS)} and the {rng.choice(WORDS)} saw the",
             "choices": rng.sample(WORDS, 4), "answer": rng.randrange(4)} for _ in range(n)]


def write_task(folder: Path, rows: list[dict], name: str = TASK, extra: str = "") -> Path:
    """An lm-eval multiple-choice task over a local JSONL file (dataset_path: json), in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n" + extra
    )
    return folder


def log_likelihoods(model, tokenizer, row: dict) -> list[float]:
    """Each choice's summed log-probability after the question, as lm-eval scores a multiple-choice document:
    the continuation is " CHOICE", its tokens are those of question + continuation after the question's."""
    scores = []
    for choice in row["choices"]:
        context = tokenizer.encode(row["question"])
        whole = tokenizer.encode(row["question"] + " " + choice)
        target = whole[len(context):]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([whole[:-1]])).logits[0, -len(target):].float()
        scores.append(logits.log_softmax(-1).gather(-1, torch.tensor(target)[:, None]).sum().item())
    return scores


def hand_accuracy(model, tokenizer, rows: list[dict]) -> float:
    hits = [max(range(4), key=lambda i: lls[i]) == row["answer"]
            for row in rows for lls in [log_likelihoods(model, tokenizer, row)]]
    return sum(hits) / len(hits)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Forwards of a tiny model are fastest on one thread (several hundred of them here, on a shared box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load_eval_model(tiny_model_dir)


def test_task_names_are_split_trimmed_and_deduplicated():
    assert parse_names(" arc_easy, hellaswag,,arc_easy ") == ("arc_easy", "hellaswag")
    with pytest.raises(UsageError, match="--tasks names no task"):
        TaskOptions(parse_names(" , "))


def test_the_score_is_the_accuracy_computed_by_hand_on_the_first_limit_documents(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    rows = choice_rows(24)
    suite = load_tasks(TaskOptions((TASK,), (write_task(tmp_path, rows),), limit=16))
    (result,) = suite.run(model, tokenizer).values()
    assert (result.metric, result.samples) == ("acc", 16)
    assert result.value == hand_accuracy(model, tokenizer, rows[:16])
    assert {"acc,none", "acc_norm,none", "acc_stderr,none"} <= set(result.metrics) and result.stderr > 0


def test_a_model_that_picks_the_answers_scores_100_and_another_drops_below_it(model_and_tokenizer, tmp_path):
    """Answers set to the tiny model's own choices: it scores 1.0; a model with other weights does not, and the
    gate says by how many points."""
    model, tokenizer = model_and_tokenizer
    rows = choice_rows(seed=1)
    for row in rows:
        lls = log_likelihoods(model, tokenizer, row)
        row["answer"] = max(range(4), key=lambda i: lls[i])
    suite = load_tasks(TaskOptions((TASK,), (write_task(tmp_path, rows),)))
    torch.manual_seed(1)
    other = type(model)(model.config).eval()
    scores = {"base": suite.run(model, tokenizer), "other": suite.run(other, tokenizer)}
    assert scores["base"][TASK].value == 1.0
    assert scores["other"][TASK].value < 1.0
    reports = [ModelReport(label, label, None, None, 1, PerplexityResult(10.0, 1.0, 1, 1.0, 1.0), tasks)
               for label, tasks in scores.items()]
    drop = 100 * (1.0 - scores["other"][TASK].value)
    (failure,) = gate(reports, "base", max_acc_drop=drop - 0.01)
    assert failure.startswith(f"other: {TASK} acc ") and f"{drop:.2f} points below base" in failure
    assert gate(reports, "base", max_acc_drop=drop) == []


def test_a_tag_gives_a_column_per_task_and_an_aggregating_group_one(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    for name, seed in (("qk_a", 1), ("qk_b", 2)):
        write_task(tmp_path, choice_rows(8, seed), name=name, extra="tag: qk_tag\n")
    (tmp_path / "group.yaml").write_text("group: qk_group\ntask: [qk_a, qk_b]\n"
                                        "aggregate_metric_list:\n  - metric: acc\n    weight_by_size: true\n")
    tagged = load_tasks(TaskOptions(("qk_tag",), (tmp_path,))).run(model, tokenizer)
    grouped = load_tasks(TaskOptions(("qk_group",), (tmp_path,))).run(model, tokenizer)
    assert list(tagged) == ["qk_a", "qk_b"] and list(grouped) == ["qk_group"]
    assert grouped["qk_group"].samples == 16
    assert grouped["qk_group"].value == pytest.approx((tagged["qk_a"].value + tagged["qk_b"].value) / 2, abs=1e-12)


def test_a_score_drop_exactly_at_the_limit_passes():
    def report(label: str, value: float) -> ModelReport:
        return ModelReport(label, label, None, None, 1, PerplexityResult(10.0, 1.0, 1, 1.0, 1.0),
                           {"t": TaskResult("acc", value, None, 40)})

    reports = [report("a", 25 / 40), report("b", 24 / 40)]  # 62.5 - 60.0 in floats is 2.5000000000000027
    assert gate(reports, "a", max_acc_drop=2.5) == []
    assert len(gate(reports, "a", max_acc_drop=2.4)) == 1
    assert len(gate([report("a", 0.5), report("b", float("nan"))], "a", max_acc_drop=100)) == 1


def test_a_missing_data_file_names_the_task_and_the_file(tmp_path):
    folder = write_task(tmp_path / "tasks", choice_rows())
    (folder / f"{TASK}.jsonl").unlink()
    with pytest.raises(DataError, match=rf"task '{TASK}' could not load the dataset 'json' with data_files .*{TASK}\.jsonl"):
        load_tasks(TaskOptions((TASK,), (folder,)))


def test_python_helpers_in_a_task_folder_need_trust_remote_code(tmp_path):
    marker = tmp_path / "IMPORTED"
    folder = write_task(tmp_path / "tasks", choice_rows(), extra="process_docs: !function helpers.process\n")
    (folder / "helpers.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef process(docs):\n    return docs\n")
    with pytest.raises(UsageError, match="uses `!function`.*--trust-remote-code"):
        load_tasks(TaskOptions((TASK,), (folder,)))
    assert not marker.exists()
    load_tasks(TaskOptions((TASK,), (folder,), trust_remote_code=True))
    assert marker.exists()


def test_tasks_dir_must_be_a_directory(tmp_path):
    with pytest.raises(UsageError, match="is not a directory"):
        load_tasks(TaskOptions((TASK,), (tmp_path / "nope",)))
