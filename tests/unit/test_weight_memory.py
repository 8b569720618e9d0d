"""Packed weights in mappings advised for transparent huge pages (weight_memory.py): where the advice
lands (the kernel's own record of the mapping, /proc/self/smaps), what stays in torch's memory, and the
same bytes and results either way."""

from __future__ import annotations

import mmap

import pytest
import torch
from lmserve.model.linear import quant_matmul as QM
from lmserve.model.linear.formats import KQuantBlocks
from lmserve.model.linear.weight_memory import HUGE_PAGE, weight_buffer

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) here")


def vm_flags(t: torch.Tensor) -> set[str]:
    """The VmFlags of the mapping that holds t's first byte (hg: advised for huge pages)."""
    addr, flags, inside = t.data_ptr(), None, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            flags = set(line.split()[1:])
            break
    assert flags is not None, "no mapping holds the tensor"
    return flags


def test_a_buffer_of_a_huge_page_or_more_is_advised_and_a_smaller_one_is_torchs():
    """The small one is checked by its storage, not its mapping's flags: after a whole suite in one
    process, a torch.empty buffer was once found in a mapping with the hg flag."""
    big = weight_buffer(3 * HUGE_PAGE + 4096)
    assert big.dtype == torch.uint8 and big.numel() == 3 * HUGE_PAGE + 4096
    assert "hg" in vm_flags(big), vm_flags(big)
    assert not big.untyped_storage().resizable()  # a mapping of its own (torch.frombuffer's storage)
    big.fill_(7)  # writable, every byte
    assert int(big.sum()) == 7 * big.numel()
    # torch's own memory (a resizable storage); its mapping's flags are not asked: glibc may place it in
    # any heap of the process
    small = weight_buffer(HUGE_PAGE - 1)
    assert small.numel() == HUGE_PAGE - 1 and small.untyped_storage().resizable()


def test_packed_weights_land_in_advised_memory_with_the_bytes_torch_memory_gets(quant_kernel):
    """A Llama-3.2-1B gate_up slice packed as int8, int4 and K-quant: in an advised mapping, and bytewise
    what the torch ops pack into ordinary memory (the kernels then read the same bytes)."""
    g = torch.Generator().manual_seed(0)
    q8 = QM.Q80Blocks(torch.randint(-127, 128, (2048, 2048), dtype=torch.int8, generator=g),
                      torch.rand(2048, 64, generator=g).half().float())
    q4 = QM.Q41Blocks(torch.randint(0, 16, (2048, 2048), dtype=torch.uint8, generator=g), q8.d, -8 * q8.d)
    for packed, want in ((QM.pack_q8(q8), QM.pack_q8_torch(q8)), (QM.pack_q4(q4), QM.pack_q4_torch(q4))):
        assert packed.numel() >= HUGE_PAGE and "hg" in vm_flags(packed)
        assert torch.equal(packed, want)
    raw = torch.randint(0, 256, (2048, 2048 // 256 * 144), dtype=torch.uint8, generator=g)  # Q4_K's bytes
    packed = QM.pack_kquant([KQuantBlocks.from_raw(raw.numpy(), 12)])
    assert packed.numel() >= HUGE_PAGE and "hg" in vm_flags(packed)
    table = packed.numel() - raw.numel()
    assert torch.equal(packed[table:], quant_kernel.pack_kquant(raw, 2048, 12))  # into torch.empty's memory
