"""docs/commands.md is generated from the typer app (scripts/gen_commands_doc.py) and fails here when stale; every
command's --help ends with examples whose recipes and options exist."""

from __future__ import annotations

import difflib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from quantkit.cli.main import app
from quantkit.quant import registry

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [("train",), ("finalize",), ("eval",), ("recipes", "list"), ("recipes", "show")]
RECIPE_OPTIONS = ("-q", "--quantize", "--qat-recipe")
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # rich colours help where FORCE_COLOR or GITHUB_ACTIONS is set


def _generator():
    spec = importlib.util.spec_from_file_location("gen_commands_doc", ROOT / "scripts" / "gen_commands_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _command(path: tuple[str, ...]):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def _examples(path: tuple[str, ...]) -> list[str]:
    """The examples the command's epilog holds, each as written (a long one continued with a backslash)."""
    title, *examples = _command(path).epilog.strip().split("\n\n")
    assert title == "Examples:"
    return examples


def _options(command) -> set[str]:
    return {name for param in command.params for name in (*param.opts, *param.secondary_opts)} | {"--help"}


def test_docs_commands_md_is_current():
    expected = _generator().render().encode()
    current = (ROOT / "docs" / "commands.md").read_bytes()
    if current != expected:
        diff = difflib.unified_diff(current.decode().splitlines(), expected.decode().splitlines(), "docs/commands.md",
                                    "generated", lineterm="", n=1)
        pytest.fail("docs/commands.md is stale: run `python scripts/gen_commands_doc.py > docs/commands.md`\n"
                    + "\n".join(list(diff)[:40]))


def test_every_option_of_every_command_is_documented_in_its_section():
    """Walks the app here, not with the generator's walker: a command or a parameter it skipped fails."""
    document = (ROOT / "docs" / "commands.md").read_text()
    sections = {m.group(1): m.group(2) for m in re.finditer(r"^## `([^`]+)`\n(.*?)(?=^## |\Z)", document, re.M | re.S)}

    def walk(group, path):
        for name, command in group.commands.items():
            yield from walk(command, f"{path} {name}") if hasattr(command, "commands") else [(f"{path} {name}", command)]

    documented = list(walk(typer.main.get_command(app), "quantkit"))
    assert sorted(path for path, _ in documented) == sorted(sections)
    for path, command in documented:
        text = sections[path].replace("\\|", "|").replace("\\*", "*")
        for param in command.params:
            names = [param.name.upper()] if param.param_type_name == "argument" else [*param.opts, *param.secondary_opts]
            for name in names:
                assert f"`{name}`" in text, f"{path}: {name} is missing from docs/commands.md"
            help_text = (param.help or "").replace("\\[", "[")
            assert help_text in text, f"{path}: the help of {names[0]} is missing from docs/commands.md"


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_help_ends_with_examples_each_kept_whole_at_80_columns(path):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in ANSI.sub("", result.output).splitlines() if line.strip()]
    assert "Examples:" in lines
    assert any(line.startswith(f"quantkit {' '.join(path)}") for line in lines)
    example_lines = [line.strip() for example in _examples(path) for line in example.splitlines()]
    # the last thing shown, each line whole: a line over 78 characters wraps at 80 columns
    assert lines[-len(example_lines):] == example_lines, "an example wraps or is not last in --help at 80 columns"


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_the_examples_name_recipes_and_options_that_exist(path):
    """An example can't rot: the recipes it names resolve, its options are its command's, and a recipe file it
    passes to -q is one an earlier example wrote (`recipes show NAME > FILE`)."""
    written, resolved = set(), []
    for example in _examples(path):
        words = shlex.split(example.replace("\\\n", " "), comments=True)
        assert words[0] == "quantkit"
        command, rest, called = typer.main.get_command(app), words[1:], []
        while hasattr(command, "commands"):
            command, rest, called = command.commands[rest[0]], rest[1:], called + rest[:1]
        if ">" in rest:
            written.add(rest[rest.index(">") + 1])
            rest = rest[:rest.index(">")]
        names = [value for flag, value in zip(rest, rest[1:]) if flag in RECIPE_OPTIONS]
        names += rest[:1] if called == ["recipes", "show"] else []
        for name in names:
            if name.endswith((".yaml", ".yml")):
                assert name in written, f"{example}: {name} is no earlier example's output"
            else:
                resolved.append(registry.resolve(name))  # RecipeNotFoundError names the close matches
        unknown = [w for w in rest if w.startswith("-") and w != "-" and w.split("=")[0] not in _options(command)]
        assert not unknown, f"{example}: {unknown} are not options of {command.name}"
    assert resolved or path == ("recipes", "list")  # the parsing above found the recipes the examples name
