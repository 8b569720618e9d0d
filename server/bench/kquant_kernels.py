"""The native K-quant kernel (Q4_K, Q5_K, Q6_K blocks as GGUF stores them) beside the native int4
(Q4_0-style) and int8 (Q8_0) kernels, at Llama-3.2-1B's linear shapes, against the memory's read
bandwidth.

    lmserve bench kquant-kernels [--rounds 5] [--threads 1 --clock cpu] [--shapes qkv,down]

Shapes (out x in): qkv 3072 x 2048, o 2048 x 2048, gate_up 16384 x 2048, down 2048 x 8192 and the
LM head 128256 x 2048, each at 1, 8, 32 and 512 rows. Random weights (speed does not depend on their
values): K-quant blocks of random codes and scales under float16 steps like a trained model's, and the
int4 / int8 kernels' blocks likewise. Each candidate holds as many copies of a layer's weight as make
twice the last-level cache, and a timing walks through them, so that every call reads its weight from
memory as a step through a model's layers does (the head alone is larger than the cache).

Candidates: the kernels as the modes serve them, with one activation code (`-a8`, int8 per block of 32)
and with two (~16 bits), all through the library's entry point with the outputs allocated once. They
take turns within every round, in one process; each timing is the median over rounds (min beside it).
The read bandwidth (a sum over 512 MiB, on the same threads and clock) is measured every round, and
each candidate's M=1 rate is set against its own round's reading.

`--clock cpu` (with `--threads 1`) times by the thread's CPU time instead of the wall clock: on a
machine shared with other work a pass may wait for a core, which wall time counts and CPU time does
not (with more threads, CPU time would count OpenMP's spinning at barriers).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ...model.linear import quant_matmul as QM
from ...model.linear.formats import GROUP, KQUANT_BLOCK_BYTES, KQuantBlocks, Q41Blocks, Q80Blocks
from ...model.linear.quant_matmul import KQUANT_BITS, pack_kquant
from .machine import last_level_cache_bytes, taking_turns

FLAGS = {"rounds": 5, "threads": None}

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "head": (128256, 2048)}  # Llama-3.2-1B: hidden 2048, 32 heads of 64, 8 KV heads, intermediate 8192
ROWS = (1, 8, 32, 512)
FORMATS = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "int4": 4, "int8": 8}
CANDIDATES = {  # name -> (format, two activation codes)
    "Q4_K-a8": ("Q4_K", False), "Q4_K": ("Q4_K", True), "Q5_K-a8": ("Q5_K", False), "Q6_K-a8": ("Q6_K", False),
    "Q6_K": ("Q6_K", True), "int4-a8": ("int4", False), "int4": ("int4", True), "int8-a8": ("int8", False),
    "int8": ("int8", True),
}


def random_weight(fmt: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """A packed weight [n, k] of random codes in `fmt`, float16 steps ~1e-3."""
    if fmt in ("int4", "int8"):
        d = torch.from_numpy(rng.uniform(2e-4, 2e-3, (n, k // GROUP)).astype(np.float16)).float()
        if fmt == "int4":
            q = torch.from_numpy(rng.integers(0, 16, (n, k), dtype=np.uint8))
            return QM.pack_q4(Q41Blocks(q, d, -8 * d))
        return QM.pack_q8(Q80Blocks(torch.from_numpy(rng.integers(-127, 128, (n, k), dtype=np.int8)), d))
    qtype = FORMATS[fmt]
    raw = rng.integers(0, 256, (n, k // 256, KQUANT_BLOCK_BYTES[qtype]), dtype=np.uint8)
    step = rng.uniform(2e-4, 2e-3, (n, k // 256)).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    if qtype == 14:
        raw[..., 208:210] = step
    else:
        raw[..., 0:2] = step
        raw[..., 2:4] = (rng.uniform(0, 1e-3, (n, k // 256)).astype(np.float16)).view(np.uint8).reshape(n, -1, 2)
    return pack_kquant([KQuantBlocks.from_raw(raw.reshape(n, -1), qtype)])


def read_gb_s(clock, mib: int = 512, repeats: int = 5) -> float:
    """GB/s of a sum over a `mib` MiB float32 buffer on torch's threads, by `clock` (median)."""
    buf = torch.ones(mib << 18)
    buf.sum()
    times = []
    for _ in range(repeats):
        t0 = clock()
        buf.sum()
        times.append(clock() - t0)
    return round(buf.numel() * 4 / statistics.median(times) / 1e9, 2)


def add_arguments(p) -> None:
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ", ".join(SHAPES))
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the thread's CPU time (--threads 1)")


def run(args) -> dict:
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu times one thread: pass --threads 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    qm = QM.default_kernel()
    if qm is None:
        raise SystemExit("the native quantized kernel is not built here (no compiler or no AVX2)")
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    bw = read_gb_s(clock)
    print("read bandwidth", bw, "GB/s", flush=True)
    rng = np.random.default_rng(0)
    llc = last_level_cache_bytes()
    weights: dict[str, dict[str, list[torch.Tensor]]] = {f: {} for f in FORMATS}  # format -> shape -> copies
    for fmt in {f for f, _ in CANDIDATES.values()}:
        for s, (n, k) in shapes.items():
            first = random_weight(fmt, n, k, rng)
            copies = max(1, -(-2 * llc // first.numel()))  # twice the cache: each call reads from memory
            weights[fmt][s] = [first] + [random_weight(fmt, n, k, rng) for _ in range(copies - 1)]
        print("packed", fmt, flush=True)
    xs = {k: torch.randn(max(ROWS), k).bfloat16() for k in {k for _, k in shapes.values()}}
    outs = {(s, m): torch.empty(m, n, dtype=torch.bfloat16) for s, (n, _) in shapes.items() for m in ROWS}
    threads = torch.get_num_threads()
    fn = qm._fn

    def per_call(fmt: str, precise: bool, s: str, rows: int) -> float:
        """Seconds per call, walking through the shape's copies (weights from memory)."""
        n, k = shapes[s]
        bits = KQUANT_BITS if fmt.endswith("_K") else FORMATS[fmt]
        x, y = xs[k][:rows], outs[(s, rows)]
        ws = weights[fmt][s]
        t0 = clock()
        for w in ws:
            if fn(bits, int(precise), x.data_ptr(), 1, rows, k, w.data_ptr(), n, y.data_ptr(), 1, threads):
                raise RuntimeError(f"{fmt} does not take {s}")
        return (clock() - t0) / len(ws)

    samples = {c: {s: {m: [] for m in ROWS} for s in shapes} for c in CANDIDATES}
    bw_rounds = []
    for c, (fmt, precise) in CANDIDATES.items():  # warm-up: first calls, page faults of buffers
        for s in shapes:
            per_call(fmt, precise, s, 1)
    for rnd in range(args.rounds):
        bw_rounds.append(read_gb_s(clock, repeats=3))
        for c, (fmt, precise) in taking_turns(CANDIDATES.items(), rnd):
            for s in shapes:
                for m in ROWS:
                    samples[c][s][m].append(per_call(fmt, precise, s, m))
        print(f"round {rnd + 1}/{args.rounds} (read {bw_rounds[-1]} GB/s)", flush=True)

    report = {"threads": threads, "clock": args.clock, "native_path": qm.name, "read_bandwidth_gb_s": bw,
              "read_bandwidth_rounds_gb_s": bw_rounds,
              "shapes": {s: {"out": n, "in": k} for s, (n, k) in shapes.items()},
              "note": "ms per call, median over rounds (min beside), weights from memory; gb_s: packed weight bytes "
                      "over the median time; m1_fraction_of_read_same_round: M=1 rate over that round's read "
                      "bandwidth, median over rounds", "candidates": {}}
    for c, (fmt, precise) in CANDIDATES.items():
        per = {}
        for s in shapes:
            nbytes = weights[fmt][s][0].numel()
            row = {"weight_mb": round(nbytes / 1e6, 2)}
            for m in ROWS:
                v = samples[c][s][m]
                row[f"m{m}_ms"] = round(statistics.median(v) * 1e3, 3)
                row[f"m{m}_ms_min"] = round(min(v) * 1e3, 3)
            row["m1_gb_s"] = round(nbytes / statistics.median(samples[c][s][1]) / 1e9, 2)
            row["m1_fraction_of_read_same_round"] = round(statistics.median(
                nbytes / t / (b * 1e9) for t, b in zip(samples[c][s][1], bw_rounds)), 3)
            per[s] = row
        total = {f"m{m}_ms": round(sum(per[s][f"m{m}_ms"] for s in shapes), 3) for m in ROWS}
        report["candidates"][c] = {"format": fmt, "activation_codes": 2 if precise else 1, "shapes": per,
                                   "sum_of_shapes": total}
    print("ms per call at M = " + "/".join(map(str, ROWS)) + ", and the M=1 rate")
    for c, r in report["candidates"].items():
        cells = []
        for s in shapes:
            row = r["shapes"][s]
            cells.append(f"{s} " + "/".join(f"{row[f'm{m}_ms']:.2f}" for m in ROWS) + f" {row['m1_gb_s']:.1f} GB/s")
        print(f"{c:8s} " + "  ".join(cells))
    return report
