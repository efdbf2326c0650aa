"""`quantkit --version`: quantkit's version and the libraries quantkit.json records, from package metadata alone."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata as importlib_metadata

from typer.testing import CliRunner

from quantkit.cli.main import app
from quantkit.export import metadata
import quantkit


def test_version_prints_quantkit_and_the_libraries_quantkit_json_records():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    found = metadata.versions()  # what quantkit.json's `versions` holds
    expected = (f"quantkit {quantkit.__version__} (torch {found['torch']}, transformers {found['transformers']}, "
                f"compressed-tensors {found['compressed-tensors']}, torchao {found['torchao']}, "
                f"safetensors {found['safetensors']})")
    assert result.output == expected + "\n"
    assert found["torch"] == importlib_metadata.version("torch")


def test_version_is_eager_and_imports_no_torch():
    """Before any command (`--version finalize` still only prints it), through the console entry point, without
    torch: it answers in a fraction of a second."""
    code = ("import sys; sys.argv = ['quantkit', '--version', 'finalize']\n"
            "from quantkit.cli.main import main\n"
            "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
            "sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"quantkit {quantkit.__version__} (torch ") and done.stderr == ""


def test_unknown_package_reads_not_installed(monkeypatch):
    def missing(name):
        raise importlib_metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata.importlib_metadata, "version", missing)
    assert metadata.version_line() == (f"quantkit {quantkit.__version__} (torch not installed, transformers not installed, "
                                       "compressed-tensors not installed, torchao not installed, safetensors not installed)")
