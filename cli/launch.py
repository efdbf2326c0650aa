"""Self-launch under torchrun: `--nproc-per-node N` re-runs the same command with N processes."""

from __future__ import annotations

import os
import subprocess
import sys

from quantkit.runtime import THREADS_VARIABLE, available_cores, under_torchrun


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "quantkit.cli.main", *argv]


def relaunch(nproc: int, threads: int | None = None) -> int | None:
    """When N > 1 and not already under torchrun, run this command under torchrun and return its exit code;
    otherwise None (the caller goes on in this process). Each rank gets its share of the cores as threads."""
    if nproc <= 1 or under_torchrun():
        return None
    per_rank = threads or max(1, available_cores() // nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(per_rank), THREADS_VARIABLE: str(per_rank)}
    return subprocess.run(torchrun_command(nproc, sys.argv[1:]), env=env).returncode
