"""A serving linear's source (kernels.WeightSource) frees what it holds as soon as it is dropped.

Loading builds and drops one source per linear per pass (the precision probe's float32 reference, each
candidate, the served model). A source in a reference cycle keeps its float32 weight until Python's
cyclic collector happens to run: on a Llama-3.2-1B-shaped Q4_K_M file the probe's reference pass left
~0.5 GB of dequantized weights alive, under everything measured after it.
"""

from __future__ import annotations

import gc
import weakref

import torch

from lmserve.model.linear import kernels as K


def test_a_source_holding_its_weight_is_freed_without_a_collector_pass():
    gc.disable()
    try:
        weight = torch.randn(16, 32)
        gone = weakref.ref(weight)
        src = K.WeightSource(weight, None)
        assert src.shape == (16, 32) and torch.equal(src.floats(torch.float32), weight)
        del weight, src
        assert gone() is None  # freed by its reference count alone
    finally:
        gc.enable()
