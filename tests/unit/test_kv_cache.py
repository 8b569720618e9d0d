"""The KV cache's memory: committed page by page as written, handed back on release (reads as zeros)."""

import mmap

import pytest
import torch

from lmserve.model.config import ModelConfig
from lmserve.model.kv_cache import KVCache
from lmserve.model.loader import release_freed_memory

# SmolLM2-135M's attention shapes: 30 layers, 3 KV heads of 64
SMOL = ModelConfig(vocab_size=64, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                   intermediate_size=1536, max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,), name="smol-kv")


def resident_bytes() -> int:
    """Resident memory of this process after the C allocator has handed its free lists back: the
    cache's pages are mappings of their own, and what earlier tests (or this one's temporaries) left
    on malloc's free lists is not the cache's (a full-suite run once measured 77 MB more after release
    than before, about the size of the 80 MB temporary this test's abs() makes)."""
    release_freed_memory()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_block_is_what_one_page_of_one_layer_and_head_holds():
    assert KVCache(SMOL, 2, 100, torch.float32).page_tokens == mmap.PAGESIZE // (64 * 4)  # 16 with 4 KiB pages
    assert KVCache(SMOL, 2, 100, torch.bfloat16).page_tokens == mmap.PAGESIZE // (64 * 2)
    c = KVCache(SMOL, 2, 100, torch.float32)
    assert c.max_len % c.page_tokens == 0 and c.max_len >= 100  # each slot's run starts on a page
    assert c.bytes_per_page == c.page_tokens * KVCache.bytes_per_token(SMOL, torch.float32)
    assert c.pages(1) == 1 and c.pages(c.page_tokens) == 1 and c.pages(c.page_tokens + 1) == 2


def test_virtual_size_beyond_ram_commits_only_what_is_written_and_release_gives_it_back():
    slots, max_len = 512, 4096
    before = resident_bytes()
    c = KVCache(SMOL, slots, max_len, torch.float32)
    assert c.virtual and c.nbytes > 80 * 2**30  # far more than this machine's RAM
    assert resident_bytes() - before < 32 * 2**20
    n = 1000
    c.k[:, 5, :, :n] = 1.0
    c.v[:, 5, :, :n] = 2.0
    written = c.pages(n) * c.bytes_per_page  # 44 MiB
    grown = resident_bytes() - before
    assert 0.9 * written < grown < written + 32 * 2**20
    c.k[0, 0:64].sum()  # reading untouched slots maps the shared zero page, not new memory
    assert resident_bytes() - before < written + 32 * 2**20
    c.copy_prefix(5, 9, 600)
    assert torch.equal(c.k[:, 9, :, :600], c.k[:, 5, :, :600]) and c.k[:, 9, :, 600:].abs().sum() == 0
    c.release(5, n)
    c.release(9, 600)
    assert resident_bytes() - before < 32 * 2**20
    assert c.k[:, 5].abs().sum() == 0 and c.v[:, 9].abs().sum() == 0  # released positions read as zeros


def test_release_zeroes_only_that_slot_and_works_on_a_dense_cache_too():
    for virtual in (True, False):
        c = KVCache(SMOL, 3, 64, torch.float32, virtual=virtual)
        c.k.fill_(float("nan"))
        c.v.fill_(float("nan"))
        c.release(1, 20)
        assert c.k[:, 1, :, :20].abs().sum() == 0 and c.v[:, 1, :, :20].abs().sum() == 0
        assert torch.isnan(c.k[:, 0]).all() and torch.isnan(c.k[:, 2]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_of_a_mapped_cache_are_views(dtype):
    c = KVCache(SMOL, 4, 64, dtype)
    k, v = c.view(3, 1, 3, 40)
    assert k.shape == (2, 3, 40, 64) and k.data_ptr() == c.k[3, 1].data_ptr()
    c.write(3, torch.tensor([2]), torch.tensor([7]), torch.ones(1, 3, 64, dtype=dtype), torch.ones(1, 3, 64, dtype=dtype))
    assert k[1, :, 7].sum() == 3 * 64 and v[1, :, 7].sum() == 3 * 64


def resident_pages(t: torch.Tensor) -> int:
    """Pages of a contiguous, page-aligned run of the cache that the kernel holds (mincore)."""
    import ctypes

    size = t.numel() * t.element_size()
    assert t.is_contiguous() and t.data_ptr() % mmap.PAGESIZE == 0 and size % mmap.PAGESIZE == 0
    vec = (ctypes.c_ubyte * (size // mmap.PAGESIZE))()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec)


# three layers of 2 KV heads of 64 (float32: 16 positions a page)
THREE = ModelConfig(vocab_size=64, hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64,
                    intermediate_size=256, max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,),
                    name="three", layer_windows=(20, 0, 20))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_a_sliding_layers_pages_below_its_window_go_back_and_a_copy_takes_only_the_window(dtype):
    """release(slot, upto, start, layers) hands back exactly the pages of [start, upto) in those layers
    (counted with mincore: codes and, in int8, scales), the rest stays; copy_prefix with a start and
    layers commits only the pages it writes."""
    pt = KVCache(THREE, 1, 1, dtype).page_tokens  # 16 in float32; int8's scales make it 256
    c = KVCache(THREE, 3, 8 * pt, dtype)
    n = 6 * pt + 5  # 7 pages
    x = torch.randn(2, n, 2, 64)
    for layer in range(3):
        c.write(layer, torch.full((n,), 1), torch.arange(n), x[0], x[1])

    def runs(slot, layer):  # every run of one (layer, slot): each head's K and V, and the scales
        out = [c.k[layer, slot, h] for h in range(2)] + [c.v[layer, slot, h] for h in range(2)]
        return out + ([c.scales[layer, slot]] if c.scales is not None else [])

    def held(r, lo, hi):  # OS pages of run r holding positions [lo, hi)
        row = r[0].numel() * r.element_size()
        return -(-hi * row // mmap.PAGESIZE) - lo * row // mmap.PAGESIZE

    assert all(resident_pages(r) == held(r, 0, n) for layer in range(3) for r in runs(1, layer))
    with pytest.raises(ValueError, match="starts on a page"):
        c.release(1, 4 * pt, pt + 1, (0, 2))
    c.release(1, 4 * pt, pt, (0, 2))
    for layer in range(3):
        for r in runs(1, layer):
            assert resident_pages(r) == held(r, 0, n) - (0 if layer == 1 else held(r, pt, 4 * pt))
    kept = c.k[1, 1].clone()
    for layer in (0, 2):
        assert (c.k[layer, 1, :, pt: 4 * pt] == 0).all() and (c.v[layer, 1, :, pt: 4 * pt] == 0).all()
        rows = c.k[layer, 1].float().abs().sum(-1)  # [heads, positions]: a written row is not all zeros
        assert (rows[:, :pt] > 0).all() and (rows[:, 4 * pt: n] > 0).all()
    assert torch.equal(c.k[1, 1], kept) and (kept[:, :n].float().abs().sum(-1) > 0).all()
    c.copy_prefix(1, 2, n, 4 * pt, (0, 2))  # a hit of n positions: the sliding layers' window only
    c.copy_prefix(1, 2, n, 0, (1,))
    assert [resident_pages(r) for r in runs(2, 0)] == [held(r, 4 * pt, n) for r in runs(2, 0)]
    assert [resident_pages(r) for r in runs(2, 1)] == [held(r, 0, n) for r in runs(2, 1)]
    assert torch.equal(c.k[:, 2, :, 4 * pt: n], c.k[:, 1, :, 4 * pt: n]) and torch.equal(c.k[1, 2], c.k[1, 1])
    if c.scales is not None:
        assert torch.equal(c.scales[:, 2, 4 * pt: n], c.scales[:, 1, 4 * pt: n])
    c.release(1)
    c.release(2)
    assert all(resident_pages(r) == 0 for slot in (1, 2) for layer in range(3) for r in runs(slot, layer))
