"""Process-wide settings: thread counts."""

from __future__ import annotations

import os


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_threads(threads: int | None = None, ranks_per_node: int = 1) -> int:
    """Set torch's intra-op threads: the given count, or this process's share of the available cores."""
    import torch

    count = threads or max(1, available_cores() // max(1, ranks_per_node))
    torch.set_num_threads(count)
    return count
