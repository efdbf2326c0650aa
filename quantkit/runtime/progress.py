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
    def task(self, description: str, total: int | None = None, completed: int = 0) -> Iterator[Callable[..., None]]:
        if not self.enabled:
            yield lambda *args, **kwargs: None
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with RichProgress(*columns, console=Console(stderr=True), transient=False) as bar:
            task_id = bar.add_task(description, total=total, completed=completed)

            def advance(amount: int = 1, description: str | None = None) -> None:
                bar.update(task_id, advance=amount, **({"description": description} if description else {}))

            yield advance
            bar.update(task_id, completed=total if total is not None else 1, total=total if total is not None else 1)

    @contextlib.contextmanager
    def training(self, total: int, start: int = 0, enabled: bool = True) -> Iterator[Callable[[dict], None]]:
        """A live line for training: step, loss, learning rate, tokens/s, eval perplexity, ETA."""
        if not (self.enabled and enabled):
            yield lambda record: None
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        fields = "loss {task.fields[loss]:.4f}  lr {task.fields[lr]:.2e}  {task.fields[tps]:,.0f} tok/s  ppl {task.fields[ppl]}"
        columns = [TextColumn("Training"), BarColumn(), MofNCompleteColumn(), TextColumn(fields), TimeRemainingColumn()]
        with RichProgress(*columns, console=Console(stderr=True)) as bar:
            task_id = bar.add_task("train", total=total, completed=start, loss=float("nan"), lr=0.0, tps=0.0, ppl="-")

            def update(record: dict) -> None:
                extra = {"ppl": f"{record['eval_perplexity']:.2f}"} if record.get("eval_perplexity") else {}
                bar.update(task_id, completed=record["step"], loss=record.get("loss", float("nan")),
                           lr=record.get("lr", 0.0), tps=record.get("tokens_per_second", 0.0), **extra)

            yield update


QUIET = Progress(enabled=False)
