"""Write a directory all at once: into a temporary directory beside the destination, renamed at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from quantkit.errors import DestinationExistsError


def check_destination(dst: Path, overwrite: bool) -> None:
    """Refuse, before any work, a DST that exists (without `overwrite`), is a file, or cannot be created."""
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise DestinationExistsError(f"{dst} already exists; pass --overwrite to replace it or choose another path")
    if dst.exists() and not dst.is_dir():
        raise DestinationExistsError(f"{dst} exists and is a file; choose a directory path")
    parent = next(p for p in dst.absolute().parents if p.exists())
    if not parent.is_dir():
        raise DestinationExistsError(f"{dst} cannot be created: {parent} is a file; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DestinationExistsError(f"{dst} cannot be created: {parent} is not writable; choose another path")


@contextlib.contextmanager
def atomic_directory(dst: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces `dst`. On any failure or Ctrl-C nothing is left."""
    dst = Path(dst)
    check_destination(dst, overwrite)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            dst.rename(old / dst.name)
            tmp.rename(dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
