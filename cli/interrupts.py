"""How a run stops, and what its ranks say.

- `install()`: SIGTERM raises `errors.Terminated` (a KeyboardInterrupt) in the main thread, so that a `kill`, a
  cancelled CI job or torchrun stopping its ranks ends a run the way Ctrl-C does: temporary output removed, finished
  layers kept for `--resume`, exit 143, instead of dying mid-write.
- `follow_launcher()`: a rank started by quantkit's own launcher (`launch.relaunch`) gets SIGTERM when that launcher
  dies (Linux's PR_SET_PDEATHSIG). torchrun starts its ranks in sessions of their own, so without it a launcher
  killed with SIGKILL, or whose terminal closed, leaves its ranks running, and rank 0 writes DST later.
- `say()` and `said()`: under quantkit's launcher a rank's one-line error goes to a file in the directory the
  launcher names; the launcher prints each distinct line once, after the ranks have stopped (every rank meets the
  same missing file or the same Ctrl-C: one line, not one a rank).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

from quantkit.cli.console import err
from quantkit.errors import Terminated

LAUNCHER_PID = "QUANTKIT_LAUNCHER_PID"  # set by the launcher for its ranks
RANK_MESSAGES = "QUANTKIT_RANK_MESSAGES"  # the directory its ranks' error lines go to
_PR_SET_PDEATHSIG = 1


def install() -> None:
    """SIGTERM interrupts like Ctrl-C (unless this process was started with it ignored, as `nohup`-like launchers
    may, which stays so)."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum: int, frame) -> None:
    raise Terminated(signum)


def follow_launcher() -> bool:
    """In a rank of quantkit's launcher: ask for SIGTERM when the launcher dies. False when the launcher is gone
    already (this rank's parent is another process): the caller stops at once. The variable is not passed on to
    what this rank starts."""
    pid = os.environ.pop(LAUNCHER_PID, None)
    if not pid or "RANK" not in os.environ or not sys.platform.startswith("linux"):
        return True
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: as before, the rank outlives a killed launcher
        return True
    return os.getppid() == int(pid)


def say(line: str) -> None:
    """A one-line message (rich markup, the user's text in it escaped) on stderr, or, in a rank of quantkit's
    launcher, into that rank's file for the launcher to print."""
    where = os.environ.get(RANK_MESSAGES)
    rank = os.environ.get("RANK")
    if where and rank is not None and Path(where).is_dir():
        with open(Path(where) / f"rank-{int(rank):05d}.txt", "a", encoding="utf-8") as fh:
            fh.write(line.replace("\n", " ") + "\n")
        return
    show(line)


def show(line: str) -> None:
    """A one-line message (rich markup) on stderr."""
    err.print(line, highlight=False, soft_wrap=True)


def said(where: Path, ranks: set[int] | None = None) -> list[str]:
    """The distinct lines the ranks (all, or those in `ranks`) wrote into `where`, in rank order."""
    lines: dict[str, None] = {}
    for path in sorted(where.glob("rank-*.txt")):
        if ranks is None or int(path.stem.split("-")[1]) in ranks:
            lines.update(dict.fromkeys(path.read_text(encoding="utf-8").splitlines()))
    return list(lines)
