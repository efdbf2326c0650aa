"""Shared fixtures: tiny models built from a config, text generated here (no downloads, no ../shared)."""

from __future__ import annotations

import ast
import itertools
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# A suite started in the background by a non-interactive shell inherits SIGINT ignored, and so would every process
# it starts (an ignored signal survives exec): the Ctrl-C tests need it delivered. A handler does not survive exec,
# so the processes the tests start get the default again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Under pytest-xdist (`make test` runs two workers), each worker keeps to its own share of the cores, and so does
# every process it starts (affinity is inherited): quantkit's default thread count is the cores it may use, and two
# workers each running torch on every core slow each other down (OpenMP threads spin on a busy core). A worker that
# replaces a crashed one is numbered past the count (gw2 of 2): its number modulo the count picks its share (an empty
# set of cores failed its start, and with it the rest of the run).
_WORKER, _WORKERS = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKER and hasattr(os, "sched_setaffinity"):
    _CORES = sorted(os.sched_getaffinity(0))
    if len(_CORES) >= _WORKERS:
        os.sched_setaffinity(0, _CORES[int(_WORKER.removeprefix("gw")) % _WORKERS :: _WORKERS])

_WORDS = (
    "the a quantized model weight scale group token layer small fast bit integer float value error round grid "
    "river stone light night morning king queen castle garden winter summer ship sea wind song bread house"
).split()


def make_text(n_words: int, seed: int = 0) -> str:
    """Deterministic pseudo-English: sentences of common words, with line breaks."""
    rng = random.Random(seed)
    lines, line = [], []
    for i in range(n_words):
        line.append(rng.choice(_WORDS))
        if len(line) >= rng.randint(6, 14):
            lines.append(" ".join(line).capitalize() + ".")
            line = []
    lines.append(" ".join(line))
    return "\n".join(lines)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny float32 Llama (hidden 64, MLP 176: a width 128 and 32 do not divide) with a BPE tokenizer."""
    from quantkit.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", make_text(3000))


@pytest.fixture(scope="session")
def wide_model_dir(tmp_path_factory) -> Path:
    """A tiny float32 Llama whose widths (128, 256) take FP8's 128x128 blocks and every group size."""
    from quantkit.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "wide-llama", make_text(3000), hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "eval.txt"
    path.write_text(make_text(1500, seed=1))
    return path


HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_snapshot(home: Path, repo_id: str, commit: str = HUB_COMMIT, ref: str = "main") -> Path:
    """An empty snapshot directory of `repo_id` at `commit` in the huggingface_hub cache under HF_HOME=`home`, named
    by refs/`ref`: fill it, and with HF_HUB_OFFLINE=1 the hub id resolves to it (at revision `ref` or `commit`)."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def quantkit_offline(home: Path, *args: str) -> subprocess.CompletedProcess:
    """`quantkit ARGS` in a fresh process with HF_HOME=`home`, offline."""
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "quantkit.cli.main", *args], env=env, capture_output=True, text=True)


def pytest_collection_modifyitems(config, items):
    """The GPU suite (`pytest -m gpu`, `make test-gpu`): every test under tests/gpu is marked `gpu` and skipped where
    torch sees no CUDA device, so a CPU-only run (CI) runs none of them."""
    gpu = [item for item in items if "/tests/gpu/" in str(item.fspath).replace("\\", "/")]
    if not gpu:
        return
    import torch

    cuda = torch.cuda.is_available()
    for item in gpu:
        item.add_marker(pytest.mark.gpu)
        if not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (the GPU suite: make test-gpu)"))


def _module_marks(path: Path) -> set[str]:
    """The names of the markers a test module's top-level `pytestmark` applies, read from its source (not imported)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return {n.attr for n in ast.walk(node.value)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}
    return set()


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips as a whole while it is imported (`pytest.importorskip("llama_cpp")` where the gguf extra is
    not installed) is deselected instead when the run's `-m` leaves out every test it can hold, whatever marks its
    tests add to its `pytestmark`: `make test` deselects the engine tests (markers llama_cpp, llama_cpp_python;
    `make test-gguf` runs them), and a skip there would only hide them. Any other skip stays a skip."""
    outcome = yield
    report = outcome.get_result()
    markexpr = collector.config.getoption("markexpr", "")
    if not (report.skipped and markexpr and isinstance(collector, pytest.Module)):
        return
    marks = _module_marks(collector.path)
    others = sorted(set(re.findall(r"[\w.-]+", markexpr)) - {"and", "or", "not"} - marks)
    if len(others) > 8:
        return
    try:
        from _pytest.mark.expression import Expression

        expression = Expression.compile(markexpr)
        selectable = any(expression.evaluate(lambda name, **_: name in marks or name in extra)
                         for n in range(len(others) + 1) for extra in itertools.combinations(others, n))
    except Exception:  # pytest's expression parser is not public API: where it changes, the module skips as before
        return
    if not selectable:
        collector.config.hook.pytest_deselected(items=[collector])
        outcome.force_result(pytest.CollectReport(collector.nodeid, "passed", None, []))


# What `-m` left out, said at the end of the run: under pytest-xdist the workers deselect (each the whole collection)
# and pytest's summary line does not count it. A module deselected before it could be imported counts as one.
_deselected: list = []


def pytest_deselected(items):
    _deselected.extend(items)


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # set in a pytest-xdist worker
    if workeroutput is not None:
        workeroutput["quantkit_deselected"] = (sum(isinstance(i, pytest.Item) for i in _deselected),
                                               sum(not isinstance(i, pytest.Item) for i in _deselected))


_worker_deselected: list[tuple[int, int]] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _worker_deselected.append(tuple(getattr(node, "workeroutput", {}).get("quantkit_deselected", (0, 0))))


def pytest_terminal_summary(terminalreporter, config):
    markexpr = config.getoption("markexpr", "")
    if not markexpr or getattr(config, "workeroutput", None) is not None:
        return
    tests = sum(isinstance(i, pytest.Item) for i in _deselected)
    modules = len(_deselected) - tests
    if _worker_deselected:
        tests, modules = max(_worker_deselected)
    if tests or modules:
        whole = f" and {modules} whole test module{'s' * (modules != 1)} (not imported)" if modules else ""
        terminalreporter.write_line(f"-m {markexpr!r} left out {tests} test{'s' * (tests != 1)}{whole}"
                                    + ("; make test-gguf runs them" if "llama_cpp" in markexpr else ""))
