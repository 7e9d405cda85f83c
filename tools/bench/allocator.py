"""Benchmarks that report resident memory fix glibc's mmap threshold before they allocate.

By default glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, and serves later blocks
below it from a heap that stays resident, holes and all. A step's resident high-water mark then measures how the
allocator's heap fragmented as much as what the step held: a context-parallel rank at 16k tokens peaked at twice the
one-rank step (4,263 against 2,027 MiB, SmolLM2) while its tensors were half, and fell below it once blocks of 64 KiB
and up were mapped and unmapped on their own. `mallopt` sets it in the running process (no re-execution with
`MALLOC_MMAP_THRESHOLD_`), and forked ranks inherit it.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 64 * 1024


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Map every block of `threshold` bytes and up on its own (glibc's dynamic threshold off). False where the C
    library has no `mallopt` (not glibc): memory figures then include whatever its allocator keeps."""
    library = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(library).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
