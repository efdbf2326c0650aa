"""Where a model comes from: a hub id resolved offline from a Hugging Face cache the test lays out itself, with
sharded safetensors (an index file) in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_home(tiny_model_dir, tmp_path_factory) -> Path:
    """HF_HOME with org/tiny cached at main (a commit snapshot, refs/main), its weights in several shards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / COMMIT
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(snapshot, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return home


def _quantkit(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "quantkit.cli.main", *args], env=env, capture_output=True, text=True)


def test_a_hub_id_resolves_offline_from_the_cache_with_sharded_weights(hub_home, tmp_path):
    snapshot = hub_home / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    assert (snapshot / "model.safetensors.index.json").is_file() and len(list(snapshot.glob("*.safetensors"))) > 1
    run = _quantkit(hub_home, "finalize", "org/tiny", str(tmp_path / "out"), "-q", "int8-weight-only", "--quiet")
    assert run.returncode == 0, run.stderr
    info = json.loads((tmp_path / "out" / "quantkit.json").read_text())
    assert info["source"]["path"] == str(snapshot)
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_a_hub_id_missing_from_the_cache_is_a_one_line_usage_error(hub_home, tmp_path):
    run = _quantkit(hub_home, "finalize", "org/absent", str(tmp_path / "out"), "-q", "int8-weight-only")
    assert run.returncode == 2 and not (tmp_path / "out").exists()
    assert "org/absent is neither a directory nor a model in the Hugging Face cache" in run.stderr
    assert "hf download org/absent" in run.stderr and "Traceback" not in run.stderr


def test_an_unknown_revision_is_refused(hub_home, tmp_path):
    run = _quantkit(hub_home, "finalize", "org/tiny", str(tmp_path / "out"), "-q", "int8-weight-only", "--revision", "v9")
    assert run.returncode == 2 and "neither a directory nor a model" in run.stderr
