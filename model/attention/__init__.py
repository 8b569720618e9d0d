"""Attention: per-step metadata over the KV cache (SDPA and its call plan), the backend chosen per
device, and the CPU decode and prompt attention kernels' wrappers."""
