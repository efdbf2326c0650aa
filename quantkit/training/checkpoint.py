"""Training checkpoints: a Hugging Face model directory (float weights, safetensors) plus the trainer state.

    OUTPUT_DIR/checkpoints/step-000050/  model.safetensors, config.json, tokenizer, quantkit.json, trainer_state.pt
    OUTPUT_DIR/final/                     model.safetensors, config.json, tokenizer, quantkit.json

quantkit.json records the QAT recipe, so `finalize` knows it converts a QAT model. trainer_state.pt holds
optimizer, scheduler, step and RNG states: a pickle that cannot be avoided for optimizer state, read back with
`torch.load(weights_only=True)`. Every directory is written atomically.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.errors import UsageError
from quantkit.export import atomic, metadata

STATE_FILE = "trainer_state.pt"


def save_model_dir(model: nn.Module, tokenizer, out: Path, info: dict[str, Any]) -> None:
    from quantkit.quant import fake_quant

    with fake_quant.stripped(model):
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    metadata.write(out, info)


def save(root: Path, step: int, model: nn.Module, tokenizer, trainer_state: dict[str, Any], info: dict, keep_last: int) -> Path:
    """Write checkpoint `step` under root/checkpoints and keep only the newest `keep_last`."""
    target = root / "checkpoints" / f"step-{step:06d}"
    with atomic.atomic_directory(target, overwrite=True) as tmp:
        save_model_dir(model, tokenizer, tmp, info)
        torch.save(trainer_state, tmp / STATE_FILE)
    for old in sorted((root / "checkpoints").glob("step-*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def latest(root: Path) -> Path | None:
    found = sorted((root / "checkpoints").glob("step-*"))
    return found[-1] if found else None


def resolve_resume(root: Path, resume: str) -> Path:
    path = latest(root) if resume == "latest" else Path(resume)
    if path is None:
        held = [p for p in root.iterdir() if p.name != "config.json"] if root.is_dir() else []
        finished = f" (the run finished without checkpoints: its model is {root / 'final'})" if (root / "final").is_dir() else ""
        again = ("start without --resume, with --overwrite (the directory's contents are deleted) or another output_dir"
                 if held else "start without --resume")
        raise UsageError(f"--resume latest: no checkpoint under {root / 'checkpoints'}{finished}; {again}")
    if not (path / STATE_FILE).is_file():
        raise UsageError(f"--resume {path}: not a quantkit checkpoint (no {STATE_FILE})")
    return path


def step_of(path: Path) -> int:
    """The step checkpoint `path` was written at, as its quantkit.json records it (the trainer state, which holds
    the optimizer's moments too, is read only when the run starts)."""
    step = (metadata.read(path) or {}).get("step")
    if not isinstance(step, int):
        raise UsageError(f"--resume {path}: its {metadata.FILENAME} records no step; not a quantkit checkpoint")
    return step


def load_state(path: Path) -> dict[str, Any]:
    return torch.load(path / STATE_FILE, weights_only=True)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
