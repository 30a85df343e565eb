"""The engine process keeps freed memory in its heap (glibc), so large steps reuse pages instead of faulting; its
weights and KV cache go into 2 MB pages where the kernel allows it."""

import ctypes
import platform

import pytest
import torch

from app.engine.host_memory import (HUGE_PAGE, advise_huge_pages, back_with_huge_pages, huge_page_spans, keep_freed_memory,
                                    tensor_spans)

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc thresholds are glibc's (this libc: "
                           f"{platform.libc_ver()[0] or 'unknown'})")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@glibc
@pytest.mark.parametrize("megabytes", [16, 48])  # 48: above glibc's largest mmap threshold (32 MB)
def test_a_large_block_comes_from_the_heap_and_stays_there_after_free(megabytes):
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _MallInfo2
    assert keep_freed_memory()
    before = libc.mallinfo2()
    block = libc.malloc(megabytes << 20)
    assert block
    during = libc.mallinfo2()
    libc.free(block)
    after = libc.mallinfo2()
    assert during.hblkhd == before.hblkhd  # not an mmap of its own (glibc's default: above 128 KB it is)
    assert after.arena >= during.arena >= megabytes << 20 and after.fordblks >= megabytes << 20  # freed, kept in the heap


# ---- weights and KV cache in huge pages ----------------------------------------------------------------------------

MB = 1 << 20


def test_huge_page_spans_are_the_whole_2mb_pages_inside_spans_merged_across_small_gaps():
    base = 64 * HUGE_PAGE
    spans = [(base + 100, 3 * MB), (base + 3 * MB + 4096, 3 * MB),  # 4 KB apart: one span, base+100 .. base+6 MB+4 KB
             (base + 20 * MB, 1 * MB),  # alone and smaller than a huge page: nothing
             (base + 40 * MB - 10, 4 * MB + 20)]  # straddles: the two whole pages inside
    assert huge_page_spans(spans) == [(base + HUGE_PAGE, base + 3 * HUGE_PAGE), (base + 40 * MB, base + 44 * MB)]
    assert huge_page_spans([(base, 1 * MB), (base + 1 * MB + 512 * 1024, 1 * MB)]) == []  # 512 KB apart: not merged


def test_tensor_spans_skip_what_has_no_address_of_its_own():
    dense = torch.zeros(1000)
    spans = tensor_spans([dense, torch.zeros(10, device="meta")])
    assert spans == [(dense.untyped_storage().data_ptr(), 4000)]


@pytest.mark.skipif(platform.system() != "Linux", reason="huge pages are asked for on Linux only")
def test_tensors_backed_by_huge_pages_keep_their_contents_and_the_kernel_counts_the_pages():
    tensors = [torch.randn(3 * MB) for _ in range(3)]  # 12 MB each: several whole huge pages
    expected = [t.clone() for t in tensors]
    before = _anon_huge_pages()
    done, why = back_with_huge_pages(tensor_spans(tensors))
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
    wanted = sum(end - start for start, end in huge_page_spans(tensor_spans(tensors)))
    if why is None:  # a kernel with MADV_COLLAPSE (6.1+) and huge pages not turned off
        assert done == wanted and _anon_huge_pages() - before >= wanted
    else:  # says why, naming the setting
        assert done < wanted and "transparent huge pages" in why


def _thp_offered() -> bool:
    """Transparent huge pages for memory that asks for them: "always" or "madvise" (not "never", not absent)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return "[never]" not in setting.read() and platform.system() == "Linux"
    except OSError:
        return False


def _anon_huge_pages() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("AnonHugePages:"))


@pytest.mark.skipif(_thp_offered() is False, reason="this kernel offers no transparent huge pages")
def test_a_pool_advised_before_it_is_written_is_all_in_huge_pages_once_collapsed():
    pool = torch.empty(6 * MB)  # 24 MB, as the KV pool is made: advised, then zeroed
    assert advise_huge_pages(tensor_spans([pool]))
    pool.zero_()  # fresh memory now comes in 2 MB pages; heap memory written before keeps its 4 KB pages
    done, why = back_with_huge_pages(tensor_spans([pool]))  # ... which the collapse turns into huge pages
    wanted = sum(end - start for start, end in huge_page_spans(tensor_spans([pool])))
    assert (done, why) == (wanted, None) or (done < wanted and "transparent huge pages" in why)
    assert torch.count_nonzero(pool) == 0
