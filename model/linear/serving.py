"""Linear layers rebuilt for serving: fused projections, each multiply on a chosen kernel.

Training and the reference paths use plain `nn.Linear` with Hugging Face names. A loaded model
is converted once (`LlamaForCausalLM.prepare_for_inference`):

- projections that read the same input become one GEMM (q|k|v, gate|up): fewer, larger
  matmuls and fewer dispatches per layer;
- each fused weight is handed to a kernel (kernels.py: dense, onednn, int8, int4). The loader
  picks the kernel per role by measuring on this machine (precision.py); without a plan the
  default here keeps the weight's dtype and, on CPU in float32, prepacks it for oneDNN.

Where a linear's weight comes from is the caller's `source_of(linear)`: a loader reading a
checkpoint hands each role a WeightSource that reads the file when a kernel needs floats and carries
GGUF Q4_0/Q4_1 and Q8_0 blocks, so int4 (and the native int8 kernel) serve the file's own codes
instead of re-quantizing the dequantized floats. By default it is the module's own weight.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .kernels import DenseLinear, OneDNNLinear, ServingLinear, WeightSource, build, onednn_supports

def onednn_available(weight: Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_supports(torch.float32)


def inference_linear(weight: Tensor, bias: Tensor | None = None) -> nn.Module:
    """The default serving linear for a fixed weight [out, in]: oneDNN on CPU float32, else dense."""
    if onednn_available(weight):
        try:
            return OneDNNLinear(weight, bias)
        except RuntimeError:  # a oneDNN build that cannot take this shape: dense below
            pass
    return DenseLinear(weight, bias)


def own_weight(layer: nn.Linear) -> WeightSource:
    """A linear's own (materialized) weight and bias as a source."""
    return WeightSource(layer.weight.detach(), None if layer.bias is None else layer.bias.detach())


def fuse_linears(role: str, *layers: nn.Linear, source_of=own_weight) -> nn.Module:
    """One default serving layer computing the concatenation of the outputs of `layers` (same input)."""
    src = WeightSource.cat([source_of(m) for m in layers])
    held = layers[0].weight
    # the layers' own dtype (a joined source holds no weight of its own to read it from); float32 from a file
    weight = src.floats(held.dtype if not held.is_meta else torch.float32)
    return inference_linear(weight, src.bias)


def planned_linears(kernels: dict[str, str], dtype: torch.dtype, source_of=own_weight):
    """A `make` for prepare_for_inference: each role on its planned kernel, computing in `dtype`, built
    from `source_of(linear)` for each fused part."""
    def make(role: str, *layers: nn.Linear) -> nn.Module:
        return build(kernels[role], WeightSource.cat([source_of(m) for m in layers]), dtype)
    return make


def held_bytes(module: nn.Module) -> int:
    """Bytes of the weights a module holds: parameters and serving layouts, each storage once."""
    seen: dict[int, int] = {p.data_ptr(): p.numel() * p.element_size() for p in module.parameters()}
    extra = 0
    for m in module.modules():
        if isinstance(m, ServingLinear):
            for b in m.buffers(recurse=False):
                seen.setdefault(b.data_ptr(), b.numel() * b.element_size())
            if isinstance(m, OneDNNLinear):
                extra += m.nbytes - sum(b.numel() * b.element_size() for b in m.buffers(recurse=False))
    return sum(seen.values()) + extra


def step_bytes(module: nn.Module) -> int:
    """Bytes of the serving linears' weight layouts: what a batch-1 decode step reads from memory (every
    linear, the LM head included; an embedding table is only gathered from)."""
    return sum(m.nbytes for m in module.modules() if isinstance(m, ServingLinear))


__all__ = ["inference_linear", "fuse_linears", "planned_linears", "held_bytes", "step_bytes",
           "onednn_available", "own_weight"]
