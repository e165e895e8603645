"""Huge pages for large host buffers that the cpu kernels stream (Linux's transparent huge pages).

A step streams every state buffer once; over 4 KiB pages that is a TLB miss every 4 KiB of each
of its five to seven arrays. numpy asks the kernel for huge pages on its own large allocations
(``madvise(MADV_HUGEPAGE)``, numpy >= 1.22); torch's CPU allocator does not (unless
``THP_MEM_ALLOC_ENABLE=1``), so the torch front end's state buffers and CPUOffload's host copies
stepped on 4 KiB pages: the cpu backend's AdamW step over 64M parameters on 2 threads took 6-14%
less time on huge pages (docs/benchmarks.md). Advice only: where the kernel has transparent huge
pages off (``never``), on other systems, or when the call fails, nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Optional

MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE = 1 << 21  # x86-64 and arm64 with 4 KiB base pages
_libc: Optional[ctypes.CDLL] = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask for huge pages over the whole 2 MiB pages inside ``[address, address + nbytes)``; call it
    before the memory is first written (pages faulted in before stay 4 KiB until the kernel's
    background collapse). True when advice was given."""
    if not sys.platform.startswith("linux"):
        return False
    start = (address + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    stop = (address + nbytes) & ~(HUGE_PAGE - 1)
    if stop <= start:
        return False
    try:
        return _madvise()(start, stop - start, MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


__all__ = ["advise_huge_pages", "HUGE_PAGE"]
