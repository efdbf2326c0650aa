"""Process-wide settings: thread counts, and what the environment says about this process (the one place,
with `distributed.py`, that reads environment variables; no torch import at module level)."""

from __future__ import annotations

import os

THREADS_VARIABLE = "QUANTKIT_THREADS"  # set by the self-launcher: each rank's share of the cores


def under_torchrun() -> bool:
    """This process was started by torchrun (or another launcher that sets torch.distributed's variables)."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def hide_gpus() -> None:
    """This process, and every process it starts, sees no CUDA device (before torch initialises CUDA)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def is_main_process() -> bool:
    """Global rank 0, or not distributed at all: the process that prints and writes."""
    return int(os.environ.get("RANK", 0)) == 0


def launched_threads() -> int | None:
    """The thread count the self-launcher gave this rank, if any."""
    value = os.environ.get(THREADS_VARIABLE)
    return int(value) if value else None


HUGE_PAGES_VARIABLE = "THP_MEM_ALLOC_ENABLE"  # torch's: its CPU tensors of 2 MiB+ advised as transparent huge pages


def advise_huge_pages() -> None:
    """Have torch advise transparent huge pages (`madvise(MADV_HUGEPAGE)`) for its CPU tensors of 2 MiB or more,
    unless the environment already says otherwise (THP_MEM_ALLOC_ENABLE=0). torch reads the variable once, at
    its first CPU allocation, so the command line calls this before anything else.

    Why: a streamed calibrated finalize serves its large temporaries from fresh memory maps (see
    `memory.map_large_allocations`), and faulting them in 4 KiB at a time was most of its extra time over the
    in-memory path. Measured (1.7 GB bf16 16-layer Llama, `gptq-w4a16`, 2 threads, AVX2 machine with THP in
    `madvise` mode): streamed 192.8 s, 17.8 M page faults, 58.0 s system time without; 173.0 s, 2.8 M faults,
    29.2 s system time with; peak RSS 1042 vs 1036 MiB. Where THP is `never` the advice does nothing."""
    os.environ.setdefault(HUGE_PAGES_VARIABLE, "1")


CUDA_ALLOCATOR_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"


def configure_cuda_allocator() -> None:
    """Have torch's CUDA allocator grow its segments instead of caching fixed blocks (`expandable_segments:True`),
    unless the environment already configures it: calibration allocates tensors of many sizes layer after layer
    (hidden states, each stage's inputs, Hessians, GPTQ's work copies), which fixed blocks fragment. torch reads
    the variable at its first CUDA allocation, so the command line calls this before anything else; torchrun's
    ranks inherit it."""
    os.environ.setdefault(CUDA_ALLOCATOR_VARIABLE, "expandable_segments:True")


MLX_PYTHON_VARIABLE = "QUANTKIT_MLX_PYTHON"  # the Python that has mlx and mlx-lm (`quantkit eval` of MLX models)


def mlx_python() -> str | None:
    """The Python `eval` runs MLX models in, where the environment names one (QUANTKIT_MLX_PYTHON), else None."""
    return os.environ.get(MLX_PYTHON_VARIABLE) or None


def debug_enabled() -> bool:
    """QUANTKIT_DEBUG=1 (or true / yes): show tracebacks instead of one-line errors."""
    return os.environ.get("QUANTKIT_DEBUG", "").strip().lower() in ("1", "true", "yes")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_threads(threads: int | None = None, ranks_per_node: int = 1) -> int:
    """Set torch's intra-op threads, and numpy's BLAS threads (calibration's Hessians run there): the given
    count, or this process's share of the available cores."""
    import torch

    count = threads or max(1, available_cores() // max(1, ranks_per_node))
    torch.set_num_threads(count)
    set_numpy_blas_threads(count)
    return count


# The thread-count setters of the OpenBLAS builds numpy wheels bundle (as threadpoolctl finds them).
_OPENBLAS_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
                     "openblas_set_num_threads")


def set_numpy_blas_threads(count: int) -> bool:
    """Set the thread count of the OpenBLAS numpy is linked with; False when none is found (then its own
    default applies: OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, else all cores)."""
    import ctypes

    import numpy  # noqa: F401  (loads the library)

    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return False
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _OPENBLAS_SETTERS:
            setter = getattr(library, name, None)
            if setter is not None:
                setter(ctypes.c_int(count))
                return True
    return False
