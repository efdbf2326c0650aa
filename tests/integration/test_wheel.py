"""The wheel carries the recipes and the CLI inside the quantkit namespace, and the installed package finds them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True, capture_output=True,
    )
    (found,) = out.glob("quantkit_llm-*.whl")
    return found


def test_wheel_layout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.name for p in (ROOT / "recipes").rglob("*.yaml"))
    assert sorted(Path(n).name for n in names if n.startswith("quantkit/recipes/") and n.endswith(".yaml")) == shipped
    assert "quantkit/cli/main.py" in names
    sources = {f"quantkit/{p.relative_to(ROOT / 'quantkit')}" for p in (ROOT / "quantkit").rglob("*.py")}
    sources |= {f"quantkit/cli/{p.relative_to(ROOT / 'cli')}" for p in (ROOT / "cli").rglob("*.py")}
    assert not sources - set(names), f"modules missing from the wheel (pyproject's packages): {sorted(sources - set(names))}"
    assert not [n for n in names if n.startswith(("cli/", "recipes/", "tests/", "scripts/"))]


def test_installed_wheel_resolves_recipes_outside_the_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import quantkit, quantkit.quant.registry as r; from quantkit.cli.main import app; "
        "assert quantkit.__file__.startswith(sys.argv[1]), quantkit.__file__; "
        "print(','.join(r.recipe_names())); print(r.resolve('int4-weight-only').source)"
    )
    result = subprocess.run([sys.executable, "-c", code, str(target)], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    names, source = result.stdout.splitlines()
    assert names.split(",") == sorted(p.stem for p in (ROOT / "recipes").rglob("*.yaml"))
    assert source.startswith(str(target))
