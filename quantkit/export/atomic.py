"""Write a directory (or one file) all at once: into a temporary one beside the destination, renamed at the end. Also
what else lives beside DST: a calibrated run's work directory (DST.partial), checked here before torch loads."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

from quantkit.errors import DestinationExistsError, UsageError

STATE = "state.json"  # in a work directory: the interrupted run (`calibration.resume`)


def check_destination(dst: Path, overwrite: bool, single_file: bool = False) -> None:
    """Refuse, before any work, a DST that exists (without `overwrite`), is a file where a directory is written
    (or a directory where one file is: `single_file`, GGUF), or cannot be created."""
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise DestinationExistsError(f"{dst} already exists; pass --overwrite to replace it or choose another path")
    if dst.exists() and single_file and dst.is_dir():
        raise DestinationExistsError(f"{dst} is a directory, and this format is one file; choose a file path")
    if dst.exists() and not single_file and not dst.is_dir():
        raise DestinationExistsError(f"{dst} exists and is a file; choose a directory path")
    parent = next(p for p in dst.absolute().parents if p.exists())
    if not parent.is_dir():
        raise DestinationExistsError(f"{dst} cannot be created: {parent} is a file; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DestinationExistsError(f"{dst} cannot be created: {parent} is not writable; choose another path")


def holds(folder: str | Path, path: str | Path) -> bool:
    """Whether `path` is `folder` or lies inside it (both resolved): emptying `folder` would delete it."""
    folder, path = Path(folder).resolve(), Path(path).resolve()
    return path == folder or folder in path.parents


def check_not_source(dst: str | Path, src: str | Path) -> None:
    """Refuse a DST that is the source model's directory or holds it: writing it (with --overwrite) would delete
    the model being read."""
    dst, src = Path(dst).resolve(), Path(src).resolve()
    if holds(dst, src):
        raise DestinationExistsError(f"{dst} {'is' if dst == src else 'holds'} the source model {src}, which writing "
                                     "it would delete; choose another path")


def work_dir(dst: str | Path) -> Path:
    """Where a calibrated finalize of DST keeps its per-layer state: beside DST."""
    dst = Path(dst)
    return dst.parent / f"{dst.name}.partial"


def check_work_dir(dst: str | Path, resume: bool, ranks: int | None = None) -> None:
    """Before any work: `--resume` needs an interrupted run (of as many `ranks`, when given: checked before the
    launcher starts them); a run without it must not silently discard one."""
    path = work_dir(dst)
    found = (path / STATE).is_file()
    if resume and not found:
        why = (f"{path} holds no checkpoint: the run stopped before its first (finalize --checkpoint-every)"
               if path.is_dir() else f"{path} does not exist")
        raise UsageError(f"--resume: there is no interrupted run of {dst} ({why}); run without --resume")
    if resume and ranks is not None:
        saved = _read_state(path).get("fingerprint", {}).get("ranks")
        if saved is not None and saved != str(ranks):
            raise UsageError(
                f"--resume: the interrupted run in {path} had ranks {saved}, this one has {ranks}; "
                f"rerun with --nproc-per-node {saved} (on several machines: --nnodes x --nproc-per-node = {saved}), "
                f"or delete {path} and run without --resume"
            )
    if not resume and found:
        completed = _read_state(path).get("completed")
        done = f"{completed} layers done" if completed is not None else "its state file is unreadable"
        raise UsageError(
            f"{path} holds an interrupted run of {dst} ({done}): pass --resume to continue it, "
            f"or delete {path} to start over"
        )


def _read_state(path: Path) -> dict:
    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _tmp_prefix(dst: Path) -> str:
    return f".{dst.name}.tmp-"


def remove_abandoned(dst: Path) -> list[Path]:
    """Delete the temporary directories of earlier writes of `dst` on this machine whose process is gone (killed
    with SIGKILL, or the machine lost power, half-way through a streamed write). Returns what was removed."""
    removed = []
    host = socket.gethostname()
    for tmp in Path(dst).parent.glob(f"{_tmp_prefix(Path(dst))}{host}-*"):
        pid = tmp.name[len(_tmp_prefix(Path(dst)) + host) + 1 :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def umask() -> int:
    """This process's umask (the permissions a new file or directory leaves out)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _with_umask_modes(root: Path) -> None:
    """The modes a plain mkdir and open() give under this umask, for `root` and everything in it: mkdtemp makes the
    directory owner-only, and transformers' save_pretrained writes its weights so (0600), where the artifact is
    read by servers running as other users too."""
    mask = umask()
    root.chmod(0o777 & ~mask)
    for path in root.rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def write_text(path: str | Path, text: str) -> None:
    """`text` (UTF-8) into the file `path` all at once: a temporary file beside it, renamed over it, so a failure or
    Ctrl-C leaves `path` as it was, never half-written."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp's file is owner-only; a plain open() under this umask is not
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_directory(dst: str | Path, overwrite: bool = False, single_file: str | None = None) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces `dst`. On any failure or Ctrl-C nothing is left.
    `single_file`: the artifact is that one file of the directory (GGUF), which replaces `dst` alone; the rest of
    the directory (the files it was made from) is removed."""
    dst = Path(dst)
    check_destination(dst, overwrite, single_file is not None)
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(dst)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_tmp_prefix(dst)}{socket.gethostname()}-{os.getpid()}-", dir=dst.parent))
    try:
        yield tmp
        _with_umask_modes(tmp)
        if single_file is not None:
            (tmp / single_file).replace(dst)
            shutil.rmtree(tmp, ignore_errors=True)
        elif dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            dst.rename(old / dst.name)
            tmp.rename(dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
