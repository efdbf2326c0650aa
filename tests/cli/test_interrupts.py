"""How a run stops: SIGTERM met as Ctrl-C, exit codes 130 / 143, a rank following its launcher, and the launcher
printing its ranks' lines once each (the real processes: tests/integration/test_stopping_runs.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from quantkit import errors
from quantkit.cli import interrupts, launch
from quantkit.cli.main import app
import quantkit.finalization.finalize


def _finalize_raising(monkeypatch, exc: BaseException):
    from quantkit.export import atomic
    from quantkit.models import sources

    monkeypatch.setattr(sources, "resolve_source", lambda src, revision=None: src)
    monkeypatch.setattr(atomic, "check_destination", lambda dst, overwrite, single_file=False: None)

    def raising(*args, **kwargs):
        raise exc

    monkeypatch.setattr(quantkit.finalization.finalize, "finalize", raising)
    return CliRunner().invoke(app, ["finalize", "src", "dst", "-q", "int4-weight-only"])


@pytest.mark.parametrize("exc, code", [(KeyboardInterrupt(), 130), (errors.Terminated(), 143)])
def test_an_interrupt_exits_128_plus_its_signal(monkeypatch, exc, code):
    result = _finalize_raising(monkeypatch, exc)
    assert result.exit_code == code and result.output.strip() == "interrupted; nothing was written"


@pytest.mark.parametrize("exc, code", [(KeyboardInterrupt(), 130), (errors.Terminated(), 143)])
def test_an_interrupted_run_that_kept_its_work_says_where_with_the_signals_code(monkeypatch, exc, code):
    result = _finalize_raising(monkeypatch, errors.InterruptedRunError("interrupted after 2 finished layers", exc))
    assert result.exit_code == code and result.output.strip() == "error: interrupted after 2 finished layers"


@pytest.fixture
def sigterm_restored():
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_sigterm_interrupts_the_main_thread_as_ctrl_c_does(sigterm_restored):
    interrupts.install()
    with pytest.raises(KeyboardInterrupt) as raised:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at the next bytecode
    assert isinstance(raised.value, errors.Terminated) and errors.interrupt_exit_code(raised.value) == 143


def test_sigterm_ignored_at_start_stays_ignored(sigterm_restored):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    interrupts.install()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


FOLLOW = """
import ctypes, os, signal, sys
from quantkit.cli import interrupts
followed = interrupts.follow_launcher()
got = ctypes.c_int(0)
ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0)  # PR_GET_PDEATHSIG
print(followed, got.value, interrupts.LAUNCHER_PID in os.environ)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("launcher, rank, expected", [
    ("parent", "0", f"True {int(signal.SIGTERM)} False"),  # this test's process is the rank's parent: followed
    ("other", "1", f"False {int(signal.SIGTERM)} False"),  # the launcher is gone: the rank stops
    (None, "0", "True 0 False"),  # not quantkit's launcher (torchrun by hand): nothing asked
    ("parent", None, "True 0 False"),  # not a rank
])
def test_a_rank_follows_its_launcher(launcher, rank, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", interrupts.LAUNCHER_PID)}
    if launcher is not None:
        env[interrupts.LAUNCHER_PID] = str(os.getpid() if launcher == "parent" else os.getpid() + 10**6)
    if rank is not None:
        env["RANK"] = rank
    done = subprocess.run([sys.executable, "-c", FOLLOW], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == expected, done.stderr


def test_ranks_lines_go_to_the_launchers_directory_and_come_back_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(interrupts.RANK_MESSAGES, str(tmp_path))
    for rank, line in [(1, "error: same"), (0, "error: same"), (0, "error: rank 0's own"), (2, "error: other")]:
        monkeypatch.setenv("RANK", str(rank))
        interrupts.say(line)
    assert capsys.readouterr().err == ""
    assert interrupts.said(tmp_path) == ["error: same", "error: rank 0's own", "error: other"]
    assert interrupts.said(tmp_path, {2}) == ["error: other"]
    monkeypatch.delenv(interrupts.RANK_MESSAGES)
    interrupts.say("[red]error:[/red] not a rank of quantkit's launcher")
    assert capsys.readouterr().err.strip() == "error: not a rank of quantkit's launcher"


def _failure(rank: int, exitcode: int, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(tmp_path / f"none-{rank}"))


def _run_torchrun(monkeypatch, ranks_say: dict[int, str], raising, explained=()):
    """`launch.run_torchrun` with torchrun's `run` replaced: the ranks write their lines where the launcher said,
    then `raising()` is raised (or nothing)."""
    import torch.distributed.run

    seen = {}

    def run(config):
        seen["env"] = {k: os.environ.get(k) for k in (interrupts.RANK_MESSAGES, interrupts.LAUNCHER_PID)}
        for rank, line in ranks_say.items():
            (os.path.isdir(os.environ[interrupts.RANK_MESSAGES])
             and open(os.path.join(os.environ[interrupts.RANK_MESSAGES], f"rank-{rank:05d}.txt"), "a").write(line + "\n"))
        if raising is not None:
            raise raising()

    monkeypatch.setattr(torch.distributed.run, "run", run)
    code = launch.run_torchrun(["--standalone", "--nproc-per-node=2", "-m", "quantkit.cli.main", "finalize"], explained)
    return code, seen


def test_the_launcher_interrupted_exits_128_plus_the_signal_with_its_ranks_line_once(monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    said = "error: interrupted after 1 finished layer, saved in out.partial; run the same command with --resume"
    code, seen = _run_torchrun(monkeypatch, {0: said, 1: said},
                               lambda: SignalException("Process 1 got signal: 15", signal.SIGTERM))
    assert code == 143 and capsys.readouterr().err.splitlines() == [said]
    code, _ = _run_torchrun(monkeypatch, {1: "error: interrupted after 2 finished layers", 0: said},
                            lambda: SignalException("Process 1 got signal: 2", signal.SIGINT))
    assert code == 130 and capsys.readouterr().err.splitlines() == [said]  # the ranks stopped a moment apart: rank 0's
    assert seen["env"][interrupts.LAUNCHER_PID] == str(os.getpid())
    assert interrupts.RANK_MESSAGES not in os.environ and interrupts.LAUNCHER_PID not in os.environ  # put back


def test_a_failed_rank_is_its_own_line_not_the_interrupted_others(monkeypatch, capsys, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    failures = {1: _failure(1, 2, tmp_path), 0: _failure(0, 143, tmp_path)}  # rank 0 stopped by torchrun
    failures[0].timestamp += 1
    code, _ = _run_torchrun(monkeypatch, {1: "error: missing.txt does not exist", 0: "interrupted; nothing was written"},
                            lambda: ChildFailedError("quantkit", failures))
    assert code == 2 and capsys.readouterr().err.splitlines() == ["error: missing.txt does not exist"]


def test_a_rank_that_died_without_a_word_is_named(monkeypatch, capsys, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    failures = {1: _failure(1, -signal.SIGKILL, tmp_path), 0: _failure(0, 143, tmp_path)}
    failures[0].timestamp += 1
    code, _ = _run_torchrun(monkeypatch, {0: "interrupted; nothing was written"},
                            lambda: ChildFailedError("quantkit", failures))
    assert code == 1
    assert capsys.readouterr().err.splitlines() == ["error: rank 1 of 2 failed (killed by SIGKILL); the other ranks were stopped"]


def test_an_explained_exit_code_adds_no_line(monkeypatch, capsys, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    code, _ = _run_torchrun(monkeypatch, {}, lambda: ChildFailedError("quantkit", {0: _failure(0, 3, tmp_path)}),
                            explained=(3,))
    assert code == 3 and capsys.readouterr().err == ""
