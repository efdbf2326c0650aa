"""The self-launcher: torchrun's arguments for one machine and for several, read back by torchrun's own parser,
and the launch options' mistakes as usage errors."""

from __future__ import annotations

import pytest

from quantkit.cli import launch
from quantkit.cli.launch import Launch, torchrun_args
from quantkit.cli.options import RdzvBackend
from quantkit.errors import UsageError

ARGV = ["finalize", "src", "dst", "-q", "gptq-w4a16"]


def test_one_machine_is_standalone():
    assert torchrun_args(Launch(nproc_per_node=2), ARGV) == ["--standalone", "--nproc-per-node=2", "-m", "quantkit.cli.main", *ARGV]


def test_several_machines_meet_at_the_endpoint():
    two = Launch(nproc_per_node=4, nnodes=2, node_rank=1, rdzv_endpoint="node0:29500")
    assert torchrun_args(two, ARGV) == [
        "--nnodes=2", "--node-rank=1", "--rdzv-endpoint=node0:29500", "--rdzv-backend=static", "--rdzv-id=quantkit",
        "--nproc-per-node=4", "-m", "quantkit.cli.main", *ARGV,
    ]


def test_torchrun_reads_the_arguments_as_meant(monkeypatch, tmp_path):
    from torch.distributed.run import config_from_args, parse_args

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun sets it when absent
    two = Launch(nproc_per_node=2, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500")
    # a log directory of its own: without one torchrun makes a torchelastic_* directory under /tmp right here
    config, module, args = config_from_args(parse_args([f"--log-dir={tmp_path}", *torchrun_args(two, ARGV)]))
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 2)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("static", "10.0.0.1:29500", "quantkit")
    assert config.rdzv_configs["rank"] == 1  # static keeps --node-rank: node 0 holds global rank 0, the writer
    assert args[-len(ARGV):] == ARGV and "quantkit.cli.main" in args


def test_c10d_can_be_chosen():
    args = torchrun_args(Launch(1, 2, 0, "[::1]:29400", RdzvBackend.c10d), ARGV)
    assert "--rdzv-backend=c10d" in args and "--rdzv-endpoint=[::1]:29400" in args and "--standalone" not in args


@pytest.mark.parametrize("args, says", [
    ((1, 2, 0, None), "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    ((1, 2, 2, "node0:29500"), "--node-rank 2 is not one of --nnodes 2: pass 0 to 1"),
    ((1, 1, 1, None), "--node-rank 1 is not one of --nnodes 1: pass 0 to 0"),
    ((1, 2, 0, "node0"), "'node0' is not HOST:PORT"),
    ((1, 2, 0, "node0:http"), "'node0:http' is not HOST:PORT"),
])
def test_launch_mistakes_are_usage_errors(args, says):
    with pytest.raises(UsageError) as caught:
        Launch(*args)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_the_world_counts_every_machine():
    assert launch._world(torchrun_args(Launch(2), ARGV)) == 2
    assert launch._world(torchrun_args(Launch(3, 2, 0, "h:1"), [*ARGV, "--nnodes=9"])) == 6  # the command's own argv is not torchrun's
    assert Launch(3, 2, 1, "h:1").world_size == 6


def test_several_machines_relaunch_even_with_one_process_each(monkeypatch):
    seen = []
    monkeypatch.setattr(launch, "run_torchrun", lambda args, explained=(): seen.append(args) or 0)
    monkeypatch.setattr(launch, "under_torchrun", lambda: False)
    monkeypatch.setattr(launch.sys, "argv", ["quantkit", *ARGV])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # restored after the test
    monkeypatch.setenv("QUANTKIT_THREADS", "1")
    assert launch.relaunch(Launch(1), threads=1) is None and not seen
    assert launch.relaunch(Launch(1, 2, 1, "h:29500"), threads=1) == 0
    assert seen[0][:2] == ["--nnodes=2", "--node-rank=1"] and seen[0][-len(ARGV):] == ARGV


def test_no_relaunch_under_a_launcher(monkeypatch):
    monkeypatch.setattr(launch, "run_torchrun", lambda args, explained=(): pytest.fail("must not launch"))
    monkeypatch.setattr(launch, "under_torchrun", lambda: True)
    assert launch.relaunch(Launch(4, 2, 1, "h:29500")) is None


def test_an_explained_exit_code_passes_through_without_a_line(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun sets it when absent
    script = tmp_path / "gate_failed.py"
    script.write_text("import sys\nprint('error: the gate failed', file=sys.stderr)\nsys.exit(3)\n")
    assert launch.run_torchrun(["--standalone", "--nproc-per-node=1", str(script)], explained=(3,)) == 3
    assert capfd.readouterr().err.strip().splitlines()[-1] == "error: the gate failed"  # the rank's own line, last


def test_finalize_relaunches_before_importing_the_model_stack(tiny_model_dir, tmp_path):
    """The launching process only waits for its ranks: it hands over to torchrun before importing quantkit's
    finalize (torchao, transformers), which each rank imports itself (measured: ~1.5 s saved a run)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import quantkit.cli.launch as launch\n"
        "def fake(args, explained=()):\n"
        "    print('stack imported' if 'quantkit.finalization.finalize' in sys.modules else 'stack not imported')\n"
        "    return 0\n"
        "launch.run_torchrun = fake\n"
        "from quantkit.cli.main import main\n"
        f"sys.argv = ['quantkit', 'finalize', {str(tiny_model_dir)!r}, {str(tmp_path / 'out')!r}, '-q', 'int4-weight-only',"
        " '--nproc-per-node', '2']\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "stack not imported" in done.stdout, done.stdout + done.stderr[-2000:]
