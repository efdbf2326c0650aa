"""Progress display for long work: rich bars on a terminal, silence elsewhere."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


class Progress:
    """`with progress.task("Quantizing", total=n) as advance: advance()`. Disabled: every call is a no-op."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and sys.stderr.isatty()

    @contextlib.contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[Callable[..., None]]:
        if not self.enabled:
            yield lambda *args, **kwargs: None
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with RichProgress(*columns, console=Console(stderr=True), transient=False) as bar:
            task_id = bar.add_task(description, total=total)

            def advance(amount: int = 1, description: str | None = None) -> None:
                bar.update(task_id, advance=amount, **({"description": description} if description else {}))

            yield advance
            bar.update(task_id, completed=total if total is not None else 1, total=total if total is not None else 1)


QUIET = Progress(enabled=False)
