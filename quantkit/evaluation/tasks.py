"""Accuracy on lm-evaluation-harness tasks, beside perplexity (the optional `tasks` extra).

`load_tasks` resolves the task names (close matches for a mistyped one) and loads every task's data once,
before any model: a task whose dataset is not available offline is one error naming the task and the dataset.
`TaskSuite.run` then scores one already-loaded model through lm-eval's Hugging Face adapter, so quantized
artifacts and in-memory previews are measured exactly as `eval` loads them.
"""

from __future__ import annotations

import difflib
import math
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from quantkit.errors import DataError, HardwareError, UsageError
from quantkit.runtime.progress import QUIET, Progress

INSTALL_HINT = "pip install 'quantkit-llm[tasks]'"
FEWSHOT_SEED = 1234  # lm-eval's default, so scores match `lm-eval run` on the same model
_LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")  # `datasets` builders that read data_files


@dataclass(frozen=True)
class TaskOptions:
    """What `eval --tasks` asks for: task, group or tag names; extra task directories; documents per task."""

    names: tuple[str, ...]
    dirs: tuple[Path, ...] = ()
    limit: int | None = None
    trust_remote_code: bool = False

    def __post_init__(self):
        if not self.names:
            raise UsageError("--tasks names no task; pass e.g. --tasks arc_easy,hellaswag")
        if self.limit is not None and self.limit < 1:
            raise UsageError(f"--limit must be at least 1 (got {self.limit})")


@dataclass
class TaskResult:
    metric: str  # the headline metric: acc when the task reports it, else its first metric
    value: float  # a fraction, 0..1
    stderr: float | None
    samples: int | None  # documents scored (after --limit)
    metrics: dict[str, float] = field(default_factory=dict)  # everything lm-eval reported, under its own keys


def parse_names(text: str) -> tuple[str, ...]:
    """`arc_easy, hellaswag,,arc_easy` -> ("arc_easy", "hellaswag")."""
    return tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
        import lm_eval.models.huggingface  # noqa: F401  (needs the `hf` extra: accelerate, peft)
    except ImportError as exc:
        raise HardwareError(f"--tasks needs lm-evaluation-harness ({exc.name or exc} is missing): {INSTALL_HINT}") from exc


@dataclass
class TaskSuite:
    """Loaded tasks, scored on one model at a time. `names` are the columns: each requested task or group
    (a group that aggregates its tasks' scores), and the tasks of each requested tag or non-aggregating group."""

    names: list[str]
    loaded: dict[str, Any]  # lm-eval's TaskDict: {"tasks", "groups", "group_map"}
    limit: int | None = None

    def run(self, model, tokenizer, batch_size: int = 1, progress: Progress = QUIET) -> dict[str, TaskResult]:
        from lm_eval.evaluator import evaluate
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        with progress.task(f"Tasks: {', '.join(self.names)}"):
            # evaluate() rather than simple_evaluate(): the latter also shells out to git and collects the
            # environment (pip, nvidia-smi) for its report, which eval does not use.
            results = evaluate(lm=lm, task_dict=self.loaded, limit=self.limit, log_samples=False)
        return {name: _task_result(results, name) for name in self.names}


def load_tasks(options: TaskOptions) -> TaskSuite:
    """Resolve `options.names` and load their data. Raises UsageError (with close matches) for an unknown name,
    DataError naming the task and its dataset when the data cannot be loaded, HardwareError without lm-eval."""
    require_lm_eval()
    dirs = [_task_dir(d) for d in options.dirs]
    if not options.trust_remote_code:
        _refuse_python_helpers(dirs)
    manager = _task_manager(options.names, dirs)
    loaded: dict[str, Any] = {"tasks": {}, "groups": {}, "group_map": {}}
    names: list[str] = []
    for name in options.names:
        built = _load(manager, name)
        for key in loaded:
            loaded[key].update(built.get(key) or {})
        names += [n for n in _columns(name, built) if n not in names]
    for task in loaded["tasks"].values():  # simple_evaluate's defaults: zero-shot unless the task says otherwise
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    return TaskSuite(names=names, loaded=loaded, limit=options.limit)


def _task_dir(path: Path) -> Path:
    if not Path(path).is_dir():
        raise UsageError(f"--tasks-dir {path} is not a directory; pass a folder of lm-eval task YAML files")
    return Path(path).resolve()


def _refuse_python_helpers(dirs: list[Path]) -> None:
    """A task YAML's `!function` tag makes lm-eval import Python from the task directory: user files run only
    with --trust-remote-code, as for models."""
    for folder in dirs:
        for path in sorted(folder.rglob("*.y*ml")):
            if "!function" in path.read_text(errors="replace"):
                raise UsageError(f"task file {path} uses `!function` (Python that lm-eval would import from "
                                 f"{path.parent}); pass --trust-remote-code to allow it")


def _task_manager(names: Sequence[str], dirs: list[Path]):
    """lm-eval's TaskManager. Indexing its ~15,000 built-in tasks takes seconds, so when every name is in
    `dirs` only those are indexed."""
    from lm_eval.tasks import TaskManager

    if dirs:
        local = TaskManager(include_path=[str(d) for d in dirs], include_defaults=False)
        if all(name in local.task_index for name in names):
            return local
    manager = TaskManager(include_path=[str(d) for d in dirs] or None)
    unknown = [name for name in names if name not in manager.task_index]
    if unknown:
        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UsageError(f"unknown task '{unknown[0]}'{hint} (`lm-eval ls tasks` lists lm-eval's tasks; "
                         "--tasks-dir DIR adds a folder of your own)")
    return manager


def _load(manager, name: str) -> dict[str, Any]:
    """manager.load([name]); a failure (no network, a missing file, a bad config) names the task being built
    and its dataset."""
    try:
        return manager.load([name])
    except Exception as exc:  # datasets raises ConnectionError, FileNotFoundError, ValueError, its own types
        config = _failing_task_config(exc)
        task = getattr(config, "task", None) or name
        dataset = _describe_dataset(config) if config is not None else "its dataset"
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        if isinstance(exc, ConnectionError):
            raise DataError(
                f"task '{task}' needs the dataset {dataset}, which is not in the local Hugging Face datasets cache "
                f"and cannot be downloaded ({reason}); run once with network access, or use a local copy via --tasks-dir"
            ) from exc
        raise DataError(f"task '{task}' could not load the dataset {dataset}: {reason}") from exc


def _failing_task_config(exc: BaseException):
    """The config of the innermost lm-eval Task whose code raised `exc` (the task being built), if any."""
    from lm_eval.api.task import Task

    found = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Task) and getattr(candidate, "config", None) is not None:
            found = candidate.config
    return found


def _describe_dataset(config) -> str:
    path, name = getattr(config, "dataset_path", None), getattr(config, "dataset_name", None)
    if path in _LOCAL_BUILDERS:
        files = (getattr(config, "dataset_kwargs", None) or {}).get("data_files")
        return f"'{path}' with data_files {files}"
    return f"'{path}'" + (f" (config '{name}')" if name else "")


def _columns(name: str, built: dict[str, Any]) -> list[str]:
    """The result names one requested name contributes: itself for a task or an aggregating group; the tasks
    of a tag or of a group that reports no aggregate."""
    group = (built.get("groups") or {}).get(name)
    if name in built["tasks"] or (group is not None and group.aggregate_metric_list):
        return [name]
    return list(built["tasks"])


def _task_result(results: dict[str, Any], name: str) -> TaskResult:
    entry = results["results"][name]
    metrics = {key: value for key, value in entry.items()
               if "," in key and isinstance(value, (int, float)) and not isinstance(value, bool)}
    scores = [key for key in metrics if "_stderr," not in key]
    if not scores:
        raise DataError(f"task '{name}' reported no metric (lm-eval gave {sorted(entry)})")
    key = next((k for k in scores if k.split(",")[0] == "acc"), scores[0])
    metric, _, filter_name = key.partition(",")
    stderr = metrics.get(f"{metric}_stderr,{filter_name}")
    samples = entry.get("sample_len") or (results.get("n-samples", {}).get(name) or {}).get("effective")
    return TaskResult(
        metric=metric, value=float(metrics[key]),
        stderr=float(stderr) if stderr is not None and math.isfinite(stderr) else None,
        samples=samples, metrics=metrics,
    )
