"""`quantkit recipes list | show NAME`."""

from __future__ import annotations

from typing import Annotated

import typer
import yaml

from quantkit import registry
from quantkit.cli.console import out, write_json
from quantkit.cli.options import JsonOpt


def list_recipes(json_path: JsonOpt = None) -> None:
    """Every recipe: name, scheme, algorithm, default format, and the GPUs vLLM runs it on.

    Example: quantkit recipes list
    """
    from rich.table import Table

    if json_path:
        write_json(json_path, "recipes list", {"recipes": [recipe.to_dict() for recipe in registry.list_recipes()]})
        return

    from rich import box

    table = Table(box=box.SIMPLE_HEAD, caption="Details: quantkit recipes show NAME")
    recipes = registry.list_recipes()
    width = max(len(r.name) for r in recipes)
    table.add_column("name", no_wrap=True, min_width=width, style="bold")  # names are copied into commands: never cut
    for column in ("weights", "activations", "algorithm", "format", "runs natively on (vLLM)"):
        table.add_column(column)
    for recipe in recipes:
        scheme = recipe.scheme
        acts = scheme.activations
        acts = f"{acts.describe()} ({'dynamic' if acts.dynamic else 'static'})" if acts else "16-bit"
        table.add_row(recipe.name, scheme.weights.describe(), acts, recipe.describe_algorithm(), recipe.format.value, recipe.hardware)
    out.print(table)


def show(name: Annotated[str, typer.Argument(help="Recipe name or path to a recipe .yaml file.")], json_path: JsonOpt = None) -> None:
    """One recipe as a recipe file, every default spelt out: save it, edit it, pass it to -q.

    Examples:

      quantkit recipes show int4-weight-only

      quantkit recipes show gptq-w4a16 > my-gptq.yaml     (then: quantkit finalize SRC DST -q my-gptq.yaml)
    """
    recipe = registry.resolve(name)
    if json_path:
        write_json(json_path, "recipes show", {"recipe": recipe.to_dict()})
        return
    header = f"# quantkit recipe {recipe.name}: saved as FILE.yaml and passed as -q FILE.yaml, it is this recipe, named FILE\n"
    typer.echo(header + yaml.safe_dump(recipe.to_file(), sort_keys=False, width=10_000), nl=False)  # plain: no wrapping
