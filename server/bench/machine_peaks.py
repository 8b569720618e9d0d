"""Two ceilings of this machine for the weight-only linears, and the bounds they set on a step.

    lmserve bench machine-peaks

- **Products**: int8 dot products a second from the instruction the native quantized kernel uses
  (AVX-512 VNNI vpdpbusd, AVX-VNNI, or AVX2 maddubs + madd), on independent registers, 1 thread and
  all of torch's threads. At 8 rows the kernel does 8x the products of 1 row on the same bytes, so
  this is what keeps M=8 from costing what M=1 costs.
- **Products in the K-quant kernel's loop shape** (1 thread): 12 rows' chains of 8 dot products a block
  of 32, with nothing else, with the kernel's float steps per block (activations stepped per 32), or
  with an integer scale per block (what activations sharing one step over 256 would leave). How much
  of the ceiling each numeric design can reach on this core, before unpacking and loads.
- **Reading a step's weights**: GB/s reading buffers of the real linears' packed sizes the way the
  native decode loop reads them (one OpenMP region per linear, groups split statically, 4 KiB
  prefetch), and streaming them in one region with no barrier between linears. The first is what
  a batch-1 step can reach with one kernel call per linear; the sum over one big buffer
  (quant_kernels.read_bandwidth) is higher still.

bounds(...) turns them into the least time a step's linears can take at M rows: the larger of the
bytes over the read rate and the products over the product rate.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS: dict = {}


class Peaks:
    """The benchmark library (built like the serving kernels, cached beside them)."""

    def __init__(self, cache_dir: Path | None = None):
        from ...model.native import build as native
        from ...model.cache_dir import default_cache_dir

        lib, why = native.build(Path(cache_dir or default_cache_dir()), sources=[SOURCE])
        if lib is None:
            raise RuntimeError(why)
        self.per_instruction = lib.lm_peak_products_per_instruction()
        self._products = lib.lm_peak_products
        self._products.argtypes = [ctypes.c_int64, ctypes.c_int]
        self._products.restype = ctypes.c_int64
        self._block_mix = lib.lm_peak_block_mix
        self._block_mix.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        self._block_mix.restype = ctypes.c_int64
        self._read = lib.lm_peak_read
        p, i32 = ctypes.c_void_p, ctypes.c_int
        self._read.argtypes = [p, p, p, i32, i32, i32]
        self._read.restype = ctypes.c_int64

    def products_per_second(self, threads: int, iters: int = 30_000_000, repeats: int = 5) -> float:
        """Int8 products a second on `threads` threads (the fastest of `repeats` runs)."""
        if not self.per_instruction:
            return 0.0
        self._products(iters // 10, threads)
        best = min(_timed(lambda: self._products(iters, threads)) for _ in range(repeats))
        return iters * threads * self.per_instruction / best

    def block_mix(self, iters: int, threads: int, mix: int) -> int:
        """lm_peak_block_mix: `iters` blocks of 32 on 12 rows a thread in `mix` (BLOCK_MIXES); its checksum."""
        return self._block_mix(iters, threads, mix)

    def block_mix_per_second(self, mix: int, threads: int = 1, iters: int = 2_000_000, repeats: int = 5) -> float:
        """Int8 products a second of the dot-product instructions in `mix` (the fastest of `repeats` runs)."""
        if not self.per_instruction:
            return 0.0
        self.block_mix(iters // 10, threads, mix)
        best = min(_timed(lambda: self.block_mix(iters, threads, mix)) for _ in range(repeats))
        return iters * 12 * 8 * threads * self.per_instruction / best

    def read(self, buffers: list[torch.Tensor], group_bytes: list[int], threads: int, one_region: bool):
        """A function reading `buffers` (uint8, each whole groups of group_bytes) in order, which returns
        the sum of their bytes taken as int64 words (wrapping): every byte is read once."""
        n = len(buffers)
        ptrs = (ctypes.c_void_p * n)(*[b.data_ptr() for b in buffers])
        groups = (ctypes.c_int64 * n)(*[b.numel() // g for b, g in zip(buffers, group_bytes)])
        gbytes = (ctypes.c_int64 * n)(*group_bytes)
        return lambda: self._read(ptrs, groups, gbytes, n, threads, int(one_region))

    def read_gb_s(self, buffers: list[torch.Tensor], group_bytes: list[int], threads: int, one_region: bool,
                  repeats: int = 9) -> float:
        """GB/s of read(...), median of `repeats`, each after reading a buffer of twice a 105 MiB
        last-level cache so that the weights come from memory."""
        run = self.read(buffers, group_bytes, threads, one_region)
        flush = torch.ones(2 * 105 << 18)
        times = []
        for _ in range(repeats):
            flush.sum()
            times.append(_timed(run))
        return sum(b.numel() for b in buffers) / statistics.median(times) / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# lm_peak_block_mix's mixes: per block of 32 weights and row, the 8 dot products and then
BLOCK_MIXES = {"dots_only": 0,  # nothing else
               "float_steps_per_block": 1,  # the K-quant kernel's float steps (activations stepped per 32)
               "integer_scale_per_block": 2}  # an integer scale (activations sharing a step over 256)


def measure(buffers: list[torch.Tensor], group_bytes: list[int], cache_dir: Path | None = None) -> dict:
    """Both ceilings on this machine, the read ones over `buffers` (a step's packed weights)."""
    peaks = Peaks(cache_dir)
    threads = torch.get_num_threads()
    one = peaks.products_per_second(1)
    every = peaks.products_per_second(threads)
    return {"threads": threads, "products_per_instruction": peaks.per_instruction,
            "products_g_per_s": {"1_thread": round(one / 1e9, 1), f"{threads}_threads": round(every / 1e9, 1)},
            "products_scaling": round(every / one, 2) if one else None,
            # the kernel's loop shape on 1 thread: how much of the products' ceiling each design leaves
            "block_mix_products_g_per_s_1_thread": {name: round(peaks.block_mix_per_second(mix) / 1e9, 1)
                                                     for name, mix in BLOCK_MIXES.items()},
            "read_mb": round(sum(b.numel() for b in buffers) / 1e6, 1),
            "read_gb_s": {"region_per_linear": round(peaks.read_gb_s(buffers, group_bytes, threads, False), 1),
                          "one_region": round(peaks.read_gb_s(buffers, group_bytes, threads, True), 1)}}


def bounds(read_gb_s: float, products_per_s: float, weight_bytes: int, products_per_row: int,
           rows: tuple[int, ...] = (1, 8)) -> dict:
    """The least time a step's linears take at each row count: the bytes at the decode loop's read
    rate, or the products at the product rate, whichever is larger; and M / 1 ratios of those."""
    out = {"read_ms": round(weight_bytes / (read_gb_s * 1e9) * 1e3, 3)}
    for m in rows:
        out[f"products_ms_m{m}"] = round(m * products_per_row / products_per_s * 1e3, 3) if products_per_s else None
        out[f"bound_ms_m{m}"] = round(max(out["read_ms"], out[f"products_ms_m{m}"] or 0.0), 3)
    for m in rows[1:]:
        out[f"m{m}_over_m1_bound"] = round(out[f"bound_ms_m{m}"] / out[f"bound_ms_m{rows[0]}"], 3)
    return out


def peak_bounds(peaks: dict, weight_bytes: int, products_per_row: int) -> dict:
    """bounds(...) at the rates measure() reported: the loop's read rate, all threads' products."""
    rate = peaks["products_g_per_s"][f"{peaks['threads']}_threads"] * 1e9
    return bounds(peaks["read_gb_s"]["region_per_linear"], rate, weight_bytes, products_per_row)


def step_buffers(shapes: list[tuple[int, int, int]]) -> tuple[list[torch.Tensor], list[int]]:
    """Buffers of the packed sizes of linears (out_features, in_features, bits), in step order."""
    from ...model.linear.quant_matmul import GROUP_COLS

    bufs, gbytes = [], []
    for n, k, bits in shapes:
        g = k // 32 * (320 if bits == 4 else 544)
        bufs.append(torch.randint(0, 255, (n // GROUP_COLS * g,), dtype=torch.uint8))
        gbytes.append(g)
    return bufs, gbytes


def decoder_step(hidden: int, q: int, kv: int, ffn: int, layers: int, vocab: int,
                 bits: int = 4) -> list[tuple[int, int, int]]:
    """A Llama-family decoder's linears in a decode step's order (q and kv: the widths of the query and
    of each of key and value): `layers` times fused qkv, o, fused gate_up, down at `bits`, then the LM
    head in int8 (as the native modes serve it)."""
    return [(q + 2 * kv, hidden, bits), (hidden, q, bits), (2 * ffn, hidden, bits), (hidden, ffn, bits)] * layers \
        + [(vocab, hidden, 8)]


def smollm2_step(bits: int = 4) -> list[tuple[int, int, int]]:
    """SmolLM2-135M's decode step (hidden 576, 9 query and 3 key/value heads of 64, 30 layers)."""
    return decoder_step(576, 576, 192, 1536, 30, 49152, bits)


def run(args) -> dict:
    shapes = smollm2_step(4)
    bufs, gbytes = step_buffers(shapes)
    peaks = measure(bufs, gbytes)
    products = sum(n * k for n, k, _ in shapes)  # one activation code: one product per weight and row
    report = {"peaks": peaks, "int4_a8_step_bounds": peak_bounds(peaks, sum(b.numel() for b in bufs), products)}
    print(peaks, report["int4_a8_step_bounds"], sep="\n")
    return report
