"""The shipped recipes (one YAML file each, the file name is the recipe's name), and the registry's Python face.

    import quantkit
    quantkit.recipes.names()                    # ['autoround-w2a16', ..., 'w4a8-fp8']
    recipe = quantkit.recipes.get("gptq-w4a16")   # or a path to your own recipe file
    recipe.to_file()                             # the dict `quantkit recipes show gptq-w4a16` prints as YAML

No torch is imported: recipes are checked without it.
"""

from __future__ import annotations

from pathlib import Path

from quantkit.quant.registry import Recipe, recipe_names, resolve

__all__ = ["Recipe", "get", "names"]


def get(name_or_path: str | Path) -> Recipe:
    """A shipped recipe by name, or a recipe file by path; a mistyped name raises `RecipeNotFoundError` (a
    `quantkit.errors.QuantkitError`) naming the closest names."""
    return resolve(str(name_or_path))


def names() -> list[str]:
    """The shipped recipes' names, sorted."""
    return recipe_names()
