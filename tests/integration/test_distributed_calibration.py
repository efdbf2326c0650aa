"""Data-parallel calibration on CPU with gloo: 1 and 2 ranks write the same artifact, and so do two "machines" of
one rank each; a failing rank stops every rank within the collective timeout and leaves no DST; --dry-run shows
the plan."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_text

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dcalib") / "calib.txt"
    path.write_text(make_text(4000, seed=11))
    return path


def _env(tmpdir: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["QUANTKIT_DIST_TIMEOUT"] = "60"
    if tmpdir is not None:  # the processes' temporary directory (tempfile's TMPDIR)
        env["TMPDIR"] = str(tmpdir)
    return env


def command(src, dst, recipe, calib, *extra, runner=None) -> list[str]:
    return [sys.executable, *(runner or ["-m", "quantkit.cli.main"]), "finalize", str(src), str(dst), "-q", recipe,
            "--calib-data", str(calib), "--num-samples", "16", "--seq-len", "32", "--threads", "1", "--quiet", *extra]


def finalize(src, dst, recipe, calib, nproc, *extra, runner=None, tmpdir=None):
    cmd = command(src, dst, recipe, calib, *extra, runner=runner)
    if nproc > 1 and runner is None:
        cmd += ["--nproc-per-node", str(nproc)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(tmpdir))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


R4_GPTQ = ("scheme: {weights: {dtype: int4, granularity: group, group_size: 32, symmetric: true}}\n"
           "transforms: [{type: hadamard, rotations: [R1, R2]}, {type: random-hadamard, rotations: [R4], online: true}]\n"
           "algorithm: {name: gptq}\nformat: compressed-tensors\nignore: [lm_head]\n")


@pytest.mark.parametrize("recipe", ["gptq-w4a16", "fp8-static", "awq-w4a16", "smoothquant-w8a8", "spinquant-gptq-w4a16",
                                    "r4-gptq.yaml", "mlx-gptq-4bit-g64"])
def test_one_two_and_three_ranks_write_the_same_artifact(tiny_model_dir, calib_file, tmp_path, recipe):
    """Bit-identical at equal threads per process: whole batches (24 samples = 3 batches of 8) are shared out,
    so every per-batch statistic is the same tensor, and reductions are exact (MIN/MAX, float64 sums). GPTQ's
    weight rows are shared out in blocks of 128 (the tiny model stacks 64, 128 and 352 rows: not all
    multiples of the block or of the world size). With R4, every rank rotates the down projections' inputs the
    same way (random-hadamard's signs from the seed)."""
    if recipe.endswith(".yaml"):
        (tmp_path / recipe).write_text(R4_GPTQ)
        recipe = str(tmp_path / recipe)
    for n in (1, 2, 3):
        done = finalize(tiny_model_dir, tmp_path / f"n{n}", recipe, calib_file, n, "--num-samples", "24")
        assert done.returncode == 0, done.stderr[-3000:]
    one = load_file(tmp_path / "n1" / "model.safetensors")
    for n in (2, 3):
        other = load_file(tmp_path / f"n{n}" / "model.safetensors")
        assert one.keys() == other.keys()
        for key in one:
            assert torch.equal(one[key], other[key]), (n, key)
    info = json.loads((tmp_path / "n3" / "quantkit.json").read_text())["calibration"]
    assert info["ranks"] == 3 and info["num_samples"] == 24
    assert len(info["peak_rss_per_rank"]) == 3 and min(info["peak_rss_per_rank"]) > 100 << 20  # each rank's own
    if "gptq" in recipe:  # the rows of the GPTQ weights were shared out (in blocks of 128: unevenly here)
        rows = info["gptq_rows_per_rank"]
        assert len(rows) == 3 and min(rows) > 0, rows


@pytest.mark.parametrize("recipe", ["gptq-w4a16", "awq-w4a16"])
def test_one_rank_under_torchrun_writes_what_one_process_writes(tiny_model_dir, calib_file, tmp_path, recipe):
    """A world of one rank under torchrun runs the collectives (gloo here, nccl on a one-GPU machine: the GPU suite
    runs this with --device cuda) and writes the artifact of a plain process, tensor for tensor."""
    runner = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", f"--log-dir={tmp_path / 'logs'}",
              "-m", "quantkit.cli.main"]
    plain = finalize(tiny_model_dir, tmp_path / "plain", recipe, calib_file, 1)
    ranked = finalize(tiny_model_dir, tmp_path / "ranked", recipe, calib_file, 1, runner=runner)
    assert plain.returncode == 0 and ranked.returncode == 0, (plain.stderr[-2000:], ranked.stderr[-2000:])
    one, two = (load_file(tmp_path / name / "model.safetensors") for name in ("plain", "ranked"))
    assert one.keys() == two.keys()
    for key in one:
        assert torch.equal(one[key], two[key]), key
    if recipe.startswith("gptq"):  # the rows went through the owners' broadcast: one rank owned them all
        info = json.loads((tmp_path / "ranked" / "quantkit.json").read_text())["calibration"]
        rows = info["gptq_rows_per_rank"]
        assert info["ranks"] == 1 and len(rows) == 1 and rows[0] > 0, rows


def test_nvfp4_gptq_and_kv_cache_on_two_ranks_write_the_one_rank_artifact(tiny_model_dir, calib_file, tmp_path):
    """NVFP4's global scales come from whole weights (q/k/v together), not from a rank's share of the rows; the KV
    cache's per-head ranges are merged over the ranks' data. The self-launched torchrun leaves nothing in the
    temporary directory (by itself it leaves a `torchelastic_*` log directory behind on every run)."""
    (tmp_path / "tmp").mkdir()
    for n in (1, 2):
        done = finalize(tiny_model_dir, tmp_path / f"n{n}", "gptq-nvfp4-a16", calib_file, n, "--num-samples", "16",
                        "--kv-cache", "fp8-head", tmpdir=tmp_path / "tmp")
        assert done.returncode == 0, done.stderr[-3000:]
    assert list((tmp_path / "tmp").iterdir()) == []
    one, two = (load_file(tmp_path / f"n{n}" / "model.safetensors") for n in (1, 2))
    assert one.keys() == two.keys() and any(key.endswith("weight_global_scale") for key in one)
    for key in one:
        assert torch.equal(one[key].view(torch.uint8) if one[key].dtype == torch.float8_e4m3fn else one[key],
                           two[key].view(torch.uint8) if two[key].dtype == torch.float8_e4m3fn else two[key]), key
    assert torch.equal(one["model.layers.0.self_attn.q_proj.weight_global_scale"], one["model.layers.0.self_attn.k_proj.weight_global_scale"])
    assert one["model.layers.1.self_attn.v_scale"].shape == (2, 1, 1)  # the tiny model's 2 key/value heads


def test_gptq_on_llama_cpps_k_grids_on_two_ranks_writes_the_one_rank_file(calib_file, tmp_path):
    """GGUF's Q4_K_M: each rank solves its share of the rows on K grids (a row's super-block scales are its own)
    and the rows are gathered with their grids; the two files' tensors are the same bytes."""
    gguf = pytest.importorskip("gguf")
    from quantkit.models.tiny import build_tiny_llama

    src = build_tiny_llama(tmp_path / "k-llama", make_text(2000), hidden_size=256, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2)
    for n in (1, 2):
        done = finalize(src, tmp_path / f"n{n}.gguf", "gguf-q4-k-m", calib_file, n)
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = ({t.name: t for t in gguf.GGUFReader(tmp_path / f"n{n}.gguf").tensors} for n in (1, 2))
    assert one.keys() == two.keys() and one["blk.0.attn_q.weight"].tensor_type.name == "Q4_K"
    for name, tensor in one.items():
        assert tensor.tensor_type == two[name].tensor_type and bytes(tensor.data) == bytes(two[name].data), name
    record = gguf.GGUFReader(tmp_path / "n2.gguf").fields["quantkit.json"].contents()
    rows = json.loads(record)["calibration"]["gptq_rows_per_rank"]
    assert len(rows) == 2 and min(rows) > 0, rows


def test_a_budget_plan_on_two_ranks_writes_the_one_rank_file(calib_file, tmp_path):
    """--target-bpw: every rank measures and plans alike (the same samples, the same solver), so the two ranks'
    GPTQ runs on the planned types write the one-rank file's tensors."""
    gguf = pytest.importorskip("gguf")
    from quantkit.models.tiny import build_tiny_llama

    src = build_tiny_llama(tmp_path / "k-llama", make_text(2000), hidden_size=256, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2)
    for n in (1, 2):
        done = finalize(src, tmp_path / f"n{n}.gguf", "gguf-q4-k-m", calib_file, n, "--target-bpw", "4.0")
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = ({t.name: t for t in gguf.GGUFReader(tmp_path / f"n{n}.gguf").tensors} for n in (1, 2))
    assert len({t.tensor_type for name, t in one.items() if name.startswith("blk.")}) > 2  # a mixture: F32 norms and 2+ types
    for name, tensor in one.items():
        assert tensor.tensor_type == two[name].tensor_type and bytes(tensor.data) == bytes(two[name].data), name


def test_two_machines_write_what_one_machine_of_two_ranks_writes(tiny_model_dir, calib_file, tmp_path):
    """`--nnodes 2` with one process per node, both started at once, each in a directory of its own that stands for
    its machine's disk (DST is relative): node 0 holds global rank 0 and writes the single-node artifact, tensor
    for tensor; node 1 calibrates its half and leaves nothing behind."""
    single = finalize(tiny_model_dir, tmp_path / "single", "gptq-w4a16", calib_file, 2)
    assert single.returncode == 0, single.stderr[-3000:]
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    try:
        for rank in (0, 1):
            (tmp_path / f"node{rank}").mkdir()
            cmd = command(tiny_model_dir, "out", "gptq-w4a16", calib_file, "--nproc-per-node", "1", "--nnodes", "2",
                          "--node-rank", str(rank), "--rdzv-endpoint", endpoint)
            with open(tmp_path / f"node{rank}.log", "w") as log:
                nodes.append(subprocess.Popen(cmd, cwd=tmp_path / f"node{rank}", stdout=log, stderr=subprocess.STDOUT,
                                              env=_env(), start_new_session=True))
        codes = [node.wait(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:  # a node left waiting for the other: it and its ranks
                os.killpg(node.pid, signal.SIGKILL)
    logs = [(tmp_path / f"node{rank}.log").read_text()[-3000:] for rank in (0, 1)]
    assert codes == [0, 0], logs
    one, two = load_file(tmp_path / "single" / "model.safetensors"), load_file(tmp_path / "node0" / "out" / "model.safetensors")
    assert one.keys() == two.keys()
    for key in one:
        assert torch.equal(one[key], two[key]), key
    info = json.loads((tmp_path / "node0" / "out" / "quantkit.json").read_text())["calibration"]
    assert info["ranks"] == 2 and len(info["gptq_rows_per_rank"]) == 2 and min(info["gptq_rows_per_rank"]) > 0
    assert list((tmp_path / "node1").iterdir()) == []


def test_a_failing_rank_stops_every_rank_and_writes_nothing(tiny_model_dir, calib_file, tmp_path):
    runner = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", f"--log-dir={tmp_path / 'torchrun-logs'}",
              str(Path(__file__).with_name("failing_rank.py"))]
    started = time.monotonic()
    done = finalize(tiny_model_dir, tmp_path / "out", "gptq-w4a16", calib_file, 2, runner=runner)
    assert done.returncode != 0
    assert time.monotonic() - started < 300
    assert "injected failure on rank 1" in done.stderr
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_dry_run_prints_the_plan_without_loading(tiny_model_dir, calib_file, tmp_path):
    done = finalize(tiny_model_dir, tmp_path / "out", "gptq-w4a16", calib_file, 2, "--dry-run", "--json", "-")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["ranks"] == 2 and plan["samples_per_rank"] == [8, 8]
    rows = plan["gptq_rows_per_rank"]
    assert len(rows) == 2 and min(rows) > 0, rows
    assert not (tmp_path / "out").exists()


def test_a_rank_failing_under_the_self_launcher_is_one_line_with_its_exit_code(tiny_model_dir, tmp_path):
    """Every rank reads the calibration data, so a missing file fails each with a usage error (exit 2): the
    launcher prints the ranks' line once (not once a rank, nor the "interrupted" of the rank torchrun stopped),
    keeps the exit code, and prints no torchrun traceback."""
    done = finalize(tiny_model_dir, tmp_path / "out", "gptq-w4a16", tmp_path / "missing.txt", 2)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'missing.txt'} does not exist; pass a .txt/.jsonl/.parquet file or a datasets spec like "
        "wikitext:wikitext-2-raw-v1:test"]
    assert not (tmp_path / "out").exists()
