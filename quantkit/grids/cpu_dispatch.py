"""Where a grid's CPU work runs: the compiled loops (`cpu_kernels`, numba, imported when first needed) for finite
float32 weights on the CPU, and chunks of a weight spread over threads. Shared by the grids that hold compiled loops
(k_grids, iq_grids, qparams) and the GGUF writer; imports no grid module, so none of them imports another for it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def kernels():
    """`grids.cpu_kernels` (numba), imported when first needed."""
    from quantkit.grids import cpu_kernels

    return cpu_kernels


def compiled(x: torch.Tensor) -> bool:
    """Whether float32 `x` (2-D) goes through the compiled CPU loops: on the CPU, every value finite (the torch ops
    keep ggml's handling of the others)."""
    return x.device.type == "cpu" and bool(kernels().all_finite(x.reshape(x.shape[0], -1).numpy()))


def map_chunks(fn, firsts: range, device: torch.device) -> list:
    """fn on each chunk. On CPU the chunks share torch's intra-op threads as Python threads running single-threaded
    ops (torch releases the GIL inside them): a chunk's ops are too small to split across threads well, and on a
    busy machine each split op waits for its slowest thread. torch's thread count is 1, process-wide, meanwhile."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or len(firsts) == 1:
        return [fn(first) for first in firsts]
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(fn, firsts))
    finally:
        torch.set_num_threads(threads)
