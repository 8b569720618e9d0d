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
