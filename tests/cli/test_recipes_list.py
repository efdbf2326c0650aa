"""`quantkit recipes list`: one line per recipe in a 100-column terminal; what it leaves out, `recipes show` prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from typer.testing import CliRunner

from quantkit.cli.main import app
from quantkit.quant import registry

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # rich colours where FORCE_COLOR is set


def test_recipes_list_fits_100_columns_one_line_per_recipe():
    done = subprocess.run([sys.executable, "-m", "quantkit.cli.main", "recipes", "list"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "100"}, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = ANSI.sub("", done.stdout).rstrip("\n").splitlines()
    names = registry.recipe_names()
    assert max(len(line) for line in lines) <= 100, done.stdout
    assert len(lines) <= len(names) + 4, done.stdout  # the header, its rule and the caption
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.split() and line.split()[0] in names}
    assert sorted(rows) == names
    assert rows["nvfp4"] == ["nvfp4", "nvfp4", "rtn", "ct"]  # NVFP4 and MX grids by name
    assert rows["fp8-static"] == ["fp8", "channel", "fp8", "tensor", "static", "rtn", "ct"]
    assert rows["int8-dynamic-act-int4-weight"][-1] == "torchao"
    assert rows["smoothquant-w8a8"][-4:-1] == ["smoothquant", "+", "gptq"]


def test_what_the_list_leaves_out_recipes_show_prints():
    """The GPUs vLLM runs each recipe on and its description, as fields of the recipe file."""
    runner = CliRunner()
    for recipe in registry.list_recipes():
        shown = runner.invoke(app, ["recipes", "show", recipe.name])
        assert shown.exit_code == 0, shown.output
        assert f"\nhardware: {recipe.hardware}\n" in shown.output and f"description: {recipe.description}" in shown.output
