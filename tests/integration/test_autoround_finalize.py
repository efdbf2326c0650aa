"""AutoRound end to end on the tiny Llama, a few steps a layer (user recipe files made from the shipped ones): the same
seed writes the same artifact and another seed another one, 1 and 2 ranks write the same artifact, it reloads in
plain transformers with the in-memory model's logits, and the summary has every layer's loss before and after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_text
from same_threads import environment, pinned
from quantkit.finalization.finalize import CalibrationOptions, finalize, prepare, quantize_model
from quantkit.quant import registry
from quantkit.grids import fake_quantize_weight

pytestmark = pytest.mark.integration

STEPS = 10


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("arcalib") / "calib.txt"
    path.write_text(make_text(4000, seed=13))
    return path


def fast_recipe(folder: Path, name: str, **changes) -> Path:
    """The shipped recipe `name` as a user recipe file with STEPS steps a layer (and `changes`, e.g. seed=7)."""
    shipped = registry.resolve(name)
    text = Path(shipped.source).read_text()
    for key, value in {"iters": STEPS, **changes}.items():
        text = text.replace(f"{key}: {getattr(shipped.quantizer.arguments, key)}", f"{key}: {value}")
    path = folder / f"fast-{name}{''.join(f'-{k}{v}' for k, v in changes.items())}.yaml"
    path.write_text(text)
    return path


def _finalize_cli(src, dst, recipe: Path, calib: Path, nproc: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    cmd = [sys.executable, "-m", "quantkit.cli.main", "finalize", str(src), str(dst), "-q", str(recipe), "--calib-data",
           str(calib), "--num-samples", "16", "--seq-len", "32", "--threads", "1", "--quiet", "--nproc-per-node", str(nproc)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**env, "QUANTKIT_DIST_TIMEOUT": "60"})


def test_same_seed_and_one_or_two_ranks_write_the_same_artifact(tiny_model_dir, calib_file, tmp_path):
    """16 samples: 2 batches of 8, one per rank with 2 ranks, each step's 8 dealt out 4 and 4. Each sample's
    gradient is its own backward pass and the sums are float64, so every step's sign, and so the artifact, is
    bit-identical."""
    recipe = fast_recipe(tmp_path, "autoround-w4a16")
    for run, nproc in (("a", 1), ("b", 1), ("two", 2)):
        done = _finalize_cli(tiny_model_dir, tmp_path / run, recipe, calib_file, nproc)
        assert done.returncode == 0, done.stderr[-3000:]
    first = load_file(tmp_path / "a" / "model.safetensors")
    for run in ("b", "two"):
        other = load_file(tmp_path / run / "model.safetensors")
        assert first.keys() == other.keys()
        assert all(torch.equal(first[key], other[key]) for key in first), run
    one, two = (json.loads((tmp_path / run / "quantkit.json").read_text())["calibration"] for run in ("a", "two"))
    assert two["ranks"] == 2
    for layer in one["autoround"]:  # the losses, summed in one order on every rank (seconds_per_step is a timing)
        assert one["autoround"][layer]["loss_tuned"] == two["autoround"][layer]["loss_tuned"]
        # each step's samples were dealt out over the 2 ranks, whichever rank held them
        assert (one["autoround"][layer]["split"], two["autoround"][layer]["split"]) == ("one process", "dealt evenly")
    assert set(one["autoround"]) == {"model.layers.0", "model.layers.1"}
    for layer in one["autoround"].values():
        assert layer["steps"] == STEPS and layer["loss_tuned"] < layer["loss_rtn"]


@pytest.fixture(scope="module")
def artifacts(tiny_model_dir, calib_file, tmp_path_factory):
    """Each recipe (and the w4 one with another seed) quantized in memory and finalized; all reloaded in one plain
    transformers process."""
    root = tmp_path_factory.mktemp("autoround")
    options = CalibrationOptions(data=str(calib_file), num_samples=16, seq_len=32)
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    cases = {"w4": fast_recipe(root, "autoround-w4a16"), "w2": fast_recipe(root, "autoround-w2a16"),
             "w4-seed7": fast_recipe(root, "autoround-w4a16", seed=7)}
    logits = {}
    for case, path in cases.items():
        recipe = registry.resolve(str(path))
        model = quantize_model(prepare(tiny_model_dir, recipe), recipe, calibration=options)
        with torch.no_grad(), pinned():  # the logits compared bit for bit with the reloading process's
            logits[case] = model(ids).logits.float()
        finalize(tiny_model_dir, root / case, recipe, calibration=options)
    save_file({"input_ids": ids}, root / "ids.safetensors")
    script = Path(__file__).with_name("reload_plain.py")
    subprocess.run([sys.executable, str(script), str(root / "ids.safetensors"), str(root), *[str(root / c) for c in cases]],
                   check=True, env=environment())
    return root, logits


@pytest.mark.parametrize("case", ["w4", "w2"])
def test_artifact_reloads_in_plain_transformers_with_learned_rounding(artifacts, tiny_model_dir, case):
    root, logits = artifacts
    reloaded = load_file(root / f"{case}.safetensors")
    torch.testing.assert_close(reloaded["logits"], logits[case], atol=0, rtol=0)
    recipe = registry.resolve("autoround-w4a16" if case == "w4" else "autoround-w2a16")
    source = load_file(tiny_model_dir / "model.safetensors")
    changed = 0
    for entry in (e for e in prepare(tiny_model_dir, recipe).plan if e.quantized):
        rtn = fake_quantize_weight(source[f"{entry.name}.weight"], entry.scheme.weights)
        changed += not torch.equal(reloaded[entry.name], rtn)
    assert changed >= 10  # of 14 Linears: the learned rounding is not round-to-nearest


def test_another_seed_draws_other_samples_and_writes_another_artifact(artifacts):
    root, _ = artifacts
    seven, default = load_file(root / "w4-seed7.safetensors"), load_file(root / "w4.safetensors")
    assert not torch.equal(seven["model.layers.0.mlp.up_proj"], default["model.layers.0.mlp.up_proj"])


def test_two_bit_summary_shows_every_layers_loss_falling(artifacts):
    root, _ = artifacts
    layers = json.loads((root / "w2" / "quantkit.json").read_text())["calibration"]["autoround"]
    assert len(layers) == 2 and all(layer["loss_tuned"] < layer["loss_rtn"] for layer in layers.values())
