"""A checkpoint's tensors as sources: each is read from its file when a loader asks, never held.

Loading at the checkpoint's own size means no step holds the whole model in another form: the file
is mapped, each tensor is turned into its serving format on its own, and the pages it was read from
are handed back (`release`) before the next one is read. A mapped page counts as resident once
touched, so without the release a loader would hold the file and its serving copy at once.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

PAGE = mmap.PAGESIZE


def contiguous_range(index: Tensor) -> tuple[int, int] | None:
    """(start, stop) when a 1-D index is start, start + 1, ..., stop - 1; else None."""
    if index.dim() != 1 or len(index) == 0:
        return None
    start, stop = int(index[0]), int(index[-1]) + 1
    return (start, stop) if stop - start == len(index) and bool((index.diff() == 1).all()) else None


class MappedFile:
    """A read-only mapping of a checkpoint file whose touched ranges can be given back."""

    def __init__(self, path):
        with open(path, "rb") as f:
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def __len__(self) -> int:
        return len(self.buf)

    def release(self, start: int, length: int) -> None:
        """Drop [start, start + length) from this process's resident pages (the page cache keeps them;
        a later read faults them in again, so this never loses data)."""
        lo = start // PAGE * PAGE
        hi = min(len(self.buf), -(-(start + length) // PAGE) * PAGE)
        if hi > lo and hasattr(mmap, "MADV_DONTNEED"):
            self.buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        try:
            self.buf.close()
        except BufferError:  # a caller still holds a view; the mapping closes when it is dropped
            pass


def _nothing():
    return None


@dataclass(eq=False)
class TensorSource:
    """One tensor of a checkpoint by its Hugging Face name.

    read(dtype): the tensor in that dtype (dequantized when the file stores blocks): a fresh tensor
        read from the file, or the tensor itself for a source already in memory (never write to it);
    rows(index): only some rows of a 2-D tensor (an embedding's looked-up rows, a head's slice);
    blocks(): the file's own blocks where a kernel serves them as they are (GGUF Q4_0/Q4_1/Q8_0 and
        Q4_K/Q5_K/Q6_K), else None;
    release(): hand back the file pages the reads touched.
    """

    name: str
    shape: tuple[int, ...]
    stored_as: str  # "F32", "BF16", "Q4_K", ...: the type in the file
    nbytes: int  # bytes in the file
    _read: Callable[[], Tensor]  # float32 or the stored float dtype, in the Hugging Face layout
    _rows: Callable[[Tensor], Tensor] | None = None
    _blocks: Callable[[], object] = _nothing
    _release: Callable[[], None] = _nothing
    meta: dict = field(default_factory=dict)
    _read_as: Callable[[torch.dtype], Tensor] | None = None  # read straight into a dtype (no float32 copy)

    def read(self, dtype: torch.dtype = torch.float32) -> Tensor:
        t = self._read() if self._read_as is None or dtype == torch.float32 else self._read_as(dtype)
        return t if t.dtype == dtype else t.to(dtype)

    def rows(self, index: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        t = self._rows(index) if self._rows is not None else self._read()[index]
        return t if t.dtype == dtype else t.to(dtype)

    def blocks(self):
        return self._blocks()

    def release(self) -> None:
        self._release()

    def row_block(self, name: str, start: int, stop: int) -> "TensorSource":
        """Rows start .. stop - 1 of a 2-D tensor as a source of its own (a part of a fused projection);
        reading it reads the whole tensor once."""
        def rows(index: Tensor) -> Tensor:
            return self._rows(index + start) if self._rows is not None else self._read()[index + start]

        def blocks():
            found = self._blocks()
            return None if found is None else found.rows(torch.arange(start, stop))

        n = stop - start
        return TensorSource(name, (n, *self.shape[1:]), self.stored_as, self.nbytes * n // self.shape[0],
                            lambda: self._read()[start:stop].contiguous(), rows, blocks, self._release, self.meta)

    def mapped(self, fn: Callable[[Tensor], Tensor]) -> "TensorSource":
        """This source with `fn` applied to every read (its blocks, no longer what it reads, dropped)."""
        return TensorSource(self.name, self.shape, self.stored_as, self.nbytes, lambda: fn(self._read()),
                            lambda index: fn(self.rows(index)), _release=self._release, meta=self.meta)

    @staticmethod
    def of(name: str, tensor: Tensor, blocks=None) -> "TensorSource":
        """A tensor already in memory (tests, trained models) as a source."""
        return TensorSource(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.").upper(),
                            tensor.numel() * tensor.element_size(), lambda: tensor,
                            _blocks=(lambda: blocks) if blocks is not None else _nothing)


__all__ = ["MappedFile", "TensorSource", "contiguous_range"]
