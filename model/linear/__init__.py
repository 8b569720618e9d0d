"""Linear layers for serving: weight formats (GGUF blocks, int8/int4 packing), the serving linear
modules and the measured choice of kernel per role, the native quantized matmul and the fused
elementwise ops."""
