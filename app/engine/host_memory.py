"""Keep the memory the engine frees inside the process, so its largest steps do not fault in fresh pages.

glibc's malloc serves a block above a threshold (dynamic, at most 32 MB) with an mmap of its own, returned to
the system at free, and gives the heap's free top back above another threshold. A prefill step at the full
token budget allocates tens of MB of activations and frees them a moment later, so each such step paid for
fresh zeroed pages from the kernel (docs/engine.md, "Host memory"). With the threshold at its largest, the
trim threshold raised and no block given an mmap of its own (blocks above 32 MB too: a 371M Llama's MLP output
at 1,792 rows is 40 MB), the memory stays in the heap after the first large step (the engine's warm-up runs one)
and later steps reuse it. On CUDA, torch's caching allocator does this for device memory; on CPU, torch allocates
with malloc.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this come from the heap
_TRIM_THRESHOLD = 1 << 30  # free heap top kept up to this


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False (and nothing done) without glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    kept = (bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
            and bool(mallopt(_M_MMAP_MAX, 0)))  # no mmaps: larger blocks from the heap too (glibc mmaps anyway if it must)
    logger.info("host memory: %s", "freed memory kept in the heap" if kept else "glibc refused the malloc thresholds")
    return kept
