"""Resumable finalize: a calibrated run killed with SIGKILL after a random layer, resumed with --resume, writes
the artifact an uninterrupted run writes, tensor for tensor (1 and 2 processes); mismatched or missing runs
are refused in one line."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_text

pytestmark = pytest.mark.integration

LAYERS = 5
RUNNER = str(Path(__file__).with_name("signalled_at_layer.py"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from quantkit.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("resume") / "llama5", make_text(3000), num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("resume-data") / "calib.txt"
    path.write_text(make_text(4000, seed=5))
    return path


def run(src, dst, recipe, calib, *extra, nproc=1, kill_layer=None, kill_rank=0, signal="SIGKILL"):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["QUANTKIT_DIST_TIMEOUT"] = "60"
    args = ["finalize", str(src), str(dst), "-q", recipe, "--calib-data", str(calib), "--num-samples", "16",
            "--seq-len", "32", "--threads", "1", "--quiet", *extra]
    if kill_layer is not None and signal == "SIGKILL" and "--checkpoint-every" not in extra:
        args += ["--checkpoint-every", "0"]  # a kill loses what was not checkpointed: checkpoint every layer
    if kill_layer is None:
        cmd = [sys.executable, "-m", "quantkit.cli.main", *args] + (["--nproc-per-node", str(nproc)] if nproc > 1 else [])
    else:
        env.update(QUANTKIT_TEST_KILL_LAYER=str(kill_layer), QUANTKIT_TEST_KILL_RANK=str(kill_rank), QUANTKIT_TEST_SIGNAL=signal)
        launcher = (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                     f"--log-dir={Path(dst).parent}-torchrun-logs"] if nproc > 1 else [])  # beside the test's directory
        cmd = [sys.executable, *launcher, RUNNER, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def assert_same_artifact(a: Path, b: Path) -> None:
    one, two = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert one.keys() == two.keys()
    for key in one:
        assert one[key].dtype == two[key].dtype and torch.equal(one[key], two[key]), key
    info_a, info_b = (json.loads((d / "quantkit.json").read_text()) for d in (a, b))
    assert info_a["calibration"]["relative_error"] == info_b["calibration"]["relative_error"]
    assert info_a["calibration"]["kv_cache"] == info_b["calibration"]["kv_cache"]


@pytest.mark.parametrize("recipe,nproc,extra", [("gptq-w4a16", 1, ()), ("smoothquant-w8a8", 1, ("--kv-cache", "fp8")),
                                                ("awq-w4a16", 2, ())])
def test_a_run_killed_after_a_random_layer_resumes_to_the_same_artifact(model_dir, calib, tmp_path, recipe, nproc, extra):
    """(With a KV cache: the finished layers' KV scales are saved and restored too.)"""
    whole = run(model_dir, tmp_path / "whole", recipe, calib, *extra, nproc=nproc)
    assert whole.returncode == 0, whole.stderr[-2000:]
    layer = random.randrange(LAYERS - 1)  # killed after this layer; the next ones run in the resumed process
    kill_rank = random.randrange(nproc)
    killed = run(model_dir, tmp_path / "out", recipe, calib, *extra, nproc=nproc, kill_layer=layer, kill_rank=kill_rank)
    assert killed.returncode != 0, f"not killed after layer {layer}"
    assert not (tmp_path / "out").exists()
    state = json.loads((tmp_path / "out.partial" / "state.json").read_text())
    assert state["completed"] == layer + 1 and state["layers"] == LAYERS

    again = run(model_dir, tmp_path / "out", recipe, calib, *extra)
    assert again.returncode == 2 and "pass --resume to continue it" in again.stderr  # never silently discarded

    resumed = run(model_dir, tmp_path / "out", recipe, calib, *extra, "--resume", nproc=nproc)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_artifact(tmp_path / "whole", tmp_path / "out")
    assert not (tmp_path / "out.partial").exists(), "a finished run removes its work directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "whole"]


@pytest.mark.parametrize("recipe", ["gptq-w4a16", "autoround-w4a16"])
def test_ctrl_c_keeps_the_finished_layers_and_says_how_to_resume(model_dir, calib, tmp_path, recipe):
    """With the default interval no checkpoint is due yet: Ctrl-C saves the last finished layer's (AutoRound: with
    the float model's hidden states), and the resumed artifact is the uninterrupted one."""
    whole = run(model_dir, tmp_path / "whole", recipe, calib)
    assert whole.returncode == 0, whole.stderr[-2000:]
    stopped = run(model_dir, tmp_path / "out", recipe, calib, kill_layer=1, signal="SIGINT")
    assert stopped.returncode == 130
    assert stopped.stderr.strip().splitlines() == [
        f"error: interrupted after 2 finished layers, saved in {tmp_path / 'out.partial'}; "
        "run the same command with --resume to continue from there"
    ]
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    resumed = run(model_dir, tmp_path / "out", recipe, calib, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_artifact(tmp_path / "whole", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "whole"]


def test_a_killed_run_before_its_first_checkpoint_starts_over(model_dir, calib, tmp_path):
    """SIGKILL with the default interval: the finished layers were written, no checkpoint named them; --resume
    says so in one line and a plain rerun starts over (no "pass --resume")."""
    killed = run(model_dir, tmp_path / "out", "gptq-w4a16", calib, "--checkpoint-every", "600", kill_layer=2)
    assert killed.returncode != 0 and not (tmp_path / "out.partial" / "state.json").exists()
    assert (tmp_path / "out.partial" / "layer-00002.safetensors").is_file()
    refused = run(model_dir, tmp_path / "out", "gptq-w4a16", calib, "--resume")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "holds no checkpoint" in refused.stderr
    again = run(model_dir, tmp_path / "out", "gptq-w4a16", calib)
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_resume_refuses_a_run_with_other_settings_naming_the_field(model_dir, calib, tmp_path):
    killed = run(model_dir, tmp_path / "out", "gptq-w4a16", calib, kill_layer=0)
    assert killed.returncode != 0
    cases = {
        "recipe": ("awq-w4a16", ()),
        "samples": ("gptq-w4a16", ("--seq-len", "16")),
        "ranks": ("gptq-w4a16", ("--nproc-per-node", "2")),
    }
    for field, (recipe, extra) in cases.items():
        done = run(model_dir, tmp_path / "out", recipe, calib, "--resume", *extra)
        assert done.returncode == 2, (field, done.stderr[-2000:])
        lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert f"had {field} " in lines[-1] and "Traceback" not in done.stderr, (field, done.stderr)
    assert (tmp_path / "out.partial" / "state.json").exists(), "a refused resume keeps the saved run"
    assert not (tmp_path / "out").exists()


def test_resume_without_an_interrupted_run_is_one_line(model_dir, calib, tmp_path):
    done = run(model_dir, tmp_path / "out", "gptq-w4a16", calib, "--resume")
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: --resume: there is no interrupted run")
    assert len(done.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_a_resumed_run_fuses_the_rotations_the_interrupted_run_learned(model_dir, calib, tmp_path):
    """The finished layers were quantized with the learned matrices: a resumed run restores them (it does not learn
    again) and writes the uninterrupted run's artifact."""
    from quantkit.quant.registry import resolve

    recipe = tmp_path.parent / f"{tmp_path.name}-gptq-learned.yaml"  # beside tmp_path, whose listing is checked
    recipe.write_text(Path(resolve("gptq-w4a16").source).read_text() +
                      "transforms: [{type: random-hadamard, rotations: [R1, R2], learn: {steps: 3}}]\n")
    whole = run(model_dir, tmp_path / "whole", str(recipe), calib)
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = run(model_dir, tmp_path / "out", str(recipe), calib, kill_layer=1)
    assert killed.returncode != 0
    assert (tmp_path / "out.partial" / "learned-rotations-rank0.safetensors").is_file()
    resumed = run(model_dir, tmp_path / "out", str(recipe), calib, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_artifact(tmp_path / "whole", tmp_path / "out")
    learned = json.loads((tmp_path / "out" / "quantkit.json").read_text())["transforms"]["learned"]
    assert learned["restored"] is True and learned["steps"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "whole"]
