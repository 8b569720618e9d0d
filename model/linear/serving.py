"""Linear layers rebuilt for serving: fused projections, each multiply on a chosen kernel.

Training and the reference paths use plain `nn.Linear` with Hugging Face names. A loaded model
is converted once (`LlamaForCausalLM.prepare_for_inference`):

- projections that read the same input become one GEMM (q|k|v, gate|up): fewer, larger
  matmuls and fewer dispatches per layer;
- each fused weight is handed to a kernel (kernels.py: dense, onednn, int8, int4). The loader
  picks the kernel per role by measuring on this machine (precision.py); without a plan the
  default here keeps the weight's dtype and, on CPU in float32, prepacks it for oneDNN.

GGUF Q4_0/Q4_1 and Q8_0 tensors arrive with their blocks attached (`linear.q41`, `linear.q80`), so
int4 (and the native int8 kernel) serve the file's own codes instead of re-quantizing the
dequantized floats.
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


def source_of(*layers: nn.Linear) -> WeightSource:
    """The concatenated weight (and Q4_1 blocks, when every part has them) of same-input linears."""
    return WeightSource.cat([WeightSource(m.weight, m.bias, getattr(m, "q41", None), getattr(m, "q80", None)) for m in layers])


def fuse_linears(role: str, *layers: nn.Linear) -> nn.Module:
    """One default serving layer computing the concatenation of the outputs of `layers` (same input)."""
    src = source_of(*layers)
    return inference_linear(src.weight.detach(), None if src.bias is None else src.bias.detach())


def planned_linears(kernels: dict[str, str], dtype: torch.dtype):
    """A `make` for prepare_for_inference: each role on its planned kernel, computing in `dtype`."""
    def make(role: str, *layers: nn.Linear) -> nn.Module:
        src = source_of(*layers)
        return build(kernels[role], WeightSource(src.weight.detach().float(), src.bias, src.q41, src.q80), dtype)
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


__all__ = ["inference_linear", "fuse_linears", "planned_linears", "held_bytes",
           "onednn_available", "source_of"]
