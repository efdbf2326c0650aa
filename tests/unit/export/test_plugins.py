"""A format is a plug-in: a `Format` member, its `Registration` in `export.FORMATS`, and one module in export/ that
defines what `Exporter` requires and the `Hooks` it needs; nothing outside export/ branches on the format."""

import ast
import inspect
from pathlib import Path

import pytest

from quantkit import export
from quantkit.errors import UsageError
from quantkit.export import FORMATS, Exporter, Hooks, exporter
from quantkit.finalization import preflight
from quantkit.finalization.checks import prepare
from quantkit.quant import registry
from quantkit.quant.registry import Format

ROOT = Path(__file__).resolve().parents[3]
REQUIRED = [name for name, _ in inspect.getmembers(Exporter, inspect.isfunction) if not name.startswith("_")]
HOOKS = [name for name in vars(Hooks) if not name.startswith("_")]


@pytest.mark.parametrize("fmt", list(Format))
def test_every_format_is_registered_and_defines_what_exporter_requires(fmt):
    module = exporter(fmt).module
    assert FORMATS[fmt].module == module.__name__.rsplit(".", 1)[1]
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    assert not missing, f"{module.__name__} lacks {missing}"


@pytest.mark.parametrize("fmt", list(Format))
def test_a_hook_a_format_defines_is_the_formats_and_the_rest_are_the_defaults(fmt):
    plugin, module = exporter(fmt), exporter(fmt).module
    for name in HOOKS:
        own = getattr(module, name, None)
        assert getattr(plugin, name) is (own if own is not None else getattr(Hooks, name)), name
        if callable(own) and callable(getattr(Hooks, name)) and not inspect.isclass(own):  # the same call shape
            assert list(inspect.signature(own).parameters) == list(inspect.signature(getattr(Hooks, name)).parameters), name


def test_the_hooks_in_use_are_the_formats_own():
    assert exporter(Format.GGUF).StreamWriter is export.gguf.StreamWriter
    assert exporter(Format.COMPRESSED_TENSORS).StreamWriter is export.compressed_tensors.StreamWriter
    assert exporter(Format.TORCHAO).StreamWriter is None  # loaded whole: transformers converts while loading
    recipe = registry.resolve("gguf-q4-k-m")
    assert [s.name for s in exporter(Format.GGUF).qat_recipe(recipe).steps] == ["rtn"]
    assert exporter(Format.COMPRESSED_TENSORS).qat_recipe(recipe) is recipe


def test_nothing_outside_export_names_a_format_member():
    """Checks, preflight, QAT and the writers ask the plug-in; they do not branch on Format.X."""
    members = {f.name for f in Format}
    found = []
    for path in [*(ROOT / "quantkit").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]:
        if "export" in path.relative_to(ROOT).parts or path.name == "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in members and getattr(node.value, "id", getattr(node.value, "attr", None)) == "Format":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} Format.{node.attr}")
    assert found == ["cli/recipes.py:32 Format.COMPRESSED_TENSORS"], found  # `recipes list`'s abbreviation, display only


def test_the_clis_format_choices_are_the_registered_formats():
    from typer.testing import CliRunner

    from quantkit.cli.main import app

    shown = CliRunner().invoke(app, ["finalize", "--help"], env={"COLUMNS": "400"}).output
    assert "<" + "|".join(fmt.value for fmt in Format) + ">" in shown


@pytest.mark.parametrize("dst, fmt, message", [
    ("out", Format.GGUF, r"a GGUF artifact is one file: name DST with .gguf \(e.g. out.gguf\)"),
    ("out.gguf", Format.COMPRESSED_TENSORS, "out.gguf ends in .gguf but the format is compressed-tensors: pass --format gguf"),
    ("out.gguf", Format.TORCHAO, "pass --format gguf"),
])
def test_a_destination_named_for_another_format_is_refused(dst, fmt, message):
    with pytest.raises(UsageError, match=message):
        export.check_destination_name(Path(dst), fmt)
    for fine in ("out.gguf", "out", "out.v2"):
        if (Path(fine).suffix == ".gguf") == (fmt is Format.GGUF):
            export.check_destination_name(Path(fine), fmt)


@pytest.mark.parametrize("fmt, recipe", [(Format.GGUF, "gguf-q4-0"), (Format.COMPRESSED_TENSORS, "int4-weight-only"),
                                         (Format.TORCHAO, "int4-weight-only")])
def test_the_preflight_of_a_whole_model_estimates_every_format(tiny_model_dir, fmt, recipe):
    """The whole-model RAM estimate reads the format's LOAD_AND_WRITE_COPIES (GGUF had none: a KeyError)."""
    prepared = prepare(tiny_model_dir, registry.resolve(recipe), fmt, in_memory=True)
    report = preflight.estimate(prepared, prepared.recipe, None, 1, None)
    held = report["peak_ram_breakdown"]["model and its transient copy while loading and writing"]
    assert held == int(exporter(fmt).LOAD_AND_WRITE_COPIES * report["model_bytes"]) > 0
