"""Packed prefill (prompts concatenated in one row, mask = causal AND same sequence) against each
prompt run alone, and the K/V it writes against a full recomputation when decoding continues."""

import torch

from lmserve.model.attention.sdpa import AttentionMetadata
from lmserve.model.config import ModelConfig
from lmserve.model.kv_cache import KVCache
from lmserve.model.llama import LlamaForCausalLM

CFG = ModelConfig(vocab_size=97, hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8,
                  intermediate_size=96, max_position_embeddings=64)


def alone(model, ids):
    """Logits of one sequence with no cache and no other sequence around."""
    n = len(ids)
    return model(torch.tensor([ids]), torch.arange(n)[None], AttentionMetadata.fresh(torch.tensor([n])))[0]


@torch.no_grad()
def test_packed_rows_equal_each_prompt_alone_and_fill_the_right_slots():
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG).init_weights(std=0.2).eval()
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (5, 1, 9)]
    slots = torch.tensor([4, 1, 6])
    q_lens = torch.tensor([len(p) for p in prompts])
    meta, positions = AttentionMetadata.packed(slots, q_lens)
    assert positions[0].tolist() == [*range(5), 0, *range(9)]  # each prompt starts at position 0

    cache = KVCache(CFG, num_slots=8, max_len=16, dtype=torch.float32)
    row = torch.tensor([[t for p in prompts for t in p]])
    ends = torch.cumsum(q_lens, 0) - 1
    packed = model(row, positions, meta, cache, logits_index=ends)  # [3, V]
    for i, p in enumerate(prompts):
        torch.testing.assert_close(packed[i], alone(model, p)[-1], rtol=1e-5, atol=1e-5)

    # one decode step for every prompt from what the packed prefill cached == full recomputation
    nxt = torch.randint(0, 97, (3,))
    starts = q_lens.clone()
    step = AttentionMetadata.for_cache(slots, starts, torch.ones(3, dtype=torch.long), 1)
    dec = model(nxt[:, None], starts[:, None], step, cache)[:, 0]
    for i, p in enumerate(prompts):
        torch.testing.assert_close(dec[i], alone(model, p + [int(nxt[i])])[-1], rtol=1e-5, atol=1e-5)
    assert cache.k[:, [0, 2, 3, 5, 7]].abs().sum() == 0  # slots outside the batch untouched


def test_packed_mask_is_block_diagonal_and_causal():
    meta, _ = AttentionMetadata.packed(torch.tensor([0, 1]), torch.tensor([2, 3]))
    m = meta.mask[0, 0].int().tolist()
    assert m == [[1, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0],
                 [0, 0, 1, 0, 0],
                 [0, 0, 1, 1, 0],
                 [0, 0, 1, 1, 1]]
