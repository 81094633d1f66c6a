"""Memory the worker's process no longer uses, handed back to the system."""

from __future__ import annotations

import ctypes
import gc


def return_freed_heap() -> None:
    """Give the heap memory that loading freed (transformers' copies of the weights that the
    model did not keep) back to the system, which glibc does not do by itself (the resident
    memory it saves: bench/RESULTS.md, "Weights kept in GGUF blocks, second round")."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    gc.collect()
    libc.malloc_trim(0)
