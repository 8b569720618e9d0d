"""Builds a step's tensors from the scheduled batch and runs the model: last-position logits out."""

from __future__ import annotations

import torch
from torch import Tensor

from lmserve.model.attention import AttentionMetadata
from lmserve.model.kv_cache import KVCache
from lmserve.model.llama import LlamaForCausalLM

from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, device: torch.device):
        self.model = model
        self.cache = cache
        self.device = device
        self.max_pos = model.config.max_position_embeddings - 1

    def _tensor(self, rows: list[int]) -> Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> Tensor:
        """Logits [N, V] for batch.sampled(): prefill chunks that complete their prompt, then decodes."""
        parts: list[Tensor] = []
        if batch.prefill:
            parts.append(self._prefill(batch))
        if batch.decode:
            parts.append(self._decode(batch))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _prefill(self, batch: ScheduledBatch) -> Tensor:
        chunks = batch.prefill
        if all(c.start == 0 for c in chunks):
            return self._prefill_packed(batch)
        L = max(c.length for c in chunks)
        ids = torch.zeros(len(chunks), L, dtype=torch.long)
        for b, c in enumerate(chunks):
            ids[b, : c.length] = torch.tensor(c.seq.request.prompt_ids[c.start: c.start + c.length])
        starts = self._tensor([c.start for c in chunks])  # [B]
        q_lens = self._tensor([c.length for c in chunks])  # [B]
        positions = (starts[:, None] + torch.arange(L, device=self.device)[None, :]).clamp_(max=self.max_pos)  # [B, L]
        meta = AttentionMetadata.for_cache(self._tensor([c.seq.slot for c in chunks]), starts, q_lens, L)
        last = self._tensor([b * L + c.length - 1 for b, c in enumerate(chunks) if c.completes_prompt])
        logits = self.model(ids.to(self.device), positions, meta, self.cache, logits_index=last)  # [n, V]
        return logits

    def _prefill_packed(self, batch: ScheduledBatch) -> Tensor:
        """New prompts concatenated into one row: no padding compute (prompts differ widely in length)."""
        chunks = batch.prefill
        ids = torch.tensor([t for c in chunks for t in c.seq.request.prompt_ids[: c.length]], dtype=torch.long)
        q_lens = self._tensor([c.length for c in chunks])  # [B]
        meta, positions = AttentionMetadata.packed(self._tensor([c.seq.slot for c in chunks]), q_lens)
        ends = torch.cumsum(q_lens, 0) - 1  # [B] last token of each prompt in the row
        last = ends[[i for i, c in enumerate(chunks) if c.completes_prompt]]
        return self.model(ids[None].to(self.device), positions, meta, self.cache, logits_index=last)  # [n, V]

    def _decode(self, batch: ScheduledBatch) -> Tensor:
        seqs = batch.decode
        ids = self._tensor([s.token_at(s.num_cached) for s in seqs])[:, None]  # [B, 1]
        starts = self._tensor([s.num_cached for s in seqs])  # [B]
        meta = AttentionMetadata.for_cache(self._tensor([s.slot for s in seqs]), starts,
                                           torch.ones_like(starts), 1)
        return self.model(ids, starts[:, None], meta, self.cache)[:, 0]  # [B, V]
