"""The `quantkit` app: commands, and the one mapping from library errors to messages and exit codes.

Exit codes: 0 ok, 1 runtime failure, 2 usage error, 3 accuracy gate failed. QUANTKIT_DEBUG=1 shows tracebacks.
"""

from __future__ import annotations

import functools
import sys
from typing import Annotated, Callable

import typer
from typer.core import TyperCommand, TyperGroup

from quantkit.cli import eval as eval_cmd
from quantkit.cli import finalize as finalize_cmd
from quantkit.cli import interrupts
from quantkit.cli import recipes as recipes_cmd
from quantkit.cli import train as train_cmd
from quantkit.cli.console import err
from quantkit.errors import interrupt_exit_code
from quantkit.runtime.environment import advise_huge_pages, configure_cuda_allocator, debug_enabled


def plain_flag(param):
    """A flag shown with no value after it (`--quiet`): typer 0.29 writes `--quiet <bool>`, and `--quiet true` is
    refused. An empty metavar takes the type's place there; typer 0.28 and click show a flag's metavar nowhere."""
    if param is not None and getattr(param, "is_flag", False) and param.metavar is None:
        param.metavar = ""
    return param


class PlainFlags:
    """Help that shows flags as flags (`plain_flag`), `--help` included: mixed into typer's command and group."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for param in self.params:
            plain_flag(param)

    def get_help_option(self, ctx):
        return plain_flag(super().get_help_option(ctx))


class Group(PlainFlags, TyperGroup):
    """`quantkit --help` and `quantkit recipes --help`."""


class Command(PlainFlags, TyperCommand):
    """A command's help as docs/commands.md writes it, on every typer pyproject allows, through click's own hooks
    (a parameter's metavar, `collect_usage_pieces`): flags shown as flags, and the usage line naming the arguments
    in capitals (`finalize [OPTIONS] SRC DST`, `eval [OPTIONS] MODELS...`) where typer writes `{src} {dst}`."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = (param.metavar or param.name.upper()) + ("..." if param.nargs == -1 else "")
                pieces.append(name if param.required else f"[{name}]")
        return pieces


app = typer.Typer(
    cls=Group,
    name="quantkit",
    help="Make language models smaller and faster by quantization: train (QAT), finalize (PTQ / convert), evaluate, list recipes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def handle_errors(fn: Callable) -> Callable:
    """Library errors become one line on stderr and their exit code; nothing else leaks a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from rich.markup import escape

        from quantkit.errors import QuantkitError

        try:
            return fn(*args, **kwargs)
        except QuantkitError as exc:
            if debug_enabled():
                raise
            # escaped: a message's own brackets ("quantkit-llm[tasks]", a path) are text, not rich markup
            interrupts.say(f"[red]error:[/red] {escape(str(exc))}")
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (`errors.Terminated`)
            interrupts.say("interrupted; nothing was written")
            raise typer.Exit(interrupt_exit_code(exc)) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:  # a failure we did not anticipate: still one line, exit 1
            if debug_enabled():
                raise
            interrupts.say(f"[red]error:[/red] {type(exc).__name__}: {escape(str(exc))} (set QUANTKIT_DEBUG=1 for the traceback)")
            raise typer.Exit(1) from None

    return wrapper


def show_version(value: bool) -> None:
    if value:
        from quantkit.export.metadata import version_line  # no torch: versions come from package metadata

        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=show_version,
                                          help="Print quantkit's version and the versions of the libraries it writes with "
                                               "(as quantkit.json records them), then exit.")] = False,
) -> None:
    """The options of `quantkit` itself, before any command."""


# Each command's examples end its --help (epilog) and docs/commands.md (scripts/gen_commands_doc.py)
app.command("train", cls=Command, no_args_is_help=True, epilog=train_cmd.EXAMPLES)(handle_errors(train_cmd.train))
app.command("finalize", cls=Command, no_args_is_help=True, epilog=finalize_cmd.EXAMPLES)(handle_errors(finalize_cmd.finalize))
app.command("eval", cls=Command, no_args_is_help=True, epilog=eval_cmd.EXAMPLES)(handle_errors(eval_cmd.evaluate))
recipes_app = typer.Typer(cls=Group, help="List and inspect quantization recipes.", no_args_is_help=True)
recipes_app.command("list", cls=Command, epilog=recipes_cmd.LIST_EXAMPLES)(handle_errors(recipes_cmd.list_recipes))
recipes_app.command("show", cls=Command, epilog=recipes_cmd.SHOW_EXAMPLES)(handle_errors(recipes_cmd.show))
app.add_typer(recipes_app, name="recipes")


def main() -> None:
    """Run the app. A usage error (unknown option, value out of range, missing argument) is one line on stderr
    and exit 2, like every other user mistake; typer's own display would be a multi-line panel."""
    if not interrupts.follow_launcher():  # a rank whose launcher died before it started
        sys.exit(143)
    interrupts.install()  # SIGTERM stops a run as Ctrl-C does
    advise_huge_pages()  # before torch's first CPU allocation, which reads it
    configure_cuda_allocator()  # and its first CUDA allocation
    try:
        code = app(standalone_mode=False)
    except typer.TyperException as exc:  # typer's public base of its (vendored) click usage errors
        if type(exc).__name__ == "NoArgsIsHelpError":  # `quantkit finalize` alone: its help, as before
            exc.show()
        else:
            ctx = getattr(exc, "ctx", None)
            where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            err.print(f"[red]error:[/red] {exc.format_message()}{where}", highlight=False, soft_wrap=True)
        code = getattr(exc, "exit_code", 2)
    except typer.Abort as exc:  # an interrupt outside a command's own handling (click's: while parsing)
        interrupts.say("interrupted; nothing was written")
        code = interrupt_exit_code(exc.__cause__) if isinstance(exc.__cause__, KeyboardInterrupt) else 130
    sys.exit(code if isinstance(code, int) else 0)


def run() -> None:
    """The `quantkit` command (and `python -m quantkit.cli.main`, as torchrun starts each rank): `main()`, then the
    process ends without tearing the interpreter down. Finalizing the modules torch, transformers and torchao
    load takes 1.4 s of CPU after the work is done (measured: importing them and exiting, 4.60 s through
    sys.exit vs 3.22 s), once in every process: each rank, and the launcher waiting for them. The command has
    written and flushed everything by then; standard output, standard error and logging are flushed here. An
    exception other than SystemExit (QUANTKIT_DEBUG=1's traceback) leaves the ordinary way."""
    import logging
    import os

    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or file: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
