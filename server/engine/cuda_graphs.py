"""Decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is a few hundred tiny kernels, and launching them from
Python costs far more than running them. Each batch-size bucket's step (the model forward with the
backend's `graph_decode` attention) is captured once at start-up and replayed with new token ids,
positions and slots copied into its static input buffers: one launch per step.

Two layouts: over a dense cache (CudaGraphsBackend) the captured step reads every slot's whole
max_len, masked by each slot's length; over a paged cache (PagedBackend) it reads, for each row,
the pages of the block table up to its own position: the block table is a static input edited in
place as pages are mapped, so a replay reads only the pages held.

A batch of n is run in the smallest bucket >= n; the extra rows repeat row 0 (same token, slot and
position), so they write the same K/V to the same place and their logits are dropped. Graphs share
one memory pool, captured from the largest bucket down, since they never run at the same time.
The logits returned are a view of the bucket's static output: read them before the next replay.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmserve.model.attention.backend import CudaGraphsBackend
from lmserve.model.kv_cache import KVCache
from lmserve.model.llama import LlamaForCausalLM


def buckets_up_to(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16, and max_batch itself."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return sorted({*small, *range(16, max_batch, 16), max_batch})


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, max_batch: int, warmups: int = 2, attention=None):
        self.model, self.cache = model, cache
        # the backend whose graph_decode the graphs capture (CudaGraphsBackend or PagedBackend)
        self.attention = attention if attention is not None else CudaGraphsBackend(cache.k.device)
        self.buckets = buckets_up_to(max_batch)
        self.max_batch = self.buckets[-1]
        device = cache.k.device
        self._inputs = torch.zeros(3, self.max_batch, dtype=torch.long, device=device)  # ids, positions, slots
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Tensor] = {}
        self.replays = 0
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in reversed(self.buckets):
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # warm-up: kernels chosen and workspaces allocated before capture
                    for _ in range(warmups):
                        self._forward(b)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._outputs[b] = self._forward(b)
                self._graphs[b] = graph
            torch.cuda.synchronize(device)
            cache.k.zero_()  # capture wrote K/V of token 0 at slot 0, position 0 (a paged cache: its scratch page)
            cache.v.zero_()

    def _forward(self, b: int) -> Tensor:
        ids, positions, slots = self._inputs[0, :b], self._inputs[1, :b], self._inputs[2, :b]
        meta = self.attention.graph_decode(slots, positions, self.cache)
        return self.model(ids[:, None], positions[:, None], meta, self.cache)[:, 0]  # [b, V]

    def run(self, ids: Tensor, positions: list[int], slots: list[int]) -> Tensor:
        """Logits [n, V] of one decode step for n <= max_batch sequences; `ids` [n] on the device (the
        previous step's sampled tokens can feed it without a round trip). Nothing here waits for the
        device: positions and slots travel from pinned memory without blocking."""
        n = ids.shape[0]
        b = next(size for size in self.buckets if size >= n)
        pad = b - n
        host = torch.tensor([positions + positions[:1] * pad, slots + slots[:1] * pad], dtype=torch.long,
                            pin_memory=True)
        self._inputs[1:, :b].copy_(host, non_blocking=True)
        self._inputs[0, :n].copy_(ids)
        if pad:
            self._inputs[0, n:b].copy_(ids[:1].expand(pad))
        self._graphs[b].replay()
        self.replays += 1
        return self._outputs[b][:n]
