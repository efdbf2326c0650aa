"""`quantkit recipes list | show NAME`."""

from __future__ import annotations

from typing import Annotated

import typer
import yaml

from quantkit.cli.console import json_to_stdout, out, write_json
from quantkit.cli.options import JsonOpt
from quantkit.quant import registry

# The ends of `recipes list --help` and `recipes show --help` (typer's epilogs): lines of at most 78 characters, so
# 80-column help keeps each whole; the recipes and options they name must exist (tests/cli/test_commands_doc.py)
LIST_EXAMPLES = """Examples:

quantkit recipes list

quantkit recipes list --json recipes.json
"""

SHOW_EXAMPLES = """Examples:

quantkit recipes show int4-weight-only

quantkit recipes show gptq-w4a16 > my-gptq.yaml

quantkit finalize ./my-model ./out -q my-gptq.yaml --calib-data train.txt
"""

FORMATS = {registry.Format.COMPRESSED_TENSORS: "ct"}  # `recipes list` fits 100 columns; the caption spells it out


def list_recipes(json_path: JsonOpt = None) -> None:
    """Every recipe, one line each: name, weights, activations, algorithm, default format.

    The GPUs vLLM runs a recipe on natively, its description and every setting: `quantkit recipes show NAME`.
    """
    if json_path:
        write_json(json_path, "recipes list", {"recipes": [recipe.to_dict() for recipe in registry.list_recipes()]})
    if json_to_stdout(json_path):  # stdout holds the JSON alone; a file leaves it the table
        return

    from rich import box
    from rich.table import Table

    # no borders, two spaces between columns: 25 recipes in 100 columns, one line each
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                  caption="ct: compressed-tensors; where vLLM runs each, and every setting: quantkit recipes show NAME")
    recipes = registry.list_recipes()
    width = max(len(r.name) for r in recipes)
    table.add_column("name", no_wrap=True, min_width=width, style="bold")  # names are copied into commands: never cut
    for column in ("weights", "activations", "algorithm", "format"):
        table.add_column(column)
    for recipe in recipes:
        acts = recipe.scheme.activations
        acts = (acts.label() + ("" if acts.dynamic else " static")) if acts else "16-bit"
        weights = f"{recipe.mixture.lower()} mix" if recipe.mixture else recipe.scheme.weights.label()  # llama.cpp's name
        table.add_row(recipe.name, weights, acts, recipe.describe_algorithm(),
                      FORMATS.get(recipe.format, recipe.format.value))
    out.print(table)



def show(name: Annotated[str, typer.Argument(help="Recipe name or path to a recipe .yaml file.")], json_path: JsonOpt = None) -> None:
    """One recipe as a recipe file, its scheme's, algorithm's and calibration's defaults spelt out: save it, edit it, pass it to -q."""
    recipe = registry.resolve(name)
    if json_path:
        write_json(json_path, "recipes show", {"recipe": recipe.to_dict()})
    if json_to_stdout(json_path):
        return
    header = f"# quantkit recipe {recipe.name}: saved as FILE.yaml and passed as -q FILE.yaml, it is this recipe, named FILE\n"
    if recipe.online_rotations:
        from quantkit.quant.rotations import ONLINE_RUNTIMES
        header += f"# {ONLINE_RUNTIMES}\n"
    typer.echo(header + yaml.safe_dump(recipe.to_file(), sort_keys=False, width=10_000), nl=False)  # plain: no wrapping
