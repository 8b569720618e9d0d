"""Memory for the packed weights a decode step streams: anonymous mappings advised for transparent huge
pages (madvise MADV_HUGEPAGE), where the OS offers them; plain torch memory elsewhere.

A batch-1 step reads every weight once from DRAM. In 4 KiB pages that walk meets a page boundary every
4 KiB, where the hardware prefetchers stop and a TLB miss waits on a page walk; in 2 MiB pages the
prefetchers run on. Linux's default THP mode, "madvise", gives huge pages only to mappings that ask, and
torch's allocator does not ask. Measured on the 2-core Zen 4 VM (2026-12-05, `lmserve bench kquant-kernels`' page_placement: a
Llama-3.2-1B step's layer linears at one row, the two placements taking turns in 16 pairs): 1.3% faster
(12 of 16 pairs) while the VM's memory read ~35 GB/s; in a scratch run while it read 50-58 GB/s,
5-10%. A buffer's bytes and every kernel's results are the same either way.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20  # smaller buffers cannot hold one


def weight_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of `nbytes` for a packed weight: in a mapping of its own advised for
    huge pages when it is at least one huge page and the OS takes the advice, else torch.empty's."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):  # no THP in this kernel, or no mapping: ordinary memory serves
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping until the tensor goes


__all__ = ["HUGE_PAGE", "weight_buffer"]
