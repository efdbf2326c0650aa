"""Where the CLI prints: results to stdout, errors and progress to stderr; `--json` documents."""

import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

# In a log or a pipe (no terminal) rich would fold tables at 80 columns; give them room unless COLUMNS says.
# Results hold the user's paths, recipe names and values: printed as given, never read as rich markup (`[exp]`,
# `[/red]`) or emoji codes (`:x:`). Errors are marked up (`[red]error:[/red]`), the user's text in them escaped.
out = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160, markup=False, emoji=False)
err = Console(stderr=True, width=None if sys.stderr.isatty() or "COLUMNS" in os.environ else 160, emoji=False)


SCHEMA_VERSION = 1  # of every --json document; README "JSON output" lists their fields


def write_json(target: Path, command: str, payload: dict[str, Any]) -> None:
    """`{"schema_version", "command", ...payload}` to the file `target`, or to stdout alone when it is `-`."""
    text = json.dumps({"schema_version": SCHEMA_VERSION, "command": command, **payload}, indent=2, default=str) + "\n"
    if str(target) == "-":
        print(text, end="", flush=True)
    else:
        Path(target).write_text(text)


def json_to_stdout(target: Path | None) -> bool:
    """`--json -`: stdout holds the JSON document and nothing else."""
    return target is not None and str(target) == "-"


def human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} GiB"


def quiet_libraries() -> None:
    """Our own progress and tables replace the libraries' bars and import-time chatter (call before importing them)."""
    import logging
    import os
    import warnings

    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    for name in ("torchao", "torch.utils._pytree", "compressed_tensors", "datasets", "huggingface_hub", "lm_eval",
                 "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    _silence_tqdm()


def _silence_tqdm() -> None:
    """compressed-tensors and transformers draw tqdm bars with `disable=False` passed explicitly, which
    TQDM_DISABLE cannot override; make tqdm's class ignore it (the CLI shows its own progress)."""
    import tqdm
    import tqdm.auto

    if getattr(tqdm.tqdm, "_quantkit_silenced", False):
        return

    class SilentTqdm(tqdm.tqdm):
        _quantkit_silenced = True

        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    tqdm.tqdm = SilentTqdm
    tqdm.auto.tqdm = SilentTqdm
