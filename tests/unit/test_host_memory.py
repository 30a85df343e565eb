"""The engine process keeps freed memory in its heap (glibc), so large steps reuse pages instead of faulting."""

import ctypes
import platform

import pytest

from app.engine.host_memory import keep_freed_memory

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
