"""Builds a step's tensors from the scheduled batch and runs the model: last-position logits out."""

from __future__ import annotations

import torch
from torch import Tensor

from lmserve.model.attention import AttentionMetadata
from lmserve.model.kv_cache import KVCache
from lmserve.model.llama import LlamaForCausalLM

from .scheduler import PrefillChunk, ScheduledBatch


class ModelRunner:
    """`graphs`: decode steps replayed from CUDA graphs (cuda_graphs.DecodeGraphs) when given."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, device: torch.device, graphs=None):
        self.model = model
        self.cache = cache
        self.device = device
        self.graphs = graphs
        # batch-invariant serving: each sequence attends over exactly its own keys (attention.for_cache)
        self._call_cost = 0 if getattr(model, "batch_invariant", False) else None

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
        """New prompts go packed in one forward; a chunk continuing a long prompt runs on its own, so
        its cache view spans one slot (a shared view would span every slot in between)."""
        chunks = batch.prefill
        fresh = [c for c in chunks if c.start == 0]
        parts = [self._prefill_continued(c) for c in chunks if c.start > 0]
        if fresh:
            parts.append(self._prefill_packed(fresh))
        order = [c for c in chunks if c.start > 0] + fresh  # logits rows follow batch.prefill's order
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        if order != chunks:
            done = [c for c in order if c.completes_prompt]
            logits = logits[[done.index(c) for c in chunks if c.completes_prompt]]
        return logits

    def _prefill_continued(self, c: PrefillChunk) -> Tensor:
        """The next chunk of a prompt whose beginning is already cached: attends to it in place."""
        ids = torch.tensor(c.seq.request.prompt_ids[c.start: c.start + c.length], dtype=torch.long)[None]  # [1, L]
        starts, q_lens = self._tensor([c.start]), self._tensor([c.length])
        positions = starts[:, None] + torch.arange(c.length, device=self.device)[None, :]  # [1, L]
        meta = AttentionMetadata.for_cache(self._tensor([c.seq.slot]), starts, q_lens, c.length, call_cost=self._call_cost)
        last = self._tensor([c.length - 1] if c.completes_prompt else [])
        return self.model(ids.to(self.device), positions, meta, self.cache, logits_index=last)  # [0 or 1, V]

    def _prefill_packed(self, chunks: list[PrefillChunk]) -> Tensor:
        """New prompts concatenated into one row: no padding compute (prompts differ widely in length)."""
        ids = torch.tensor([t for c in chunks for t in c.seq.request.prompt_ids[: c.length]], dtype=torch.long)
        q_lens = self._tensor([c.length for c in chunks])  # [B]
        meta, positions = AttentionMetadata.packed(self._tensor([c.seq.slot for c in chunks]), q_lens)
        ends = torch.cumsum(q_lens, 0) - 1  # [B] last token of each prompt in the row
        last = ends[[i for i, c in enumerate(chunks) if c.completes_prompt]]
        return self.model(ids[None].to(self.device), positions, meta, self.cache, logits_index=last)  # [n, V]

    def _decode(self, batch: ScheduledBatch) -> Tensor:
        seqs = batch.decode
        if self.graphs is not None and len(seqs) <= self.graphs.max_batch:
            return self.graphs.run([s.token_at(s.num_cached) for s in seqs], [s.num_cached for s in seqs],
                                   [s.slot for s in seqs])
        ids = self._tensor([s.token_at(s.num_cached) for s in seqs])[:, None]  # [B, 1]
        starts = self._tensor([s.num_cached for s in seqs])  # [B]
        meta = AttentionMetadata.for_cache(self._tensor([s.slot for s in seqs]), starts,
                                           torch.ones_like(starts), 1, call_cost=self._call_cost)
        return self.model(ids, starts[:, None], meta, self.cache)[:, 0]  # [B, V]
