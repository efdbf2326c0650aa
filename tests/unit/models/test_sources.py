"""Sources: model directories checked (safetensors headers included) and sizes parsed, without torch."""

import pytest

from quantkit.errors import SourceModelError
from quantkit.models import sources


def test_check_model_dir_says_what_is_missing(tmp_path):
    with pytest.raises(SourceModelError, match="does not exist"):
        sources.check_model_dir(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(SourceModelError, match="is a file"):
        sources.check_model_dir(tmp_path / "file")
    with pytest.raises(SourceModelError, match="no config.json"):
        sources.check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SourceModelError, match="no \\*.safetensors"):
        sources.check_model_dir(tmp_path)
    (tmp_path / "checkpoints").mkdir()  # a training run's output directory (train writes its config.json there)
    with pytest.raises(SourceModelError, match=f"training run's output directory; pass its model, {tmp_path / 'final'}"):
        sources.check_model_dir(tmp_path)


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("1.5gb", 1_500_000_000),
                                        ("1000", 1000)])
def test_parse_size(text, size):
    assert sources.parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "5XB", "0GB", "-1MB", ""])
def test_parse_size_refuses_what_is_not_a_size(text):
    from quantkit.errors import UsageError

    with pytest.raises(UsageError, match="write it like 5GB"):
        sources.parse_size(text)


def test_a_truncated_or_foreign_safetensors_file_is_named(tiny_model_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    weights = next(copy.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(SourceModelError, match=r"model.safetensors is truncated .*download or save it again"):
        sources.check_model_dir(copy)
    weights.write_bytes(b"not a safetensors file at all")
    with pytest.raises(SourceModelError, match="is not a readable safetensors file"):
        sources.check_model_dir(copy)


def test_sources_import_no_torch():
    import subprocess
    import sys

    code = "import sys, quantkit.models.sources; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
