"""Where a model comes from: a hub id resolved offline from a Hugging Face cache the test lays out itself, with
sharded safetensors (an index file) in it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import HUB_COMMIT as COMMIT
from conftest import hub_snapshot
from conftest import quantkit_offline as _quantkit

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hub_home(tiny_model_dir, tmp_path_factory) -> Path:
    """HF_HOME with org/tiny cached at main (a commit snapshot, refs/main), its weights in several shards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    home = tmp_path_factory.mktemp("hf-home")
    snapshot = hub_snapshot(home, "org/tiny", COMMIT)
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(snapshot, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(snapshot)
    return home


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
    assert run.returncode == 2 and "org/tiny at revision v9 is neither a directory nor a model" in run.stderr
    # the model is there at its default revision: the advice names the revision, and another one
    assert "`hf download org/tiny --revision v9`), or another --revision (the cache holds org/tiny, but not v9)" in run.stderr


def test_max_shard_size_writes_shards_and_an_index_that_load_like_one_file(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.finalization.finalize import finalize
    from quantkit.quant import registry

    recipe = registry.resolve("int4-weight-only")
    finalize(tiny_model_dir, tmp_path / "one", recipe)
    finalize(tiny_model_dir, tmp_path / "shards", recipe, max_shard_size="100KB")
    shards = sorted((tmp_path / "shards").glob("*.safetensors"))
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and set(index["weight_map"].values()) == {s.name for s in shards}
    assert all(s.stat().st_size <= 100_000 * 1.5 for s in shards)  # one tensor may overshoot, as in transformers
    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    logits = [AutoModelForCausalLM.from_pretrained(tmp_path / d)(ids).logits for d in ("one", "shards")]
    assert torch.equal(*logits)


def test_a_bad_shard_size_is_refused_before_any_work(tiny_model_dir, tmp_path):
    run = _quantkit(tmp_path, "finalize", str(tiny_model_dir), str(tmp_path / "out"), "-q", "int4-weight-only",
                    "--max-shard-size", "lots")
    assert run.returncode == 2 and "write it like 5GB" in run.stderr and not (tmp_path / "out").exists()
