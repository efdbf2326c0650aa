"""The request check (`finalization.request`): the refusals the command line and the recipe decide, torch-free,
shared by the CLI (before torch loads) and `prepare` (the Python API)."""

import subprocess
import sys

import pytest

from quantkit.errors import DestinationExistsError, UsageError
from quantkit.finalization import checks
from quantkit.finalization.request import Request, check_request
from quantkit.quant import registry


def _request(tmp_path, **fields) -> Request:
    recipe = registry.resolve(fields.pop("recipe", "int4-weight-only"))
    return Request(src=tmp_path / "src", recipe=recipe, fmt=fields.pop("fmt", recipe.format), **fields)


def test_it_imports_no_torch():
    code = "import sys, quantkit.finalization.request; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("fields, error, says", [
    ({"dst": "out.gguf"}, UsageError, "compressed-tensors: pass --format gguf"),
    ({"recipe": "gguf-q4-0", "dst": "out"}, UsageError, "name DST with .gguf"),
    ({"recipe": "gguf-q4-0", "dst": "out.gguf", "max_shard_size": "1GB"}, UsageError, "drop --max-shard-size"),
    ({"dtype": "float64"}, UsageError, "--dtype float64: use one of"),
    ({"dst": "", "overwrite": True}, DestinationExistsError, "holds the source model"),
])
def test_what_the_request_alone_decides_is_refused_in_one_line(tmp_path, fields, error, says):
    (tmp_path / "src").mkdir()
    if "dst" in fields:
        fields["dst"] = tmp_path / fields["dst"]
    with pytest.raises(error, match=says) as raised:
        check_request(_request(tmp_path, **fields))
    assert "\n" not in str(raised.value)


def test_an_existing_destination_needs_overwrite(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "out").mkdir()
    with pytest.raises(DestinationExistsError):
        check_request(_request(tmp_path, dst=tmp_path / "out"))
    assert check_request(_request(tmp_path, dst=tmp_path / "out", overwrite=True, max_shard_size="2GB")) == 2 * 10 ** 9


def test_prepare_makes_the_same_check(tiny_model_dir, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(checks, "check_request", lambda request: seen.append(request) or None)
    checks.prepare(tiny_model_dir, registry.resolve("int4-weight-only"), dst=tmp_path / "out", dtype="bfloat16")
    assert [(r.dst, r.dtype) for r in seen] == [(tmp_path / "out", "bfloat16")]
