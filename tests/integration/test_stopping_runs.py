"""Stopping real runs from outside, as a user or a CI runner does: Ctrl-C and SIGTERM to a self-launched
2-rank calibration (one line, exit 130 / 143, the finished layers kept for --resume), SIGKILL of its launcher
(the ranks stop too, and write nothing), and Ctrl-C of a training run (the newest checkpoint named)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import make_text

pytestmark = pytest.mark.integration

LAYERS = 6
NOISE = ("Traceback", "SignalException", "death signal", "ChildFailedError", "torch.distributed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from quantkit.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("interrupts") / "llama6", make_text(3000), num_hidden_layers=LAYERS,
                            hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("interrupts-data") / "calib.txt"
    path.write_text(make_text(40000, seed=7))
    return path


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["QUANTKIT_DIST_TIMEOUT"] = "60"
    return env


def start(*args: str) -> subprocess.Popen:
    """`quantkit ARGS` in a process group of its own, as a shell runs a foreground command. A shell starts
    background jobs (a CI runner's too) with Ctrl-C ignored, which children inherit; a caught one is reset to the
    default in the child, as a user's foreground command has it (set here, not in a preexec_fn, which may
    deadlock in a process with threads)."""
    before = signal.getsignal(signal.SIGINT)
    if before is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen([sys.executable, "-m", "quantkit.cli.main", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, before)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def calibrate(model_dir: Path, calib: Path, dst: Path, *extra: str, every: str = "0") -> list[str]:
    # 128 x 256 tokens: a layer takes a second or more on 2 ranks, so the run is mid-layer when the signal lands
    return ["finalize", str(model_dir), str(dst), "-q", "gptq-w4a16", "--calib-data", str(calib), "--num-samples", "128",
            "--seq-len", "256", "--threads", "1", "--quiet", "--checkpoint-every", every, "--nproc-per-node", "2", *extra]


def _said(stderr: str) -> list[str]:
    assert not [word for word in NOISE if word in stderr], stderr[-3000:]
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_a_stopped_two_rank_run_says_so_once_and_resumes(model_dir, calib, tmp_path, sig, code):
    """Ctrl-C reaches the launcher's process group (torchrun's ranks have sessions of their own, and hear it from
    torchrun); a `kill` or a cancelled CI job, the launcher alone. Either way: one line, 128 + the signal, no
    torchrun output, no DST, and --resume goes on from the finished layers."""
    dst = tmp_path / "out"
    proc = start(*calibrate(model_dir, calib, dst))
    wait_for(tmp_path / "out.partial" / "layer-00001.safetensors", proc)
    os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == code, stderr[-3000:]
    lines = _said(stderr)
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("error: interrupted after ") and line.endswith(
        f"saved in {tmp_path / 'out.partial'}; run the same command with --resume to continue from there")
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    resumed = subprocess.run([sys.executable, "-m", "quantkit.cli.main", *calibrate(model_dir, calib, dst, "--resume")],
                             capture_output=True, text=True, env=_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_interrupt_before_the_first_checkpoint_says_so_and_leaves_nothing(model_dir, calib, tmp_path):
    """Finished layers without a checkpoint cannot be resumed from: the line says so, and DST.partial goes."""
    proc = start(*calibrate(model_dir, calib, tmp_path / "out", every="600"))
    wait_for(tmp_path / "out.partial" / "layer-00001.safetensors", proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert _said(stderr) == ["error: interrupted before the run's first resume checkpoint (every 600 s, "
                             "--checkpoint-every; 0: after every layer); nothing was written"]
    assert list(tmp_path.iterdir()) == []


def _ranks_of(launcher: int) -> list[int]:
    """The processes started with the launcher's id in their environment: its ranks."""
    mark = f"QUANTKIT_LAUNCHER_PID={launcher}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has stopped
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks follow their launcher on Linux")
def test_ranks_stop_when_their_launcher_is_killed(model_dir, calib, tmp_path):
    """SIGKILL of the launcher (an OOM kill, `kill -9`, a CI runner's hard stop): its ranks are told and stop,
    and rank 0 never writes DST."""
    dst = tmp_path / "out"
    proc = start(*calibrate(model_dir, calib, dst))
    wait_for(tmp_path / "out.partial" / "layer-00001.safetensors", proc)
    ranks = _ranks_of(proc.pid)
    assert len(ranks) == 2
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.time() + 120
    while any(_running(pid) for pid in ranks) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_running(pid) for pid in ranks)
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_ctrl_c_of_training_names_the_checkpoint_to_resume_from(tmp_path, calib):
    from quantkit.models.tiny import train_tokenizer

    train_tokenizer(make_text(3000), 384).save_pretrained(tmp_path / "tok")
    config = {
        "model": {"config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384,
                             "max_position_embeddings": 128}, "tokenizer": str(tmp_path / "tok")},
        "data": {"train": str(calib), "seq_len": 64},
        "train": {"micro_batch_size": 4, "global_batch_size": 4, "max_steps": 100000, "lr": 1e-3, "save_interval": 2},
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    proc = start("train", str(tmp_path / "train.yaml"), "--threads", "1", "--quiet")
    wait_for(tmp_path / "run" / "checkpoints" / "step-000002", proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    lines = _said(stderr)
    assert len(lines) == 1, lines
    line = lines[0]
    newest = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
    assert line == (f"error: interrupted; the newest checkpoint, {newest}, is kept: run the same command with "
                    "--resume latest to continue from it")
