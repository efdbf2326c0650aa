"""`quantkit eval MLX_DIR` without mlx: the options an MLX model cannot take refused before anything loads, and the
one line saying what to install where no Python has mlx-lm (tests/engines/test_mlx_lm.py runs it in mlx)."""

import json

import pytest

from quantkit.errors import HardwareError, UsageError
from quantkit.evaluation import mlx as engine
from quantkit.evaluation.artifacts import check_engines, in_engine


@pytest.fixture
def mlx_dir(tmp_path):
    """What `detect` reads of an MLX directory: config.json's quantization, a shard header with scales and biases."""
    import struct

    path = tmp_path / "model-mlx"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 256,
                                                  "quantization": {"group_size": 64, "bits": 4, "mode": "affine"}}))
    header = json.dumps({name: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
                         for name in ("a.weight", "a.scales", "a.biases")}).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    return path


@pytest.fixture
def no_mlx(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTKIT_MLX_PYTHON", str(tmp_path / "no-such-python"))
    engine.mlx_python.cache_clear()
    yield
    engine.mlx_python.cache_clear()


def test_an_mlx_directory_runs_in_its_engine(mlx_dir, tmp_path):
    assert in_engine(str(mlx_dir)) and not in_engine(str(tmp_path))
    assert engine.positions(mlx_dir) == (256, "max_position_embeddings in config.json")


@pytest.mark.parametrize("options, message", [
    (dict(tp=2), "--tp shards transformers models; .* is an MLX model"),
    (dict(max_acc_drop=0.01), "--max-acc-drop gates --tasks scores"),
    (dict(device="cuda"), "runs in mlx, on Apple's GPU or the CPU"),
])
def test_options_an_mlx_model_cannot_take_are_refused_first(mlx_dir, no_mlx, options, message):
    with pytest.raises(UsageError, match=message) as raised:
        check_engines([str(mlx_dir)], **options)
    assert "\n" not in str(raised.value)


def test_without_mlx_one_line_says_what_to_install(mlx_dir, no_mlx):
    with pytest.raises(HardwareError, match=r"needs mlx and mlx-lm, and QUANTKIT_MLX_PYTHON=.* has them: python3 -m venv "
                                            r".*mlx-lm 'mlx\[cpu\]'") as raised:
        check_engines([str(mlx_dir)])
    assert "\n" not in str(raised.value)


def test_the_runner_imports_nothing_of_quantkits():
    import re

    assert not re.search(r"^\s*(import|from) quantkit", engine.RUNNER.read_text(), re.M)
