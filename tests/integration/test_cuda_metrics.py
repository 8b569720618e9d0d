"""A server on CUDA: bfloat16 by default, the memorized corpus served back, and the GPU memory
gauges parsed from /metrics accounting for the weights and the KV cache.

CI has no GPU, so this module is skipped there (see tests/unit/test_cuda_model.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from lmserve.client import Client

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")


def test_cuda_server_serves_in_bfloat16_and_reports_gpu_memory(start_server, trained_model_dir, training_prompts):
    cfg = json.loads((trained_model_dir / "config.json").read_text())
    slots, ctx = 8, cfg["max_position_embeddings"]
    srv = start_server(trained_model_dir, device="cuda", max_batch=slots)
    before = srv.metrics()
    (info,) = before.labels("lmserve_model_info")
    assert info["device"].startswith("cuda") and info["dtype"] == "bfloat16"  # the CUDA default
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2  # K and V, bf16
    weights, kv = before.get("lmserve_model_weights_bytes"), before.get("lmserve_kv_cache_bytes")
    assert kv == per_token * ctx * slots
    allocated = before.get("lmserve_cuda_memory_allocated_bytes")
    assert weights + kv <= allocated <= before.get("lmserve_cuda_memory_reserved_bytes")

    with Client(srv.target, timeout=120) as client:
        for prefix, continuation in training_prompts[:6]:
            result = client.generate(prefix, max_new_tokens=100)
            assert (result.text, result.finish_reason) == (continuation, "eos"), prefix

    after = srv.wait_idle()
    peak = after.get("lmserve_cuda_memory_peak_allocated_bytes")
    print(f"weights {weights / 2**20:.1f} MiB, KV {kv / 2**20:.1f} MiB, allocated {allocated / 2**20:.1f} MiB, "
          f"peak {peak / 2**20:.1f} MiB, reserved {after.get('lmserve_cuda_memory_reserved_bytes') / 2**20:.1f} MiB")
    assert weights + kv <= after.get("lmserve_cuda_memory_allocated_bytes") <= peak
    assert peak <= after.get("lmserve_cuda_memory_reserved_bytes")  # the allocator never hands memory back here
    assert after.total("lmserve_requests_total", status="ok") == 6
