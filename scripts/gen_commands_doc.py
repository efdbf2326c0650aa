"""docs/commands.md: every command and option of `quantkit`, generated from the typer app so that it cannot drift.

    python scripts/gen_commands_doc.py > docs/commands.md    # after changing a command, an option or an example
    python scripts/gen_commands_doc.py --check               # exit 1 when docs/commands.md is stale

tests/cli/test_commands_doc.py fails when the file is stale. Names, defaults and help come from click's parameters,
types, choices and ranges from the commands' annotations, the examples from each command's epilog; nothing from
rendered help, so the text depends neither on the terminal's width nor on how a typer release draws its panels.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import typing
from enum import Enum
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, Iterator

DOC = Path(__file__).resolve().parents[1] / "docs" / "commands.md"
REGENERATE = "python scripts/gen_commands_doc.py > docs/commands.md"
TYPES = {int: "integer", float: "number", str: "text", Path: "path"}


def leaf_commands(group, path: str = "quantkit") -> Iterator[tuple[str, Any]]:
    """(`quantkit recipes list`, its click command) for every command, sub-groups walked, in registration order."""
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from leaf_commands(command, f"{path} {name}")
        else:
            yield f"{path} {name}", command


def plain(text: str) -> str:
    """Help as the terminal shows it: rich markup (typer's markup mode) removed, `\\[` unescaped."""
    from rich.text import Text

    return Text.from_markup(text).plain


def cell(text: str) -> str:
    """Text in a Markdown table cell: one line, its pipes and asterisks (`*.safetensors`) escaped."""
    return text.replace("\n", " ").replace("|", "\\|").replace("*", "\\*")


def annotation(hint: Any) -> tuple[Any, list]:
    """The value type under Annotated / Optional / list, and the Annotated metadata (typer's OptionInfo)."""
    metadata = list(getattr(hint, "__metadata__", ()))
    if metadata:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) in (typing.Union, UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not NoneType]
    if typing.get_origin(hint) is list:
        (hint,) = typing.get_args(hint)
    return hint, metadata


def type_text(param, hint: Any) -> str:
    """`integer ≥ 1`, `` `auto` | `cpu` ``, `flag`, `text, repeatable`: from the annotation (and a declared metavar)."""
    base, metadata = annotation(hint)
    if param.metavar:
        text = f"`{param.metavar}`"
    elif isinstance(base, type) and issubclass(base, Enum):
        text = " | ".join(f"`{member.value}`" for member in base)
    elif base is bool:
        text = "flag"
    else:
        text = TYPES[base]
    for info in metadata:
        low, high = getattr(info, "min", None), getattr(info, "max", None)
        text += f" ≥ {low}" if low is not None else ""
        text += f" ≤ {high}" if high is not None else ""
    return text + (", repeatable" if param.multiple else "")


def default_text(param) -> str:
    if param.required:
        return "required"
    value = param.default
    if value is None or value == []:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value.value if isinstance(value, Enum) else value}`"


def names_text(param) -> str:
    if param.param_type_name == "argument":
        return f"`{param.name.upper()}`" + ("..." if param.nargs == -1 else "")
    return ", ".join(f"`{name}`" for name in [*param.opts, *param.secondary_opts])


def usage(path: str, command) -> str:
    arguments = []
    for param in command.params:
        if param.param_type_name == "argument":
            name = param.name.upper() + ("..." if param.nargs == -1 else "")
            arguments.append(name if param.required else f"[{name}]")
    return " ".join([path, "[OPTIONS]", *arguments])


def paragraphs(text: str) -> list[str]:
    return [" ".join(p.split("\n")) for p in inspect.cleandoc(text).split("\n\n") if p.strip()]


def section(path: str, command) -> list[str]:
    hints = typing.get_type_hints(inspect.unwrap(command.callback), include_extras=True)
    lines = [f"## `{path}`", "", "```", usage(path, command), "```", ""]
    for paragraph in paragraphs(plain(command.help or "")):
        lines += [paragraph, ""]
    if command.epilog:  # "Examples:", then one command a paragraph (a long one continued with a backslash)
        title, *examples = command.epilog.strip().split("\n\n")
        lines += [f"**{title.rstrip(':')}**", "", "```bash", *examples, "```", ""]
    lines += ["| argument / option | type | default | description |", "|---|---|---|---|"]
    for param in command.params:
        if not getattr(param, "hidden", False):
            row = (names_text(param), type_text(param, hints[param.name]), default_text(param), plain(param.help or ""))
            lines.append("| " + " | ".join(cell(text) for text in row) + " |")
    return lines + [""]


def render() -> str:
    """docs/commands.md's text."""
    import typer.main

    from quantkit.cli.main import app

    root = typer.main.get_command(app)
    commands = list(leaf_commands(root))
    lines = [
        "# quantkit commands", "",
        "Every command and option, generated from the CLI by `scripts/gen_commands_doc.py`: do not edit by hand. "
        f"After changing a command, an option or an example, run `{REGENERATE}` "
        "(`--check` says whether the file is current; `tests/cli/test_commands_doc.py` fails while it is not). "
        "Each command's `--help` says the same.", "",
        plain(root.help or ""), "",
        "| option of `quantkit` itself | description |", "|---|---|",
        *(f"| {cell(names_text(param))} | {cell(plain(param.help or ''))} |" for param in root.params),
        "",
        "| command | what it does |", "|---|---|",
    ]
    for path, command in commands:
        anchor = path.replace(" ", "-")
        lines.append(f"| [`{path}`](#{anchor}) | {cell(paragraphs(plain(command.help or ''))[0])} |")
    lines.append("")
    for path, command in commands:
        lines += section(path, command)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print docs/commands.md, generated from the quantkit CLI.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/commands.md differs from what would be printed")
    args = parser.parse_args(argv)
    text = render()
    if not args.check:
        sys.stdout.write(text)
        return 0
    if DOC.exists() and DOC.read_text() == text:
        return 0
    print(f"docs/commands.md is stale: run `{REGENERATE}`", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
