"""Back the KV pool with 2 MiB pages, where Linux allows.

On CPU every array is host memory in 4 KiB pages unless the kernel's transparent huge pages
are on for it, and distributions default to `madvise` mode: only ranges a program asks for get
them. A decode step reads each sequence's K/V pages from all over a pool of a gigabyte, one
head's page of a block at a time, so nearly every page it reads is a TLB miss and a page walk.
XLA allocates and fills the pool itself, so its range is collapsed in place after the fact
(MADV_COLLAPSE, Linux 6.1+). That copies the pool, which takes time in proportion to its
size, so it runs on a thread of its own while the engine goes on starting. Everything here is
best effort: another OS, an older kernel or THP turned off leave the memory as it was.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
from collections.abc import Iterable

import jax

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux, every architecture
MADV_COLLAPSE = 25


@functools.cache
def _madvise():  # libc's madvise, or None off Linux
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_page_ranges(arrays: Iterable[jax.Array]) -> list[tuple[int, int]]:
    """(start, length) of the whole 2 MiB pages inside each CPU array's buffers; arrays on other
    platforms, or too small to hold one such page, give none."""
    ranges = []
    for array in jax.block_until_ready(list(arrays)):  # filled before its pages are moved
        for shard in array.addressable_shards:
            if shard.device.platform != "cpu":
                continue
            address = shard.data.unsafe_buffer_pointer()
            start = -(-address // HUGE_PAGE) * HUGE_PAGE
            end = (address + shard.data.nbytes) // HUGE_PAGE * HUGE_PAGE
            if end > start:
                ranges.append((start, end - start))
    return ranges


def collapse(ranges: list[tuple[int, int]]) -> int:
    """Ask for each range to be huge pages now; returns the bytes the kernel collapsed."""
    madvise = _madvise()
    if madvise is None:
        return 0
    done = 0
    for start, length in ranges:
        # HUGEPAGE marks the range for later faults; COLLAPSE converts the pages already
        # there. Either may be refused (EINVAL: THP off, an old kernel).
        if madvise(start, length, MADV_HUGEPAGE) or madvise(start, length, MADV_COLLAPSE):
            log.debug("huge pages refused (errno %d) for %d bytes", ctypes.get_errno(), length)
        else:
            done += length
    return done


def advise_huge_pages(arrays: Iterable[jax.Array]) -> threading.Thread:
    """Collapse the arrays' memory into huge pages on a daemon thread (started, returned so a
    caller may join it). The addresses are read here, before the arrays can be donated: a
    donated buffer that XLA aliases keeps its memory, and so its pages."""
    ranges = huge_page_ranges(arrays)

    def run() -> None:
        wanted = sum(length for _, length in ranges) / 2**20
        log.info("%.0f of %.0f MiB now in huge pages", collapse(ranges) / 2**20, wanted)

    thread = threading.Thread(target=run, name="huge-pages", daemon=True)
    thread.start()
    return thread
