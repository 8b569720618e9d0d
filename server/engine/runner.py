"""Builds a step's tensors from the scheduled batch, runs the model and samples: tokens out."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from lmserve.model.attention.backend import SdpaBackend
from lmserve.model.kv_cache import KVCache
from lmserve.model.llama import LlamaForCausalLM, Segment

from .sampler import SampleOutput, Sampler
from .scheduler import PrefillChunk, ScheduledBatch
from .sequence import Sequence


@dataclass
class RunOutput:
    """One step's sampled tokens, one row per sequence of batch.sampled() (prompts completed this step,
    then decodes; k + 1 rows for one verifying k drafts); `out` is None when no sequence was due a
    token (only prompt chunks ran)."""

    out: SampleOutput | None
    model_seconds: float  # of the step, spent in the model's forward (the rest built its inputs)
    sample_seconds: float


class ModelRunner:
    """`attention`: the backend chosen at load (model/attention/backend.py), which builds each batch's
    step attention; `graphs`: decode steps replayed from CUDA graphs (cuda_graphs.DecodeGraphs) when given."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, device: torch.device, attention: SdpaBackend,
                 graphs=None, rope_offset: Callable[[Sequence], int] | None = None):
        self.model = model
        self.cache = cache
        self.device = device
        self.attention = attention
        self.graphs = graphs
        self.rope_offset = rope_offset
        self.sampler = Sampler()
        self._model_seconds = 0.0

    def run(self, batch: ScheduledBatch, previous: RunOutput | None = None) -> RunOutput:
        """The model over the batch, then one sampled token per sequence due one.

        `previous`: the step launched before this one, when its tokens are not read back yet
        (overlapped steps); decode rows whose input is such a token read it from its `tokens` on the
        device. On CUDA nothing here waits for the device when every row is plain greedy."""
        # one logits row per sampled sequence; k + 1 for one verifying k drafts (each row greedy)
        sampled, drafts = batch.sampled(), None
        if batch.drafts:
            pairs = [(seq, draft, j) for seq, draft in zip(sampled, batch.sampled_drafts()) for j in range(1 + len(draft))]
            sampled = [seq for seq, _, _ in pairs]
            # each row's draft and its place in it: a constrained verifying row is masked as of that place
            drafts = [(draft, j) for _, draft, j in pairs]
        self._model_seconds = 0.0
        logits = self.step(batch, previous.out if previous is not None else None)
        t0 = time.perf_counter()
        out = self.sampler(logits, sampled, drafts) if sampled else None
        return RunOutput(out, self._model_seconds, time.perf_counter() - t0)

    def _tensor(self, rows: list[int]) -> Tensor:
        if self.device.type == "cuda":  # from pinned memory without blocking: a plain copy would wait for the stream
            return torch.tensor(rows, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _decode_ids(self, seqs: list[Sequence], previous: SampleOutput | None) -> Tensor:
        """Each decode row's input token [B]: the sequence's latest token, read from the previous step's
        sampled tokens on the device when it has not been read back yet."""
        ids = self._tensor([0 if s.pending else s.token_at(s.num_cached) for s in seqs])
        late = [(i, s.pending_row) for i, s in enumerate(seqs) if s.pending]
        if late:
            rows, src = zip(*late)
            ids[self._tensor(list(rows))] = previous.tokens[self._tensor(list(src))]
        return ids

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch, previous: SampleOutput | None = None) -> Tensor:
        """Logits [n, V] for batch.sampled(): prefill chunks that complete their prompt, then decodes.

        The whole step is one forward (LlamaForCausalLM.forward_segments): decodes, each continued
        prompt chunk and the new prompts packed in one row are batches of their own for attention,
        while every linear layer runs once over all their tokens, so a step that mixes prefill and
        decode reads the weights once. A decode-only step on CUDA replays its captured graph."""
        for copy in batch.kv_copies:  # prefix-cache hits: the shared positions come from an entry
            self.cache.copy_prefix(*copy)
        if not batch.prefill and not batch.drafts and self.graphs is not None:
            return self._decode_graph(batch.decode, previous)
        segments, last, offset = [], {}, 0
        for c in batch.prefill:
            if c.start > 0:  # a chunk continuing a long prompt: alone, so its cache view spans one slot
                segments.append(self._continued(c))
                last[c] = offset + c.length - 1
                offset += c.length
        fresh = [c for c in batch.prefill if c.start == 0]
        if fresh:
            segments.append(self._packed(fresh))
            for c in fresh:
                offset += c.length
                last[c] = offset - 1
        if batch.decode:
            segments.append(self._decode(batch, previous))
        decode_rows = segments[-1].input_ids.shape[0] if batch.decode else 0
        if batch.prefill:
            index = self._tensor([last[c] for c in batch.prefill if c.completes_prompt]
                                 + list(range(offset, offset + decode_rows)))
        else:  # a decode-only step: every row, made where it is read
            index = torch.arange(decode_rows, device=self.device)
        lora = self._lora_rows(batch) if self.model.lora is not None else None
        t0 = time.perf_counter()
        logits = self.model.forward_segments(segments, self.cache, index, lora)  # [n, V]
        self._model_seconds += time.perf_counter() - t0
        return logits

    def _lora_rows(self, batch: ScheduledBatch):
        """Each token's adapter slot (-1: the base) in the step's order (continued chunks, new prompts,
        decode rows with their drafts) as a linear/lora.LoraStep; None when no row has an adapter."""
        from lmserve.model.linear.lora import LoraStep

        def slot(seq: Sequence) -> int:
            return -1 if seq.lora is None else seq.lora[0]

        rows = [slot(c.seq) for c in batch.prefill if c.start > 0 for _ in range(c.length)]
        rows += [slot(c.seq) for c in batch.prefill if c.start == 0 for _ in range(c.length)]
        for i, s in enumerate(batch.decode):
            rows += [slot(s)] * (1 + (len(batch.draft_of(i)) if batch.drafts else 0))
        return LoraStep.of(rows, self.device)

    def _continued(self, c: PrefillChunk) -> Segment:
        """The next chunk of a prompt whose beginning is already cached (an earlier chunk, or a prefix-cache
        hit copied into the slot): attends to it in place."""
        ids = self._tensor(c.seq.tokens(c.start, c.start + c.length))[None]  # [1, L]
        meta, positions = self.attention.chunk(self._tensor([c.seq.slot]), self._tensor([c.start]), c.length)
        return Segment(ids, self._rope_rows(positions, [c.seq], [c.length]), meta)

    def _packed(self, chunks: list[PrefillChunk]) -> Segment:
        """New prompts concatenated into one row: no padding compute (prompts differ widely in length)."""
        ids = self._tensor([t for c in chunks for t in c.seq.tokens(0, c.length)])[None]  # [1, T] (a resumed
        # request's prompt and output so far)
        meta, positions = self.attention.packed(self._tensor([c.seq.slot for c in chunks]),
                                                self._tensor([c.length for c in chunks]))
        return Segment(ids, self._rope_rows(positions, [c.seq for c in chunks], [c.length for c in chunks]), meta)

    def _decode(self, batch: ScheduledBatch, previous: SampleOutput | None) -> Segment:
        """One row per decode token: a sequence's latest token, then (speculation) one row per drafted
        token at the following positions of its slot, each attending exactly as a decode row there."""
        seqs = batch.decode
        if not batch.drafts:
            ids = self._decode_ids(list(seqs), previous)[:, None]  # [B, 1]
            meta, positions = self.attention.decode([s.slot for s in seqs], [s.num_cached for s in seqs])
            return Segment(ids, self._rope_rows(positions, list(seqs), [1] * len(seqs)), meta)
        tokens, slots, starts, counts = [], [], [], []
        for i, s in enumerate(seqs):  # drafts only where the latest token is known on the host
            row = [s.token_at(s.num_cached), *batch.draft_of(i)]
            tokens += row
            slots += [s.slot] * len(row)
            starts += range(s.num_cached, s.num_cached + len(row))
            counts.append(len(row))
        meta, positions = self.attention.decode(slots, starts)
        return Segment(self._tensor(tokens)[:, None], self._rope_rows(positions, list(seqs), counts), meta)  # [R, 1]

    def _rope_rows(self, positions: Tensor, seqs: list[Sequence], counts: list[int]) -> Tensor:
        """The tokens' rows of the RoPE tables: their positions, shifted where a LongRoPE model takes a
        sequence's long factors from position 0 (config.rope_row_offset); `counts`: each sequence's tokens,
        in the order of positions."""
        if self.rope_offset is None:
            return positions
        offsets = [self.rope_offset(s) for s in seqs]
        if not any(offsets):
            return positions
        per_token = [o for o, n in zip(offsets, counts) for _ in range(n)]
        return positions + self._tensor(per_token).view(positions.shape)

    def _decode_graph(self, seqs: list[Sequence], previous: SampleOutput | None) -> Tensor:
        t0 = time.perf_counter()
        logits = self.graphs.run(self._decode_ids(seqs, previous), [s.num_cached for s in seqs], [s.slot for s in seqs])
        self._model_seconds += time.perf_counter() - t0
        return logits
