"""A test helper: both sides of a bit-for-bit comparison across processes compute with one torch thread count.

torch (and MKL under it) splits a product's or a reduction's sum over its threads, so another thread count may add in
another order: on a 16-core machine the pytest process runs torch with every core it may use, while a forked rank
(forked_ranks.py) or a plain-transformers subprocess runs with THREADS. The pytest process's side of such a
comparison runs inside `pinned()`, and a subprocess gets `environment()`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

THREADS = 1  # the torch threads of every process a test compares with the pytest process bit for bit


@contextlib.contextmanager
def pinned(count: int = THREADS) -> Iterator[None]:
    """torch in this process computes with `count` threads inside; the thread count before is restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def environment(count: int = THREADS, base: dict | None = None) -> dict[str, str]:
    """`base` (this process's environment) for a subprocess whose torch computes with `count` threads."""
    return {**(os.environ if base is None else base), "OMP_NUM_THREADS": str(count)}
