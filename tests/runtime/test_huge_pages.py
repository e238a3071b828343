"""The KV pool's huge pages: which ranges are asked for, and that the kernel really backs them."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jserve.runtime.huge_pages import HUGE_PAGE, advise_huge_pages, collapse, huge_page_ranges


def whole_pages(address: int, nbytes: int) -> list[int]:
    """Every 2 MiB page inside [address, address + nbytes), counted one by one."""
    first = address // HUGE_PAGE
    last = (address + nbytes) // HUGE_PAGE + 1
    return [
        p * HUGE_PAGE
        for p in range(first, last + 1)
        if address <= p * HUGE_PAGE and (p + 1) * HUGE_PAGE <= address + nbytes
    ]


@pytest.mark.parametrize("mib", [0.5, 3, 7.5])
def test_ranges_are_the_whole_huge_pages_inside_the_buffer(mib):
    x = jnp.ones((int(mib * 2**20) // 4,), jnp.float32)
    pages = whole_pages(x.unsafe_buffer_pointer(), x.nbytes)
    expected = [(pages[0], len(pages) * HUGE_PAGE)] if pages else []
    assert huge_page_ranges([x]) == expected


def anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping of /proc/self/smaps that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def test_collapse_backs_the_range_with_huge_pages_and_keeps_the_values():
    values = np.arange(12 * 2**20 // 4, dtype=np.float32)
    x = jnp.asarray(values) + 0  # an XLA-allocated buffer, as the pool is
    ranges = huge_page_ranges([x])
    done = collapse(ranges)
    if done == 0:
        pytest.skip("this kernel gives no huge pages to madvise (THP off, or before Linux 6.1)")
    assert done == sum(length for _, length in ranges)
    assert anon_huge_bytes(ranges[0][0]) >= done
    np.testing.assert_array_equal(np.asarray(x), values + 0)


def test_advise_on_a_thread_leaves_the_arrays_usable():
    x = jnp.full((6 * 2**20 // 4,), 3.0, jnp.float32)
    thread = advise_huge_pages([x])
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert float((x * 2).sum()) == 6.0 * x.size
