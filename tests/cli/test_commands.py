"""The commands are thin adapters: each test patches the library function and checks what it was given,
and how errors become one line and an exit code."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from quantkit import errors
from quantkit.cli.main import app
from quantkit.evaluation.evaluate import ModelReport, PerplexityResult
from quantkit.evaluation.tasks import TaskOptions, TaskResult
from quantkit.quant.registry import Format, recipe_names, resolve
import quantkit.evaluation.evaluate
import quantkit.finalization.finalize

runner = CliRunner()


@pytest.fixture(autouse=True)
def sources_are_not_checked(monkeypatch):
    """The commands check SRC and DST before heavy imports (tests/unit/test_finalize.py proves it); here the library
    is patched, so the made-up paths pass through as given."""
    from quantkit.export import atomic
    from quantkit.models import sources

    monkeypatch.setattr(sources, "resolve_source", lambda src, revision=None: src)
    monkeypatch.setattr(atomic, "check_destination", lambda dst, overwrite, single_file=False: None)


def invoke(*args: str, env: dict | None = None):
    return runner.invoke(app, list(args), env=env)


@pytest.fixture
def fake_finalize(monkeypatch):
    calls = []

    def fake(src, dst, recipe, fmt, **kwargs):
        calls.append(SimpleNamespace(src=src, dst=dst, recipe=recipe, fmt=fmt, **kwargs))
        return SimpleNamespace(
            dst=Path(dst), recipe=recipe, format=fmt or recipe.format, plan=[], seconds=1.0,
            source_bytes=100, output_bytes=50, threads=2, calibration=None, coverage=None, preflight=None, peak_ram_bytes=None, loading=None, transforms=None,
        )

    monkeypatch.setattr(quantkit.finalization.finalize, "finalize", fake)
    return calls


def test_finalize_passes_the_resolved_recipe_and_options(fake_finalize):
    result = invoke("finalize", "src", "dst", "--quantize", "int4-weight-only", "--format", "torchao",
                    "--overwrite", "--threads", "3", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    (call,) = fake_finalize
    assert (str(call.src), str(call.dst), call.recipe.name, call.fmt) == ("src", "dst", "int4-weight-only", Format.TORCHAO)
    assert (call.overwrite, call.threads, call.dtype, call.trust_remote_code) == (True, 3, "bfloat16", False)
    assert "2.00x smaller" in result.output


def test_finalize_passes_calibration_options(fake_finalize):
    result = invoke("finalize", "src", "dst", "-q", "gptq-w4a16", "--calib-data", "c.txt", "--num-samples", "16",
                    "--seq-len", "64", "--device", "cuda:1")
    assert result.exit_code == 0, result.output
    options = fake_finalize[0].calibration
    assert (options.data, options.num_samples, options.seq_len, options.device) == ("c.txt", 16, 64, "cuda:1")


def test_finalize_passes_the_checkpoint_interval_and_its_help_states_the_default(fake_finalize):
    from quantkit.finalization.checks import CHECKPOINT_EVERY

    assert invoke("finalize", "src", "dst", "-q", "gptq-w4a16", "--checkpoint-every", "0", "--quiet").exit_code == 0
    assert invoke("finalize", "src", "dst", "-q", "gptq-w4a16", "--quiet").exit_code == 0
    assert [call.calibration.checkpoint_every for call in fake_finalize] == [0.0, CHECKPOINT_EVERY]
    assert f"(default {CHECKPOINT_EVERY:g})" in invoke("finalize", "--help", env={"COLUMNS": "400"}).output
    refused = invoke("finalize", "src", "dst", "-q", "gptq-w4a16", "--checkpoint-every", "-1")
    assert refused.exit_code == 2


def test_max_gpu_memory_is_parsed_and_refused_off_a_gpu(fake_finalize):
    assert invoke("finalize", "src", "dst", "-q", "gptq-w4a16", "--device", "cuda", "--max-gpu-memory", "22GiB",
                  "--quiet").exit_code == 0
    assert fake_finalize[0].calibration.max_device_bytes == 22 << 30
    for args, message in ((["--device", "cpu"], "--max-gpu-memory is the budget of a GPU: pass it with --device cuda"),
                          (["--device", "cuda:0", "--max-gpu-memory", "lots"], "--max-gpu-memory lots: not a size")):
        extra = [] if "--max-gpu-memory" in args else ["--max-gpu-memory", "22GiB"]
        refused = invoke("finalize", "src", "dst", "-q", "gptq-w4a16", *args, *extra)
        assert refused.exit_code == 2 and message in refused.output and len(refused.output.strip().splitlines()) == 1
    assert len(fake_finalize) == 1


def test_finalize_defaults_to_the_recipes_format(fake_finalize):
    assert invoke("finalize", "src", "dst", "-q", "int8-weight-only", "--quiet").exit_code == 0
    assert fake_finalize[0].fmt is None and fake_finalize[0].dtype == "auto"


def test_unknown_recipe_exits_2_with_close_matches(fake_finalize):
    result = invoke("finalize", "src", "dst", "-q", "int4-weight-onyl")
    assert result.exit_code == 2
    assert "did you mean int4-weight-only" in result.output and "quantkit recipes list" in result.output
    assert not fake_finalize


@pytest.mark.parametrize(
    "error, code",
    [
        (errors.SourceModelError("src does not exist; pass a Hugging Face model directory"), 2),
        (errors.DestinationExistsError("dst already exists; pass --overwrite"), 2),
        (errors.HardwareError("needs a CUDA GPU; use --format compressed-tensors"), 2),
        (errors.DataError("wiki.txt does not exist"), 2),
        (errors.ExportError("disk full"), 1),
        (RuntimeError("boom"), 1),
    ],
)
def test_library_errors_become_one_line_and_an_exit_code(monkeypatch, error, code):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(quantkit.finalization.finalize, "finalize", fail)
    result = invoke("finalize", "src", "dst", "-q", "int4-weight-only")
    assert result.exit_code == code
    assert "Traceback" not in result.output
    assert result.output.strip().startswith("error:") and len(result.output.strip().splitlines()) == 1


def test_debug_variable_shows_the_traceback(monkeypatch):
    def fail(*args, **kwargs):
        raise errors.SourceModelError("nope")

    monkeypatch.setattr(quantkit.finalization.finalize, "finalize", fail)
    result = invoke("finalize", "src", "dst", "-q", "int4-weight-only", env={"QUANTKIT_DEBUG": "1"})
    assert isinstance(result.exception, errors.SourceModelError)


@pytest.mark.parametrize("value", ["0", "false", ""])
def test_debug_variable_set_to_off_keeps_the_one_line_error(monkeypatch, value):
    def fail(*args, **kwargs):
        raise errors.SourceModelError("nope")

    monkeypatch.setattr(quantkit.finalization.finalize, "finalize", fail)
    result = invoke("finalize", "src", "dst", "-q", "int4-weight-only", env={"QUANTKIT_DEBUG": value})
    assert result.exit_code == 2 and result.output.strip() == "error: nope"


def test_ctrl_c_exits_130(monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(quantkit.finalization.finalize, "finalize", interrupted)
    result = invoke("finalize", "src", "dst", "-q", "int4-weight-only")
    assert result.exit_code == 130 and "nothing was written" in result.output


def _report(label: str, ppl: float) -> ModelReport:
    return ModelReport(path=label, label=label, recipe=None, format=None, size_bytes=10,
                       perplexity=PerplexityResult(ppl, 1.0, 100, 1.0, 100.0, 64))


@pytest.fixture
def fake_compare(monkeypatch):
    calls = []

    def fake(models, data, **kwargs):
        calls.append(SimpleNamespace(models=models, data=data, **kwargs))
        reports = [_report(m, 10.0 if i == 0 else 10.8) for i, m in enumerate(models)]
        names = kwargs["tasks"].names if kwargs.get("tasks") else ()
        for i, report in enumerate(reports):  # the first model scores 60%, the others 55%, on every task
            report.tasks = {name: TaskResult("acc", 0.60 if i == 0 else 0.55, 0.01, 100) for name in names}
        return reports

    monkeypatch.setattr(quantkit.evaluation.evaluate, "compare", fake)
    return calls


def test_eval_passes_models_data_and_recipes(fake_compare):
    result = invoke("eval", "a", "b", "--data", "t.txt", "-q", "int4-weight-only", "-q", "int8-weight-only",
                    "--seq-len", "64", "--stride", "32", "--batch-size", "2", "--max-samples", "5")
    assert result.exit_code == 0, result.output
    (call,) = fake_compare
    assert (call.models, call.data, call.recipes) == (["a", "b"], "t.txt", ["int4-weight-only", "int8-weight-only"])
    assert (call.seq_len, call.stride, call.batch_size, call.max_samples) == (64, 32, 2, 5)


def test_eval_runs_where_device_says_and_on_the_gpu_when_there_is_one(fake_compare, monkeypatch):
    import torch

    assert invoke("eval", "a", "--data", "t.txt").exit_code == 0
    assert fake_compare[0].device == "cpu"  # auto on this machine: no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert invoke("eval", "a", "--data", "t.txt", "--calib-data", "c.txt").exit_code == 0
    assert fake_compare[1].device == "cuda" and fake_compare[1].calibration.device == "cuda"
    assert invoke("eval", "a", "--data", "t.txt", "--device", "cpu").exit_code == 0 and fake_compare[2].device == "cpu"
    result = invoke("eval", "a", "--data", "t.txt", "--device", "cuda:3")
    assert result.exit_code == 2 and "this machine has 1 CUDA GPU(s)" in result.output and len(fake_compare) == 3


def test_more_ranks_than_gpus_is_refused_before_launching(monkeypatch, tmp_path, tiny_model_dir):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    launched = []
    monkeypatch.setattr("quantkit.cli.launch.run_torchrun", lambda *a, **k: launched.append(a) or 0)
    result = invoke("finalize", str(tiny_model_dir), str(tmp_path / "out"), "-q", "gptq-w4a16", "--calib-data", "c.txt",
                    "--device", "cuda", "--nproc-per-node", "2")
    assert result.exit_code == 2 and not launched
    assert "--nproc-per-node 2 needs 2 GPUs (one per rank) and this machine has 1" in result.output


def test_gate_exits_3_and_writes_json(fake_compare, tmp_path):
    out = tmp_path / "r.json"
    result = invoke("eval", "a", "b", "--data", "t.txt", "--baseline", "a", "--max-ppl-increase", "5", "--json", str(out))
    assert result.exit_code == 3
    assert "b: perplexity" in result.output
    gate = json.loads(out.read_text())["gate"]
    assert gate["passed"] is False and gate["baseline"] == "a"


def test_gate_passes_within_budget(fake_compare):
    assert invoke("eval", "a", "b", "--data", "t.txt", "--baseline", "a", "--max-ppl-increase", "10").exit_code == 0


def test_gate_options_go_together(fake_compare):
    result = invoke("eval", "a", "--data", "t.txt", "--max-ppl-increase", "5")
    assert result.exit_code == 2 and "--baseline" in result.output
    assert not fake_compare


def test_eval_passes_task_options(fake_compare, tmp_path):
    result = invoke("eval", "a", "--data", "t.txt", "--tasks", "arc_easy, hellaswag", "--tasks-dir", str(tmp_path),
                    "--limit", "5", "--trust-remote-code")
    assert result.exit_code == 0, result.output
    assert fake_compare[0].tasks == TaskOptions(("arc_easy", "hellaswag"), (tmp_path,), 5, trust_remote_code=True)
    assert invoke("eval", "a", "--data", "t.txt").exit_code == 0 and fake_compare[1].tasks is None


def test_score_gate_exits_3_and_writes_json(fake_compare, tmp_path):
    out = tmp_path / "r.json"
    result = invoke("eval", "a", "b", "--data", "t.txt", "--tasks", "arc_easy", "--baseline", "a", "--max-acc-drop", "4",
                    "--json", str(out))
    assert result.exit_code == 3
    assert "b: arc_easy acc 55.00 is 5.00 points below a (60.00); the limit is 4 points" in result.output
    document = json.loads(out.read_text())
    assert document["gate"] == {"baseline": "a", "max_ppl_increase_pct": None, "max_acc_drop_points": 4.0, "max_kld": None,
                                "passed": False,
                                "failures": [document["gate"]["failures"][0]]}
    assert document["results"][1]["tasks"] == {"arc_easy": {"metric": "acc", "value": 0.55, "stderr": 0.01, "samples": 100, "metrics": {}}}
    within = invoke("eval", "a", "b", "--data", "t.txt", "--tasks", "arc_easy", "--baseline", "a", "--max-acc-drop", "5",
                    "--max-ppl-increase", "10")
    assert within.exit_code == 0, within.output


@pytest.mark.parametrize("args, message", [
    (["--tasks", "x", "--max-acc-drop", "1"], "compare against --baseline MODEL"),
    (["--baseline", "a"], "--max-ppl-increase PCT and/or --max-acc-drop POINTS"),
    (["--baseline", "a", "--max-acc-drop", "1"], "pass --tasks NAMES too"),
    (["--limit", "3"], "--tasks-dir and --limit apply to --tasks"),
    (["--tasks", " , "], "--tasks names no task"),
])
def test_task_and_gate_options_that_do_not_go_together(fake_compare, args, message):
    result = invoke("eval", "a", "--data", "t.txt", *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not fake_compare


def test_without_lm_eval_tasks_are_one_line_naming_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now fails as if it were not installed
    result = invoke("eval", "a", "--data", "t.txt", "--tasks", "arc_easy")
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: --tasks needs lm-evaluation-harness") and "pip install 'quantkit-llm[tasks]'" in line
    import subprocess

    without = "import sys; sys.modules['lm_eval'] = None; import quantkit.evaluation.evaluate, quantkit.cli.eval"
    assert subprocess.run([sys.executable, "-c", without]).returncode == 0  # eval without --tasks needs no lm-eval


def test_recipes_list_and_show():
    listed = invoke("recipes", "list")
    assert listed.exit_code == 0 and "int8-dynamic-act-int4-weight" in listed.output
    shown = invoke("recipes", "show", "int4-weight-only")
    assert shown.exit_code == 0 and "group_size: 128" in shown.output
    assert invoke("recipes", "show", "nope").exit_code == 2


def test_recipes_show_says_who_applies_an_online_rotation(tmp_path):
    path = tmp_path / "r4.yaml"
    path.write_text("scheme: {weights: {dtype: int4, granularity: group, group_size: 32}}\n"
                    "transforms: [{type: random-hadamard, rotations: [R4], online: true}]\nformat: compressed-tensors\n")
    shown = invoke("recipes", "show", str(path))
    assert shown.exit_code == 0
    assert "# R4 rotates the down projections' inputs at run time: compressed-tensors, vLLM and quantkit eval" in shown.output
    assert "plain transformers ignores it" not in invoke("recipes", "show", "quarot-nvfp4").output


def test_help_names_every_command():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("finalize", "eval", "recipes"):
        assert command in result.output


# ---------------------------------------------------------------- train

import quantkit.training.loop  # noqa: E402
from quantkit.cli import launch  # noqa: E402


@pytest.fixture
def train_yaml(tmp_path) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text("model: {path: m}\ndata: {train: t.txt}\ntrain: {micro_batch_size: 2, global_batch_size: 4}\n")
    return path


@pytest.fixture
def fake_train(monkeypatch):
    calls = []

    def fake(config, **kwargs):
        calls.append(SimpleNamespace(config=config, **kwargs))
        return SimpleNamespace(steps=3, seconds=1.0, final_loss=2.0, eval_perplexity=None, tokens_per_second=100.0,
                               final_dir=Path("o/final"), output_dir=Path("o"), start_step=0, qat_recipe=None)

    monkeypatch.setattr(quantkit.training.loop, "train", fake)
    return calls


def test_train_refuses_a_missing_model_before_launching(monkeypatch, train_yaml):
    from quantkit.errors import SourceModelError
    from quantkit.models import sources

    def missing(src, revision=None):
        raise SourceModelError(f"{src} does not exist (revision {revision})")

    launched = []
    monkeypatch.setattr(sources, "resolve_source", missing)
    monkeypatch.setattr(quantkit.training.loop, "train", lambda *a, **k: pytest.fail("train must not run"))
    monkeypatch.setattr(launch, "run_torchrun", lambda args, explained=(): launched.append(args) or 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    result = invoke("train", str(train_yaml), "--nproc-per-node", "2")
    assert result.exit_code == 2 and "model.path: m does not exist (revision None)" in result.output and not launched


def test_train_passes_the_resolved_config(fake_train, train_yaml):
    result = invoke("train", str(train_yaml), "--qat-recipe", "int4-weight-only", "--set", "train.lr=1e-4",
                    "--max-steps", "7", "--output-dir", "runs/x", "--resume", "latest")
    assert result.exit_code == 0, result.output
    (call,) = fake_train
    cfg = call.config
    assert (cfg.qat_recipe, cfg.train.lr, cfg.train.max_steps, cfg.output_dir) == ("int4-weight-only", 1e-4, 7, "runs/x")
    assert call.resume == "latest" and call.overwrite is False


def test_train_checks_recipe_and_config_before_anything(fake_train, train_yaml, tmp_path):
    assert invoke("train", str(train_yaml), "--qat-recipe", "int4-weight-onyl").exit_code == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: m}\ndata: {train: t.txt}\ntrain: {schedule: linear}\n")
    result = invoke("train", str(bad))
    assert result.exit_code == 2 and "train.schedule" in result.output
    assert not fake_train


def test_train_relaunches_itself_under_torchrun(fake_train, train_yaml, monkeypatch):
    import os

    seen = {}
    monkeypatch.setattr(launch, "run_torchrun", lambda args, explained=(): seen.update(args=args, env=dict(os.environ)) or 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "99")  # monkeypatch restores what relaunch sets
    monkeypatch.setenv("QUANTKIT_THREADS", "99")
    result = invoke("train", str(train_yaml), "--nproc-per-node", "2")
    assert result.exit_code == 0, result.output
    assert seen["args"][:4] == ["--standalone", "--nproc-per-node=2", "-m", "quantkit.cli.main"]
    assert 1 <= int(seen["env"]["OMP_NUM_THREADS"]) < 99
    assert not fake_train  # the parent only launches


def test_train_under_torchrun_does_not_relaunch(fake_train, train_yaml, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert invoke("train", str(train_yaml), "--nproc-per-node", "2").exit_code == 0
    assert len(fake_train) == 1


def _capture_torchrun(monkeypatch, code: int) -> dict:
    """Not under a launcher; torchrun's arguments land in the returned dict and its ranks exit with `code`."""
    seen = {}
    monkeypatch.setattr(launch, "run_torchrun", lambda args, explained=(): seen.update(args=args) or code)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # restored after the test
    monkeypatch.setenv("QUANTKIT_THREADS", "1")
    return seen


def test_finalize_relaunches_itself_under_torchrun(fake_finalize, monkeypatch):
    seen = _capture_torchrun(monkeypatch, 3)
    result = invoke("finalize", "src", "dst", "-q", "gptq-w4a16", "--calib-data", "c.txt", "--nproc-per-node", "2")
    assert result.exit_code == 3  # the ranks' exit code is the command's
    assert seen["args"][:2] == ["--standalone", "--nproc-per-node=2"] and not fake_finalize


def test_finalize_on_two_machines_relaunches_with_the_rendezvous(fake_finalize, monkeypatch):
    seen = _capture_torchrun(monkeypatch, 0)
    result = invoke("finalize", "src", "dst", "-q", "gptq-w4a16", "--calib-data", "c.txt", "--nnodes", "2",
                    "--node-rank", "1", "--rdzv-endpoint", "node0:29500")
    assert result.exit_code == 0, result.output
    assert seen["args"][:6] == ["--nnodes=2", "--node-rank=1", "--rdzv-endpoint=node0:29500", "--rdzv-backend=static",
                                "--rdzv-id=quantkit", "--nproc-per-node=1"] and not fake_finalize


@pytest.mark.parametrize("command", ["finalize", "train"])
@pytest.mark.parametrize("options, says", [
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:29500"], "--node-rank 2 is not one of --nnodes 2"),
])
def test_launch_mistakes_are_one_line_usage_errors(command, options, says, fake_finalize, fake_train, train_yaml, monkeypatch):
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: pytest.fail("must not launch"))
    args = ["src", "dst", "-q", "gptq-w4a16", "--calib-data", "c.txt"] if command == "finalize" else [str(train_yaml)]
    result = invoke(command, *args, *options)
    assert result.exit_code == 2 and says in result.output and len(result.output.strip().splitlines()) == 1
    assert not fake_finalize and not fake_train


def test_train_under_a_launcher_does_not_relaunch_for_several_machines(fake_train, train_yaml, monkeypatch):
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: pytest.fail("must not launch"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    result = invoke("train", str(train_yaml), "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:29500")
    assert result.exit_code == 0, result.output
    assert len(fake_train) == 1


def test_finalize_checks_and_plans_for_every_rank_of_every_machine(monkeypatch):
    from quantkit.export import atomic

    checked, planned = [], []
    monkeypatch.setattr(atomic, "check_work_dir", lambda dst, resume, ranks: checked.append(ranks))
    monkeypatch.setattr(quantkit.finalization.finalize, "finalize", lambda *a, **k: pytest.fail("the parent only launches"))
    monkeypatch.setattr(launch, "run_torchrun", lambda args, explained=(): 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("QUANTKIT_THREADS", "1")
    two = ["--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "h:29500"]
    assert invoke("finalize", "src", "dst", "-q", "gptq-w4a16", "--calib-data", "c.txt", *two).exit_code == 0
    monkeypatch.setattr(quantkit.finalization.finalize, "dry_run", lambda *args: planned.append(args[4]) or {"ranks": args[4]})
    result = invoke("finalize", "src", "dst", "-q", "gptq-w4a16", *two, "--dry-run", "--json", "-")
    assert result.exit_code == 0 and checked == [4] and planned == [4]


def test_finalize_with_one_process_runs_in_process(fake_finalize, monkeypatch):
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: pytest.fail("must not launch"))
    assert invoke("finalize", "src", "dst", "-q", "gptq-w4a16", "--calib-data", "c.txt", "--nproc-per-node", "1").exit_code == 0
    assert len(fake_finalize) == 1


def test_finalize_dry_run_prints_the_plan(monkeypatch):
    calls = []
    monkeypatch.setattr(quantkit.finalization.finalize, "dry_run", lambda *args: calls.append(args) or {"ranks": args[4]})
    result = invoke("finalize", "src", "dst", "-q", "gptq-w4a16", "--nproc-per-node", "4", "--dry-run", "--json", "-")
    assert result.exit_code == 0 and json.loads(result.output)["ranks"] == 4


def test_finalize_passes_a_hub_id_and_its_revision(fake_finalize):
    assert invoke("finalize", "org/model", "dst", "-q", "int4-weight-only", "--revision", "v2", "--quiet").exit_code == 0
    (call,) = fake_finalize
    assert str(call.src) == "org/model" and call.revision == "v2"


def _only_json(result) -> dict:
    """`--json -`: stdout is one JSON document and nothing else."""
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["schema_version"] == 1
    return document


def test_finalize_json_to_stdout(fake_finalize):
    document = _only_json(invoke("finalize", "src", "dst", "-q", "int4-weight-only", "--json", "-"))
    assert document["command"] == "finalize" and document["recipe"] == "int4-weight-only"
    assert (document["dst"], document["output_bytes"], document["modules"]["linear"]) == ("dst", 50, 0)


def test_finalize_json_to_a_file_keeps_the_table(fake_finalize, tmp_path):
    result = invoke("finalize", "src", "dst", "-q", "int4-weight-only", "--json", str(tmp_path / "f.json"))
    assert result.exit_code == 0 and "weights on disk" in result.stdout
    assert json.loads((tmp_path / "f.json").read_text())["command"] == "finalize"


def test_recipes_list_and_show_json():
    from quantkit.quant import registry
    listed = _only_json(invoke("recipes", "list", "--json", "-"))
    assert [r["name"] for r in listed["recipes"]] == registry.recipe_names()
    shown = _only_json(invoke("recipes", "show", "gptq-w4a16", "--json", "-"))
    assert shown["recipe"] == registry.resolve("gptq-w4a16").to_dict()


def test_json_to_a_file_keeps_what_recipes_and_dry_run_print(monkeypatch, tmp_path):
    """--json FILE: "Also write the result as JSON to this file"; only `--json -` leaves the output out."""
    monkeypatch.setattr(quantkit.finalization.finalize, "dry_run", lambda *args: DRY_RUN_PLAN)
    for args, printed in ((["recipes", "list"], "int8-dynamic-act-int4-weight"),
                          (["recipes", "show", "int4-weight-only"], "group_size: 128"),
                          (["finalize", "src", "dst", "-q", "int4-weight-only", "--dry-run"], "preflight (nothing loaded)")):
        target = tmp_path / "r.json"
        result = invoke(*args, "--json", str(target), env={"COLUMNS": "400"})
        assert result.exit_code == 0 and printed in result.stdout, result.output
        assert json.loads(target.read_text())["schema_version"] == 1
        target.unlink()


DRY_RUN_PLAN = {"ranks": 1, "samples_per_rank": [], "seq_len": 0, "gptq_rows_per_rank": [], "preflight": {
    "peak_ram_bytes": 10, "streamed": True, "peak_ram_breakdown": {}, "peak_device_bytes": 0, "output_bytes": 5,
    "model_bytes": 20, "work_dir_bytes": 0, "fits_on_disk": True, "free_disk_bytes": 100, "disk_needed_bytes": 5}}


def test_dry_run_quiet_prints_nothing_and_still_writes_the_json(monkeypatch, tmp_path):
    monkeypatch.setattr(quantkit.finalization.finalize, "dry_run", lambda *args: DRY_RUN_PLAN)
    result = invoke("finalize", "src", "dst", "-q", "int4-weight-only", "--dry-run", "--quiet")
    assert result.exit_code == 0 and result.output == ""
    result = invoke("finalize", "src", "dst", "-q", "int4-weight-only", "--dry-run", "--quiet", "--json", str(tmp_path / "p.json"))
    assert result.exit_code == 0 and result.output == ""
    assert json.loads((tmp_path / "p.json").read_text())["preflight"]["output_bytes"] == 5


def test_help_names_arguments_in_capitals_and_shows_flags_without_a_value():
    """As docs/commands.md writes them; typer 0.29 writes `{src} {dst}` and `--overwrite <bool>`."""
    shown = invoke("finalize", "--help", env={"COLUMNS": "400"}).output
    assert "finalize [OPTIONS] SRC DST" in shown and "<bool>" not in shown
    shown = invoke("eval", "--help", env={"COLUMNS": "400"}).output
    assert "eval [OPTIONS] MODELS..." in shown and "<bool>" not in shown
    assert "<bool>" not in invoke("--help", env={"COLUMNS": "400"}).output
    assert "recipes show [OPTIONS] NAME" in invoke("recipes", "show", "--help", env={"COLUMNS": "400"}).output


def test_train_json_to_stdout(fake_train, train_yaml):
    document = _only_json(invoke("train", str(train_yaml), "--json", "-"))
    assert (document["command"], document["steps"], document["final_dir"]) == ("train", 3, str(Path("o/final")))


def test_eval_json_to_stdout(fake_compare):
    document = _only_json(invoke("eval", "a", "b", "--data", "t.txt", "--json", "-"))
    assert document["command"] == "eval" and [r["label"] for r in document["results"]] == ["a", "b"]


@pytest.mark.parametrize("argv, message", [
    (["finalize", "a", "b", "-q", "int4-weight-only", "--num-samples", "0"], "Invalid value for '--num-samples'"),
    (["finalize", "a", "b", "-q", "int4-weight-only", "--nproc-per-node", "0"], "Invalid value for '--nproc-per-node'"),
    (["finalize", "a", "b", "-q", "int4-weight-only", "--seq-len", "0"], "Invalid value for '--seq-len'"),
    (["finalize", "--bogus"], "No such option: --bogus"),
    (["finalize", "a"], "Missing argument"),
    (["bogus"], "No such command"),
])
def test_usage_errors_are_one_line_and_exit_2(monkeypatch, capsys, argv, message):
    import sys

    from quantkit.cli.main import main

    monkeypatch.setattr(sys, "argv", ["quantkit", *argv])
    with pytest.raises(SystemExit) as exit:
        main()
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and message in err, err


def test_a_command_without_arguments_shows_its_help(monkeypatch, capsys):
    import sys

    from quantkit.cli.main import main

    monkeypatch.setattr(sys, "argv", ["quantkit", "finalize"])
    with pytest.raises(SystemExit):
        main()
    shown = "".join(capsys.readouterr())
    assert "Usage:" in shown and "--quantize" in shown and "error:" not in shown


def test_the_summary_says_how_much_was_quantized_and_what_was_not():
    from quantkit.cli.finalize import coverage_line

    line = coverage_line({"quantized_parameters": 90, "linear_parameters": 100, "all_parameters": 120, "full_precision": [
        {"tensor": "embed.weight", "parameters": 20, "reason": "an embedding"},
        {"tensor": "lm_head.weight", "parameters": 10, "reason": "ignored by recipe"},
        {"tensor": "norm.weight", "parameters": 0, "reason": "ignored by recipe"}]})
    assert line == "90.0% of Linear parameters, 75.0% of all; left in full precision: 1 x an embedding; 2 x ignored by recipe"


def test_the_summary_says_how_many_tokens_each_moe_expert_was_routed():
    from quantkit.cli.finalize import experts_line

    line = experts_line({"model.layers.0.mlp.experts": [5, 0, 9], "model.layers.1.mlp.experts": [3, 11, 0]})
    assert line == ("min 0 (model.layers.0.mlp.experts.1), max 11 (model.layers.1.mlp.experts.1) over 6 experts; "
                    "2 never routed (every expert is calibrated on every token)")


def test_the_summary_says_how_much_autoround_lowered_each_layers_loss():
    from quantkit.algorithms.methods.autoround import tuning_line

    line = tuning_line({"model.layers.0": {"loss_rtn": 4e-6, "loss_tuned": 1e-6, "best_step": 9, "steps": 10},
                         "model.layers.1": {"loss_rtn": 2e-6, "loss_tuned": 1e-6, "best_step": 7, "steps": 10}})
    assert line == ("output loss 38% of round-to-nearest's on average over 2 layers, at most 50% (model.layers.1); "
                    "per layer in quantkit.json")


@pytest.fixture
def tp_checked(monkeypatch):
    """`eval --tp`'s per-model check (tests/unit/test_tensor_parallel.py proves it), recorded instead of run."""
    from quantkit.evaluation import tensor_parallel
    checked = []
    monkeypatch.setattr(tensor_parallel, "check", lambda path, ranks, trust_remote_code: checked.append((path, ranks)))
    return checked


def test_eval_tp_checks_every_model_then_relaunches_itself_once(fake_compare, tp_checked, monkeypatch):
    seen = {}
    monkeypatch.setattr(launch, "run_torchrun", lambda args, explained=(): seen.update(args=args, explained=explained) or 3)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # restored after the test
    monkeypatch.setenv("QUANTKIT_THREADS", "1")
    argv = ["eval", "a", "b", "--data", "t.txt", "--tp", "2", "--baseline", "a", "--max-ppl-increase", "1"]
    monkeypatch.setattr(launch.sys, "argv", ["quantkit", *argv])  # what the ranks are started with
    result = invoke(*argv)
    assert result.exit_code == 3  # the ranks' exit code (here a failed gate) is the command's
    assert tp_checked == [("a", 2), ("b", 2)] and not fake_compare  # the parent only checks and launches
    assert seen["args"][:2] == ["--standalone", "--nproc-per-node=2"] and seen["args"][-len(argv):] == argv
    assert seen["explained"] == (3,)  # a failed gate is its own message: no "rank 0 failed" line after it


def test_eval_tp_under_the_launcher_measures_here_and_only_rank_0_reports(fake_compare, tp_checked, monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: pytest.fail("must not launch twice"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    report = tmp_path / "r.json"
    result = invoke("eval", "a", "--data", "t.txt", "--tp", "2", "--json", str(report))
    assert result.exit_code == 0 and result.output == "" and not report.exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    result = invoke("eval", "a", "--data", "t.txt", "--tp", "2", "--json", str(report))
    assert result.exit_code == 0 and report.exists()
    assert [call.tensor_parallel for call in fake_compare] == [2, 2]


@pytest.mark.parametrize("options, says", [
    (["-q", "int4-weight-only"], "finalize the model (`quantkit finalize SRC DST -q RECIPE`), then evaluate DST with --tp"),
    (["--tasks", "arc_easy"], "--tasks runs lm-evaluation-harness in one process; drop --tp"),
])
def test_eval_tp_refuses_what_runs_in_one_process(options, says, fake_compare, tp_checked, monkeypatch):
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: pytest.fail("must not launch"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    result = invoke("eval", "a", "--data", "t.txt", "--tp", "2", *options)
    assert result.exit_code == 2 and says in result.output and len(result.output.strip().splitlines()) == 1
    assert not fake_compare


RUN = """
import atexit, sys
atexit.register(lambda: print("interpreter finalized", file=sys.stderr))
from quantkit.cli.main import run
sys.argv = ["quantkit", *sys.argv[1:]]
run()
"""


@pytest.mark.parametrize("argv,code", [(["recipes", "show", "gptq-w4a16"], 0), (["recipes", "show", "gptq-w4a61"], 2),
                                       (["finalize", "--bogus"], 2)])
def test_the_command_ends_without_finalizing_the_interpreter_and_keeps_its_output_and_exit_code(argv, code):
    """`run` (the console script, `python -m quantkit.cli.main`) leaves through os._exit once `main` is done: no
    atexit handler runs (finalizing torch and transformers costs 1.4 s a process), everything printed arrives."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", RUN, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert "interpreter finalized" not in done.stderr
    if code == 0:
        assert "gptq-w4a16" in done.stdout and "block_size" in done.stdout  # the whole recipe, flushed
    else:
        assert done.stderr.startswith("error:")


@pytest.mark.parametrize("name", recipe_names())
def test_recipes_show_writes_a_file_that_resolves_to_the_same_recipe(name, tmp_path):
    """`quantkit recipes show NAME > mine.yaml`, then `-q mine.yaml`: the same recipe (under the file's name)."""
    shown = invoke("recipes", "show", name)
    assert shown.exit_code == 0, shown.output
    path = tmp_path / "mine.yaml"
    path.write_text(shown.output)
    mine, shipped = resolve(str(path)).to_dict(), resolve(name).to_dict()
    assert mine.pop("name") == "mine" and shipped.pop("name") == name
    mine.pop("source"), shipped.pop("source")
    assert mine == shipped


@pytest.mark.parametrize("where, message", [("missing/out.json", "does not exist; create it"),
                                            (".", "is a directory; give a file path")])
def test_json_that_cannot_be_written_is_refused_before_any_work(fake_finalize, fake_compare, fake_train, train_yaml,
                                                                 tmp_path, where, message):
    """--json FILE is checked as the command line is read: finalize wrote DST and train its run before the result
    failed to be written (a traceback, exit 1)."""
    target = str(tmp_path / where)
    for args in (["finalize", "src", "dst", "-q", "int4-weight-only"], ["eval", "a", "--data", "t.txt"],
                 ["train", str(train_yaml)], ["recipes", "list"]):
        result = invoke(*args, "--json", target, env={"COLUMNS": "400"})
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert fake_finalize == [] and fake_train == [] and fake_compare == []


def test_finalize_passes_the_text_field(fake_finalize):
    assert invoke("finalize", "src", "dst", "-q", "gptq-w4a16", "--calib-data", "c.jsonl", "--text-field", "content").exit_code == 0
    assert invoke("finalize", "src", "dst", "-q", "gptq-w4a16", "--calib-data", "c.jsonl").exit_code == 0
    assert [call.calibration.text_field for call in fake_finalize] == ["content", "text"]


def test_finalize_refuses_a_revision_of_a_local_directory(fake_finalize, tmp_path):
    result = invoke("finalize", str(tmp_path), "dst", "-q", "int4-weight-only", "--revision", "v2")
    assert result.exit_code == 2 and "--revision applies to hub ids" in result.output and not fake_finalize


def test_finalize_takes_a_gguf_suffix_in_any_case(fake_finalize):
    assert invoke("finalize", "src", "model.GGUF", "-q", "gguf-q8-0", "--quiet").exit_code == 0
    assert str(fake_finalize[0].dst) == "model.GGUF"


def test_user_text_is_printed_as_given_not_as_markup_or_emoji(fake_finalize):
    """Paths and names are the user's: `[exp]` is not a rich markup tag and `:x:` not an emoji code (a path with
    `[/red]` in it failed after the artifact was written)."""
    result = invoke("finalize", "src", "runs/[exp]/x[/red]", "-q", "int4-weight-only", env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "runs/[exp]/x[/red]" in result.output
    refused = invoke("finalize", "src", "dst", "-q", "my:x:recipe", env={"COLUMNS": "400"})
    assert refused.exit_code == 2 and "'my:x:recipe'" in refused.output and "\N{CROSS MARK}" not in refused.output
