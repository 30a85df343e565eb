"""Keep the memory the engine frees inside the process, so its largest steps do not fault in fresh pages; and back
the weights and the KV cache with 2 MB pages (:func:`back_with_huge_pages`, :func:`advise_huge_pages`).

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
import os
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


# Transparent huge pages (x86-64: 2 MB) for the memory every step streams through.
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # from Linux's mman-common.h
_MADV_COLLAPSE = 25  # Linux 6.1+: back the range with huge pages now, not whenever khugepaged comes by
_SPAN_GAP = 64 << 10  # tensors this close together are one span: the heap's headers and small blocks between them


def tensor_spans(tensors) -> list[tuple[int, int]]:
    """(address, bytes) of each CPU tensor's storage, once per storage (tied weights share one); oneDNN's opaque
    packed tensors have no address to give."""
    spans: dict[int, int] = {}
    for tensor in tensors:
        if tensor.device.type == "cpu" and not tensor.is_mkldnn:
            storage = tensor.untyped_storage()
            spans[storage.data_ptr()] = storage.nbytes()
    return list(spans.items())


def huge_page_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The 2 MB-aligned ranges (start, end) inside ``spans`` ((address, bytes) each), neighbours merged first:
    only whole huge pages that hold nothing but these spans and the small gaps between them."""
    merged: list[list[int]] = []
    for start, size in sorted(s for s in spans if s[1] > 0):
        if merged and start <= merged[-1][1] + _SPAN_GAP:
            merged[-1][1] = max(merged[-1][1], start + size)
        else:
            merged.append([start, start + size])
    aligned = [(-(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE) for start, end in merged]
    return [(start, end) for start, end in aligned if end > start]


def back_with_huge_pages(spans: list[tuple[int, int]]) -> tuple[int, str | None]:
    """Ask Linux to back ``spans`` (address, bytes) with huge pages at once; returns the bytes it did (whole huge
    pages inside the spans) and why not the rest, if not.

    Why: a decode step streams every weight once and reads the KV cache block by block. In 4 KB pages the TLB
    covers a few MB of them, so the step walks page tables as it goes; in 2 MB pages it walks 512 times fewer
    (docs/engine.md has the measured gains). ``MADV_HUGEPAGE`` alone would leave the pages already written
    as they are until the kernel's khugepaged gets round to them (minutes for a model); ``MADV_COLLAPSE`` copies
    them into huge pages now, their contents unchanged."""
    ranges = huge_page_spans(spans)
    if not ranges:
        return 0, "no span holds a whole huge page"
    if platform.system() != "Linux":
        return 0, f"huge pages are asked for on Linux only (this is {platform.system()})"
    madvise = _madvise()
    done, failures = 0, set()
    for start, end in ranges:
        # the advice keeps them huge (and lets khugepaged do it later where the collapse cannot be done now)
        if madvise(start, end - start, _MADV_HUGEPAGE) == 0 and madvise(start, end - start, _MADV_COLLAPSE) == 0:
            done += end - start
        else:
            failures.add(os.strerror(ctypes.get_errno()))
    if not failures:
        return done, None
    return done, f"{'; '.join(sorted(failures))} (transparent huge pages: {_thp_setting()})"


def advise_huge_pages(spans: list[tuple[int, int]]) -> bool:
    """``MADV_HUGEPAGE`` only, for memory not yet written: its pages then come in 2 MB at a time as it is first
    written, with no copy (:func:`back_with_huge_pages` copies pages already there). False where Linux refused."""
    if platform.system() != "Linux":
        return False
    madvise = _madvise()
    return all(madvise(start, end - start, _MADV_HUGEPAGE) == 0 for start, end in huge_page_spans(spans))


def _madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def _thp_setting() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return setting.read().strip()
    except OSError:
        return "not in this kernel"
