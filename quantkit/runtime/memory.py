"""Giving memory back to the system between the big allocations of a streamed finalize (glibc only; elsewhere
these do nothing).

A streamed finalize holds one decoder layer at a time, so its peak is set by what one layer's work allocates
and by freed memory the C allocator keeps: `return_freed_memory` (glibc's `malloc_trim`) after each layer and
before each GPTQ solve, `map_large_allocations` (glibc's M_MMAP_THRESHOLD) for calibrated runs.
"""

from __future__ import annotations


def return_freed_memory() -> None:
    """Give the memory freed so far back to the system (glibc's `malloc_trim`). Without it, a layer's worth of
    small allocations freed between big ones stays in the heap: measured, the peak grew by ~0.6 of a layer's
    size per layer streamed; with it, it stays flat. GPTQ calls it before each solve too: on a 6-layer h2048
    Llama the peak then stays at 1083 MiB from the second layer on (without: 1084 rising to 1123 by the sixth)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def map_large_allocations(threshold: int = 4 << 20) -> None:
    """Serve every allocation of `threshold` bytes or more with its own memory map (glibc's M_MMAP_THRESHOLD),
    so that freeing it gives the memory back at once. By default glibc raises that threshold up to 32 MiB as
    large blocks are freed, and a layer's 4-32 MiB temporaries then fragment the heap within the layer, where
    `malloc_trim` does not reach. Measured on a 6-layer h2048 Llama (one thread): GPTQ's peak 1102 MiB instead
    of 1377 (1181 with a `malloc_trim` before each GPTQ solve) for 4% more time; round to nearest's 695 instead
    of 722 MiB but 40% slower (every large temporary is faulted in afresh), so finalize sets it for calibrated
    recipes only. Tried and not kept (streamed `gptq-w4a16` on the 1.7 GB benchmark Llama, 2 threads, paired
    with the in-memory path): 4 MiB takes 1.08-1.12x the in-memory time for a peak of 1149-1250 MiB; 16 MiB
    1.05x, 1208-1230 MiB; 32 MiB for the run and 4 MiB around each GPTQ solve 1.02-1.03x, 1199-1256 MiB (the
    down_proj solves set the peak, which grows layer after layer by up to 90 MiB): above the 0.4x-the-model
    memory target (1235 MiB there), which 4 MiB meets. On an AVX2 machine (bf16 products in float32, each
    product's float32 weight copy a fresh map), after GPTQ freed its Hessians early: 16 MiB without the
    per-solve trim peaked at 1286-1386 MiB (over); one reused float32 buffer for those copies measured
    1.02-1.12x the in-memory time against 1.17x without, within that machine's noise, so not kept. What closed
    the gap there is the command line's `runtime.advise_huge_pages` (each fresh map faulted in 2 MiB at a time;
    its docstring has the numbers)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)


_M_MMAP_THRESHOLD = -3


def physical_bytes() -> int | None:
    """This machine's memory (None where the system does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _glibc():
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim, _LIBC.mallopt  # noqa: B018  (both present: glibc)
        except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
            _LIBC = False
    return _LIBC or None


_LIBC = None
