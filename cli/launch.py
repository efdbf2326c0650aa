"""Self-launch under torchrun: `--nproc-per-node N` re-runs the same command with N processes; with `--nnodes M`,
as this machine's share of M machines that meet at `--rdzv-endpoint`."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from quantkit.cli import interrupts
from quantkit.cli.options import RdzvBackend
from quantkit.errors import UsageError
from quantkit.runtime.environment import THREADS_VARIABLE, available_cores, under_torchrun

RDZV_ID = "quantkit"  # the same on every node; one run at a time per endpoint (its port is taken while it runs)


@dataclass(frozen=True)
class Launch:
    """Where the ranks run: `nproc_per_node` processes on each of `nnodes` machines. Several machines meet at
    `rdzv_endpoint` (node 0's HOST:PORT); global rank 0 is node 0's first process under the static rendezvous."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_backend: RdzvBackend = RdzvBackend.static

    def __post_init__(self) -> None:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise UsageError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address and a free port "
                             "there), the same on every node")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} is not one of --nnodes {self.nnodes}: pass 0 to {self.nnodes - 1}, "
                             "0 on the machine that writes DST")
        if self.rdzv_endpoint is not None and not _is_endpoint(self.rdzv_endpoint):
            raise UsageError(f"--rdzv-endpoint {self.rdzv_endpoint!r} is not HOST:PORT; pass e.g. node0:29500")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def _is_endpoint(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def torchrun_args(launch: Launch, argv: list[str]) -> list[str]:
    """`torch.distributed.run`'s arguments for this command: `--standalone` on one machine, else the rendezvous."""
    if launch.nnodes > 1:
        where = [f"--nnodes={launch.nnodes}", f"--node-rank={launch.node_rank}", f"--rdzv-endpoint={launch.rdzv_endpoint}",
                 f"--rdzv-backend={launch.rdzv_backend.value}", f"--rdzv-id={RDZV_ID}"]
    else:
        where = ["--standalone"]
    return [*where, f"--nproc-per-node={launch.nproc_per_node}", "-m", "quantkit.cli.main", *argv]


def relaunch(launch: Launch, threads: int | None = None, explained: tuple[int, ...] = ()) -> int | None:
    """When there is more than one rank in all and this process is not already under torchrun (or another launcher),
    run this command under torchrun and return its exit code; otherwise None (the caller goes on in this process).
    Each rank gets its share of this machine's cores as threads. A rank exiting with one of the `explained` codes
    has said what happened itself (e.g. eval's failed gate, after its results were written): no line is added."""
    if launch.world_size <= 1 or under_torchrun():
        return None
    per_rank = threads or max(1, available_cores() // launch.nproc_per_node)
    os.environ.update({"OMP_NUM_THREADS": str(per_rank), THREADS_VARIABLE: str(per_rank)})
    return run_torchrun(torchrun_args(launch, sys.argv[1:]), explained)


def run_torchrun(args: list[str], explained: tuple[int, ...] = ()) -> int:
    """torch.distributed.run in this process, its ranks' one-line errors printed once each (`interrupts.said`)
    instead of once a rank, and no torchrun traceback or log line. Returns the first failed rank's exit code (1
    for a rank killed by a signal), 128 + signum when this process was interrupted (Ctrl-C: 130; its ranks, told
    by torchrun, say what they kept), 0 when all succeed. A failed rank that said nothing (killed, or crashed
    outside Python) is named in one line; so is one whose exit code is not in `explained` (eval's failed gate
    has printed its results). torchrun's per-run log directory is a temporary one, removed afterwards: left to
    itself, torchrun makes a `torchelastic_*` directory under the temporary directory on every run and never
    removes it."""
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _quiet_torchrun()
    with tempfile.TemporaryDirectory(prefix="quantkit-torchrun-") as logs:
        messages = Path(logs) / "messages"
        messages.mkdir()
        # what the ranks inherit: where their error lines go, and this process's id (each rank stops when it dies)
        os.environ.update({interrupts.RANK_MESSAGES: str(messages), interrupts.LAUNCHER_PID: str(os.getpid())})
        try:
            run(parse_args([f"--log-dir={logs}", *args]))
        except SignalException as exc:  # every rank was told: rank 0's line (the writer's, where each may have
            # stopped a moment apart: one after the next checkpoint, one before), else this machine's ranks'
            for line in interrupts.said(messages, {0}) or interrupts.said(messages):
                interrupts.show(line)
            return 128 + int(exc.sigval)
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            # torchrun stops the other ranks with SIGTERM once one fails, and counts them as failed too: their
            # "interrupted" is not news
            stopped = {128 + signal.SIGTERM, -signal.SIGTERM}
            lines = interrupts.said(messages, {r for r, f in exc.failures.items() if r == rank or f.exitcode not in stopped})
            for line in lines:
                interrupts.show(line)
            if failure.exitcode in explained or (lines and failure.exitcode > 0):
                return failure.exitcode
            killed = f" (killed by {failure.signal_name()})" if failure.exitcode < 0 else f" (exit code {failure.exitcode})"
            interrupts.say(f"[red]error:[/red] rank {rank} of {_world(args)} failed{killed}; the other ranks were stopped")
            return failure.exitcode if failure.exitcode > 0 else 1
        finally:
            for name in (interrupts.RANK_MESSAGES, interrupts.LAUNCHER_PID):
                os.environ.pop(name, None)
    return 0


def _quiet_torchrun() -> None:
    """torchrun's own log lines ("Received 2 death signal, shutting down workers", per-failure reports) off: its
    modules' loggers each have their own level, so the parent's is not enough."""
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _world(args: list[str]) -> int:
    """All the ranks: --nnodes x --nproc-per-node, read from torchrun's own arguments (those before `-m`)."""
    own = dict(a[2:].split("=", 1) for a in args[:args.index("-m")] if a.startswith(("--nnodes=", "--nproc-per-node=")))
    return int(own.get("nnodes", 1)) * int(own["nproc-per-node"])
