"""The seams, checked by reading the code: an algorithm is named only by its own modules (its object, its math, its
calibration step) and the registration; everything else asks the object (docs/ARCHITECTURE.md, "Adding things")."""

import ast
import re
from pathlib import Path

from quantkit import algorithms

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [*(ROOT / "quantkit").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]
ALGORITHMS = ROOT / "quantkit" / "algorithms"
STEPS = ROOT / "quantkit" / "calibration" / "steps"


def _strings_and_names(path: Path) -> list[str]:
    """String constants (docstrings left out: prose may name an algorithm) and identifiers of a module's code."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.append(node.value)
        elif isinstance(node, ast.Attribute):
            found.append(node.attr)
        elif isinstance(node, ast.Name):
            found.append(node.id)
    return found


def _owns(path: Path, name: str) -> bool:
    """The algorithm's own modules: under algorithms/ (its object and its math), and its calibration step."""
    return path.is_relative_to(ALGORITHMS) or path == STEPS / f"{name}.py"


def test_no_module_outside_an_algorithms_own_names_it():
    names = algorithms.names()
    pattern = re.compile(r"^(%s)$" % "|".join(names), re.IGNORECASE)
    offenders = {}
    for path in SOURCES:
        for name in names:
            hits = [s for s in _strings_and_names(path) if pattern.match(s) and s.lower() == name]
            if hits and not _owns(path, name):
                offenders.setdefault(str(path.relative_to(ROOT)), set()).update(hits)
    assert not offenders, offenders


def test_no_module_branches_on_an_algorithm_enum_or_name_attribute():
    """The old ways of asking "which algorithm is this": an enum member, or comparing a step's name."""
    bad = re.compile(r"Algorithm\.[A-Z]{2,}|\.name (is|==|!=|in) |is_quantizer")
    offenders = [str(p.relative_to(ROOT)) for p in SOURCES if not p.is_relative_to(ALGORITHMS)
                 for line in p.read_text().splitlines() if bad.search(line) and "step" in line.lower()]
    assert not offenders, offenders


def test_exporters_import_nothing_from_algorithms():
    for path in (ROOT / "quantkit" / "export").rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
        imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        imported += [f"{node.module}.{alias.name}" for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module for alias in node.names]
        assert not [m for m in imported if m.startswith("quantkit.algorithms")], path


def test_every_algorithm_is_registered_once_in_one_list():
    """The registration is `algorithms.METHODS`: each name there is one module under methods/ and one object."""
    modules = {p.stem for p in (ALGORITHMS / "methods").glob("*.py")} - {"__init__"}
    assert set(algorithms.METHODS) == modules and len(algorithms.METHODS) == len(set(algorithms.METHODS))
    assert sorted(algorithms.names()) == sorted(algorithms.METHODS)


GRID_MODULES = set((ROOT / "quantkit" / "grids").glob("*.py"))  # the grid layer, one package
# How a grid family's kind is asked: its predicates, a block grid's parameters and search, the families themselves.
GRID_KIND = re.compile(r"\b(k_quant_type|is_float_grid|has_fp16_minimum|has_signed_step|KQParams|K_PARTS|"
                       r"choose_k_qparams|round_k|quantize_k|k_grids|iq_grids|IQ4Params|FLOAT_GRID|INTEGER_GRID|K_GRID)\b")
# Where a grid kind may still be named: the grid modules; the formats, which store each kind their own way (export/);
# the recipe checks that a llama.cpp mixture's base type is its scheme's (registry, gguf_mixtures).
KIND_ALLOWED = GRID_MODULES | {ROOT / "quantkit" / "quant" / "registry.py", ROOT / "quantkit" / "quant" / "gguf_mixtures.py"}


def test_no_grid_kind_branches_outside_the_grid_modules():
    """Algorithms, calibration, QAT, finalize, the preflight and the CLI ask a spec's family (`grids.family_of`)."""
    offenders = {}
    for path in SOURCES:
        if path in KIND_ALLOWED or path.is_relative_to(ROOT / "quantkit" / "export"):
            continue
        hits = {s for s in _strings_and_names(path) if GRID_KIND.fullmatch(s)}
        if hits:
            offenders[str(path.relative_to(ROOT))] = hits
    assert not offenders, offenders
