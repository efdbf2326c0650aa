"""The package's shape, checked: no import cycles, layers that import only downward, a thin CLI, and module
names of one architecture in one module only (docs/ARCHITECTURE.md says why)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"quantkit": ROOT / "quantkit", "quantkit.cli": ROOT / "cli"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(name: str, module_level_only: bool = False) -> set[str]:
    """The quantkit modules `name` imports (any nesting, or only at module level)."""
    tree = ast.parse(MODULES[name].read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        found |= {_module_of(t) for t in targets if t.startswith("quantkit")}
    return found - {None, name}


def _module_of(target: str) -> str | None:
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _graph() -> dict[str, set[str]]:
    """Import edges, without the edges from a module to the packages that contain it (Python runs a package's
    __init__ before its submodules anyway: that is nesting, not a dependency)."""
    return {name: {t for t in _imports(name) if not name.startswith(t + ".")} for name in MODULES}


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(node, path):
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


GRID = ("quantkit.grids",)  # the grid layer: one package, one floor


# docs/ARCHITECTURE.md's layers, top to bottom: a module imports only from its own layer and those below it, at
# any nesting (an import inside a function is as much a dependency). "=name" is that module alone, not its package.
LAYERS = [
    ("quantkit.cli",),
    ("=quantkit",),  # the Python API (quantkit/__init__.py): nothing inside the package imports it
    ("quantkit.training",),
    ("quantkit.evaluation", "quantkit.budget"),  # budget: `finalize --target-bpw`, above the finalize it plans for
    ("quantkit.finalization",),
    ("quantkit.calibration",),
    ("quantkit.export",),
    ("quantkit.quant",),  # what a recipe makes of a model: registry, plan, rotations, fake quantizers, ... (one floor)
    ("quantkit.models", "quantkit.algorithms", "quantkit.data"),
    GRID,  # the grid: schemes, qparams, the families (integer, float, K-quants, i-quants), GGML blocks
    ("quantkit.runtime",),
    ("quantkit.errors", "quantkit.version"),
]
# The upward imports there are, each with its reason (the test fails on a new one, and on one no longer made).
UPWARD = {
    ("quantkit.models.loading", "quantkit.export"): "load_model loads artifacts for eval too, through their format's reader",
}


def _layer(module: str) -> int:
    found = [(len(name), i) for i, names in enumerate(LAYERS) for name in names
             if (module == name[1:] if name.startswith("=") else module == name or module.startswith(name + "."))]
    assert found, f"{module} is in no layer of LAYERS: add it"
    return max(found)[1]


def test_every_module_imports_only_its_layer_and_below():
    upward = {(name, target) for name, targets in _graph().items() for target in targets
              if _layer(target) < _layer(name)}
    assert upward - UPWARD.keys() == set(), sorted(upward - UPWARD.keys())
    assert UPWARD.keys() - upward == set(), f"no longer imported upward, drop from UPWARD: {sorted(UPWARD.keys() - upward)}"


def test_exporters_never_quantize():
    """export/ imports nothing of the algorithms (it asks a recipe step's object), nor calibration."""
    for name in MODULES:
        if name.startswith("quantkit.export"):
            bad = {t for t in _imports(name) if t.startswith(("quantkit.algorithms.", "quantkit.calibration"))}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_algorithms_import_no_recipes_calibration_or_export():
    for name in MODULES:
        if name.startswith("quantkit.algorithms"):
            bad = {t for t in _imports(name) if t.startswith(("quantkit.quant.registry", "quantkit.calibration", "quantkit.export"))}
            assert not bad, f"{name} imports {sorted(bad)}"


@pytest.mark.parametrize("packages, allowed, module_level_only", [
    (("quantkit.runtime",), ("quantkit.errors", "quantkit.runtime"), False),
    (GRID, ("quantkit.errors", "quantkit.runtime", *GRID), False),
    (("quantkit.algorithms",), ("quantkit.errors", "quantkit.runtime", "quantkit.algorithms", *GRID), False),
    (("quantkit.models",), ("quantkit.errors", "quantkit.runtime", "quantkit.models"), True),
])
def test_the_lower_packages_import_only_below_them(packages, allowed, module_level_only):
    """docs/ARCHITECTURE.md's layering: runtime at the bottom, then the grid layer, algorithms, models."""
    for name in MODULES:
        if name.startswith(packages) and name not in ("quantkit", "quantkit.cli"):
            bad = {t for t in _imports(name, module_level_only)
                   if not any(t == a or t.startswith(a + ".") for a in allowed)}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_the_cli_imports_no_torch_at_module_level():
    code = "import sys, quantkit.cli.main; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("command", ["finalize", "train", "eval", "recipes"])
def test_command_modules_read_no_environment(command):
    source = MODULES[f"quantkit.cli.{command}"].read_text()
    assert not re.search(r"\bos\.environ\b|\bgetenv\b", source)


LAYER_NAMES = re.compile(r"\b(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|input_layernorm|"
                         r"post_attention_layernorm|self_attn)\b")


def _code_strings(path: Path) -> list[str]:
    """String constants of a module, docstrings left out (prose may name modules)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_layer_module_names_live_in_the_architecture_module_only():
    offenders = {name: hits for name, path in MODULES.items() if name != "quantkit.models.architectures"
                 for hits in [[s for s in _code_strings(path) if LAYER_NAMES.search(s) or s == "mlp"]] if hits}
    assert not offenders, offenders


def test_test_modules_have_unique_names():
    """pytest imports test modules by basename (rootdir-relative, no packages): two test_x.py would collide."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
