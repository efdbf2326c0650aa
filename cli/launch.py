"""Self-launch under torchrun: `--nproc-per-node N` re-runs the same command with N processes."""

from __future__ import annotations

import os
import sys

from quantkit.runtime import THREADS_VARIABLE, available_cores, under_torchrun


def torchrun_args(nproc: int, argv: list[str]) -> list[str]:
    """`torch.distributed.run`'s arguments for this command on `nproc` local processes."""
    return ["--standalone", f"--nproc-per-node={nproc}", "-m", "quantkit.cli.main", *argv]


def relaunch(nproc: int, threads: int | None = None) -> int | None:
    """When N > 1 and not already under torchrun, run this command under torchrun and return its exit code;
    otherwise None (the caller goes on in this process). Each rank gets its share of the cores as threads."""
    if nproc <= 1 or under_torchrun():
        return None
    per_rank = threads or max(1, available_cores() // nproc)
    os.environ.update({"OMP_NUM_THREADS": str(per_rank), THREADS_VARIABLE: str(per_rank)})
    return run_torchrun(torchrun_args(nproc, sys.argv[1:]))


def run_torchrun(args: list[str]) -> int:
    """torch.distributed.run in this process, so that a failed rank is reported in one line (its own error is
    already printed above it) instead of torchrun's traceback. Returns the first failed rank's exit code (1 for a
    rank killed by a signal), 0 when all succeed."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from quantkit.cli.console import err

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its own per-failure log lines
    try:
        run(parse_args(args))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        killed = f" (killed by {failure.signal_name()})" if failure.exitcode < 0 else f" (exit code {failure.exitcode})"
        err.print(f"[red]error:[/red] rank {rank} of {_world(args)} failed{killed}; "
                  "every rank stopped and nothing was written", highlight=False, soft_wrap=True)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def _world(args: list[str]) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith("--nproc-per-node="))
