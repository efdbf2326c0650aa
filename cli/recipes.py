"""`quantkit recipes list | show NAME`."""

from __future__ import annotations

from typing import Annotated

import typer
import yaml

from quantkit import registry
from quantkit.cli.console import out


def list_recipes() -> None:
    """Every recipe: name, scheme, algorithm, default format.

    Example: quantkit recipes list
    """
    from rich.table import Table

    table = Table(title="quantkit recipes")
    for column in ("name", "weights", "activations", "algorithm", "format", "description"):
        table.add_column(column)
    for recipe in registry.list_recipes():
        scheme = recipe.scheme
        acts = scheme.activations.describe() if scheme.activations else "-"
        table.add_row(recipe.name, scheme.weights.describe(), acts, recipe.algorithm.value, recipe.format.value, recipe.description)
    out.print(table)


def show(name: Annotated[str, typer.Argument(help="Recipe name or path to a recipe .yaml file.")]) -> None:
    """One recipe as resolved: scheme, algorithm, format, ignore list, requirements.

    Example: quantkit recipes show int4-weight-only
    """
    recipe = registry.resolve(name)
    out.print(yaml.safe_dump(recipe.to_dict(), sort_keys=False), end="", highlight=False)
