"""A MODEL as `eval` takes it: where it is, which format's reader reads it (`export.reader_for`), and the engine that
runs it where transformers does not (the reader's ENGINE, a module of this package: llama.cpp's for GGUF). Torch-free:
the CLI checks every MODEL here before torch loads."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from types import ModuleType
from typing import Sequence

from quantkit.export import reader_for
from quantkit.models.sources import resolve_source


def locate(label: str | Path):
    """(where the model is, its reader): a one-file artifact at its path, anything else a directory (a hub id resolved
    in the cache, SourceModelError where there is none)."""
    found = reader_for(label)
    if found.single_file:
        return Path(label), found
    path = resolve_source(label)
    return path, reader_for(path)


def engine(reader) -> ModuleType | None:
    """The module that runs the reader's artifacts (`ReaderHooks.ENGINE`), or None where transformers does."""
    return import_module(reader.ENGINE) if reader.ENGINE else None


def in_engine(label: str | Path) -> bool:
    """The model runs in an engine of its own, not transformers (a .gguf file in llama.cpp)."""
    return reader_for(label).ENGINE is not None


def check_engines(models: Sequence[str], tp: int = 1, max_acc_drop: float | None = None, device: str = "auto") -> None:
    """Each engine's models checked, and the options they cannot take refused, before anything loads."""
    for reader in dict.fromkeys(reader_for(model) for model in models):
        if reader.ENGINE:
            engine(reader).check_options(models, tp, max_acc_drop, device)
