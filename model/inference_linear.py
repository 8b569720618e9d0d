"""Linear layers rebuilt for serving: fused projections and, on CPU float32, prepacked weights.

Training and the reference paths use plain `nn.Linear` with Hugging Face names. A loaded model
is converted once (`LlamaForCausalLM.prepare_for_inference`):

- projections that read the same input become one GEMM (q|k|v, gate|up): fewer, larger
  matmuls and fewer dispatches per layer;
- on CPU in float32 each weight is reordered once into oneDNN's blocked layout and multiplied
  with oneDNN. The default BLAS path runs the tall, thin LM head (vocab x hidden) at a fraction
  of the machine's GEMM rate; on a 2-core AVX2 EPYC the prepacked LM head is 2x faster at
  batch 1 and 2-4x faster at batch 8-64 (numbers in README "Benchmarks"). oneDNN computes
  each output row independently of how many rows are in the batch, which keeps greedy decoding
  batch-invariant.

Anything else (CUDA, bf16 on CPU, a torch without the oneDNN ops) keeps `nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def onednn_available(weight: Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PrepackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout (inference only: no autograd)."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # an opaque oneDNN tensor: kept as a plain attribute, not a buffer (it has no storage
        # that state_dict, .to() or parameter counting could use)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.bias = None if bias is None else bias.detach().clone()

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 4 + (0 if self.bias is None else self.bias.numel() * 4)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def inference_linear(weight: Tensor, bias: Tensor | None = None) -> nn.Module:
    """The fastest linear this device and dtype allow for a fixed weight [out, in]."""
    if onednn_available(weight):
        try:
            return PrepackedLinear(weight, bias)
        except RuntimeError:  # a oneDNN build that cannot take this shape: plain path below
            pass
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return layer


def fuse_linears(*layers: nn.Linear) -> nn.Module:
    """One layer computing the concatenation of the outputs of `layers` (same input)."""
    weight = torch.cat([m.weight for m in layers]) if len(layers) > 1 else layers[0].weight
    biases = [m.bias for m in layers]
    bias = None if biases[0] is None else torch.cat(biases)
    return inference_linear(weight, bias)


def held_bytes(module: nn.Module) -> int:
    """Bytes of the weights a module holds: parameters (shared ones once) plus prepacked weights."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in module.parameters()}  # tied = once
    total = sum(seen.values())
    return total + sum(m.nbytes for m in module.modules() if isinstance(m, PrepackedLinear))


__all__ = ["PrepackedLinear", "inference_linear", "fuse_linears", "held_bytes", "onednn_available"]
