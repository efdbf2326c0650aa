"""quantkit.json: how an artifact was made, written beside the weights and read back by `eval`."""

from __future__ import annotations

import json
import time
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantkit.quant.registry import Format, Recipe
from quantkit.version import __version__

if TYPE_CHECKING:  # no torch at import: `quantkit --version` and eval's reads of quantkit.json
    from quantkit.quant.plan import ModulePlan

FILENAME = "quantkit.json"
_PACKAGES = ("torch", "transformers", "compressed-tensors", "torchao", "safetensors")


def versions() -> dict[str, str]:
    """quantkit's version and those of the libraries an artifact depends on, from the installed packages' metadata
    (nothing is imported): quantkit.json's `versions`, and `quantkit --version`."""
    found = {"quantkit": __version__}
    for name in _PACKAGES:
        try:
            found[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def version_line() -> str:
    """`quantkit 0.2.0 (torch 2.13.0, transformers 5.24.0, ...)`: what `quantkit --version` prints."""
    found = versions()
    return f"quantkit {found['quantkit']} ({', '.join(f'{name} {found[name]}' for name in _PACKAGES)})"


def modules_summary(plan: list[ModulePlan]) -> dict[str, Any]:
    quantized = [e for e in plan if e.quantized]
    return {
        "quantized": [e.name for e in quantized],
        "group_size_changed": [{"module": e.name, "note": e.note} for e in quantized if e.note],
        "left_out": [{"module": e.name, "reason": e.note} for e in plan if not e.quantized],
    }


def build(recipe: Recipe, fmt: Format, plan: list[ModulePlan], source: Path, fingerprint: str) -> dict[str, Any]:
    trained = read(source) or {}
    qat = trained.get("qat")
    return {
        "quantkit_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "recipe": recipe.to_dict(),
        "scheme": recipe.scheme.describe(),
        "format": fmt.value,
        "versions": versions(),
        "source": {"path": str(source), "fingerprint": fingerprint, "qat_recipe": qat["recipe"]["name"] if qat else None},
        "modules": modules_summary(plan),
    }


def write(out_dir: Path, data: dict[str, Any]) -> None:
    (Path(out_dir) / FILENAME).write_text(json.dumps(data, indent=2) + "\n")


def read(model_dir: Path) -> dict[str, Any] | None:
    path = Path(model_dir) / FILENAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
