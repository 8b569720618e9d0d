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
and with two (~16 bits), all through the library's entry point with the outputs allocated once. Where
the OS grants AMX tiles (calls of 12 rows or more take them), each candidate again as `<name>-vnni`
with the tiles off: the tile paths beside the VNNI ones they replace. They take turns within every
round, in one process; each timing is the median over rounds (min beside it).
The read bandwidth (a sum over 512 MiB, on the same threads and clock) is measured every round, and
each candidate's M=1 rate is set against its own round's reading.

First, the page placement of the weights a decode step streams (page_placement): a 1B step's layer
linears at one row, Q4_K-a8, in the huge-page mappings serving uses beside copies in 4 KiB pages, in
pairs taking turns.

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


def packed_weights(shapes: dict, rng: np.random.Generator) -> dict[str, dict[str, list[torch.Tensor]]]:
    """Per format the candidates use and per shape, as many random weights as make twice the last-level
    cache (at least one), so that a walk through them reads each from memory."""
    llc = last_level_cache_bytes()
    weights: dict[str, dict[str, list[torch.Tensor]]] = {f: {} for f in FORMATS}  # format -> shape -> copies
    for fmt in {f for f, _ in CANDIDATES.values()}:
        for s, (n, k) in shapes.items():
            first = random_weight(fmt, n, k, rng)
            copies = max(1, -(-2 * llc // first.numel()))  # twice the cache: each call reads from memory
            weights[fmt][s] = [first] + [random_weight(fmt, n, k, rng) for _ in range(copies - 1)]
        print("packed", fmt, flush=True)
    return weights


def candidates_for(qm) -> dict[str, tuple[str, bool, int]]:
    """name -> (format, two activation codes, AMX setting): CANDIDATES as served, and where the tiles are
    granted each again with them off (`-vnni`)."""
    out = {name: (fmt, precise, QM.AMX_BY_RULE) for name, (fmt, precise) in CANDIDATES.items()}
    if qm.amx:
        out.update({f"{name}-vnni": (fmt, precise, QM.AMX_NEVER) for name, (fmt, precise) in CANDIDATES.items()})
    return out


def page_placement(qm, pairs: int = 16, layers: int = 16) -> dict:
    """A Llama-3.2-1B step's layer linears at one row (Q4_K-a8: qkv, o, gate_up in Q4_K, down in Q6_K,
    `layers` times, ~620 MB), their packed weights in the mappings advised for huge pages that serving
    uses (weight_memory.py) beside copies in torch's own memory (4 KiB pages where the OS gives huge
    pages only on request): the two walks taking turns `pairs` times, best of 3 each, with the read
    bandwidth after each pair. One pair takes ~0.1 s, so a drift of the VM's memory meets both alike."""
    rng = np.random.default_rng(1)
    step = [(fmt, *SHAPES[s]) for fmt, s in (("Q4_K", "qkv"), ("Q4_K", "o"), ("Q4_K", "gate_up"), ("Q6_K", "down"))]
    huge = [(random_weight(f, n, k, rng), n, k) for f, n, k in step * layers]
    small = [(w.clone(), n, k) for w, n, k in huge]
    nbytes = sum(w.numel() for w, _, _ in huge)
    xs = {k: torch.randn(1, k).bfloat16() for _, _, k in step}
    ys = {n: torch.empty(1, n, dtype=torch.bfloat16) for _, n, _ in step}
    threads = torch.get_num_threads()

    def walk(weights) -> float:
        t0 = time.perf_counter()
        for w, n, k in weights:
            qm._fn(KQUANT_BITS, 0, xs[k].data_ptr(), 1, 1, k, w.data_ptr(), n, ys[n].data_ptr(), 1, threads)
        return time.perf_counter() - t0

    rows = []
    for i in range(pairs):
        gb_s = {}
        for name, weights in taking_turns((("huge_pages", huge), ("4k_pages", small)), i):
            gb_s[name] = round(nbytes / min(walk(weights) for _ in range(3)) / 1e9, 2)
        rows.append({**gb_s, "read_gb_s": read_gb_s(time.perf_counter, mib=256, repeats=1)})
    ratios = [r["huge_pages"] / r["4k_pages"] for r in rows]
    out = {"weight_mb": round(nbytes / 1e6, 1), "pairs": rows,
           "huge_over_4k_median": round(statistics.median(ratios), 3),
           "huge_faster_in_pairs": sum(x > 1 for x in ratios)}
    print("page placement: huge / 4k pages", out["huge_over_4k_median"], f"({out['huge_faster_in_pairs']}/{pairs} pairs)",
          flush=True)
    return out


class _Calls:
    """The kernels called through the library's entry point on every shape's copies, with the inputs and
    outputs allocated once."""

    def __init__(self, qm, shapes: dict, weights: dict, clock):
        self.shapes, self.weights, self.clock = shapes, weights, clock
        self.xs = {k: torch.randn(max(ROWS), k).bfloat16() for k in {k for _, k in shapes.values()}}
        self.outs = {(s, m): torch.empty(m, n, dtype=torch.bfloat16) for s, (n, _) in shapes.items() for m in ROWS}
        self.threads = torch.get_num_threads()
        self.fn = qm._fn

    def per_call(self, fmt: str, precise: bool, s: str, rows: int) -> float:
        """Seconds per call, walking through the shape's copies (weights from memory)."""
        n, k = self.shapes[s]
        bits = KQUANT_BITS if fmt.endswith("_K") else FORMATS[fmt]
        x, y = self.xs[k][:rows], self.outs[(s, rows)]
        ws = self.weights[fmt][s]
        t0 = self.clock()
        for w in ws:
            if self.fn(bits, int(precise), x.data_ptr(), 1, rows, k, w.data_ptr(), n, y.data_ptr(), 1, self.threads):
                raise RuntimeError(f"{fmt} does not take {s}")
        return (self.clock() - t0) / len(ws)


def _sample(calls: _Calls, qm, candidates: dict, rounds: int) -> tuple[dict, list[float]]:
    """After a warm-up call of each candidate on each shape, `rounds` rounds in which the candidates take
    turns, the read bandwidth measured first in each: seconds per call by candidate, shape and rows, and
    each round's read bandwidth."""
    samples = {c: {s: {m: [] for m in ROWS} for s in calls.shapes} for c in candidates}
    bw_rounds = []
    for c, (fmt, precise, _) in candidates.items():  # warm-up: first calls, page faults of buffers
        for s in calls.shapes:
            calls.per_call(fmt, precise, s, 1)
    for rnd in range(rounds):
        bw_rounds.append(read_gb_s(calls.clock, repeats=3))
        for c, (fmt, precise, amx) in taking_turns(candidates.items(), rnd):
            qm.set_amx(amx)
            for s in calls.shapes:
                for m in ROWS:
                    samples[c][s][m].append(calls.per_call(fmt, precise, s, m))
        print(f"round {rnd + 1}/{rounds} (read {bw_rounds[-1]} GB/s)", flush=True)
    return samples, bw_rounds


def _shape_row(nbytes: int, samples: dict[int, list[float]], bw_rounds: list[float]) -> dict:
    """One candidate on one shape: ms per call at each row count (median, min), the M=1 rate and its share
    of each round's read bandwidth (median)."""
    row = {"weight_mb": round(nbytes / 1e6, 2)}
    for m in ROWS:
        v = samples[m]
        row[f"m{m}_ms"] = round(statistics.median(v) * 1e3, 3)
        row[f"m{m}_ms_min"] = round(min(v) * 1e3, 3)
    row["m1_gb_s"] = round(nbytes / statistics.median(samples[1]) / 1e9, 2)
    row["m1_fraction_of_read_same_round"] = round(statistics.median(
        nbytes / t / (b * 1e9) for t, b in zip(samples[1], bw_rounds)), 3)
    return row


def _print_table(candidates: dict, shapes: dict) -> None:
    print("ms per call at M = " + "/".join(map(str, ROWS)) + ", and the M=1 rate")
    for c, r in candidates.items():
        cells = []
        for s in shapes:
            row = r["shapes"][s]
            cells.append(f"{s} " + "/".join(f"{row[f'm{m}_ms']:.2f}" for m in ROWS) + f" {row['m1_gb_s']:.1f} GB/s")
        print(f"{c:8s} " + "  ".join(cells))


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
    placement = page_placement(qm)
    weights = packed_weights(shapes, np.random.default_rng(0))
    calls = _Calls(qm, shapes, weights, clock)
    candidates = candidates_for(qm)
    try:
        samples, bw_rounds = _sample(calls, qm, candidates, args.rounds)
    finally:
        qm.set_amx(QM.AMX_BY_RULE)

    report = {"threads": calls.threads, "clock": args.clock, "native_path": qm.name, "read_bandwidth_gb_s": bw,
              "read_bandwidth_rounds_gb_s": bw_rounds, "page_placement": placement,
              "shapes": {s: {"out": n, "in": k} for s, (n, k) in shapes.items()},
              "note": "ms per call, median over rounds (min beside), weights from memory; gb_s: packed weight bytes "
                      "over the median time; m1_fraction_of_read_same_round: M=1 rate over that round's read "
                      "bandwidth, median over rounds", "candidates": {}}
    for c, (fmt, precise, amx) in candidates.items():
        per = {s: _shape_row(weights[fmt][s][0].numel(), samples[c][s], bw_rounds) for s in shapes}
        total = {f"m{m}_ms": round(sum(per[s][f"m{m}_ms"] for s in shapes), 3) for m in ROWS}
        report["candidates"][c] = {"format": fmt, "activation_codes": 2 if precise else 1,
                                   "amx_tiles": "off" if amx == QM.AMX_NEVER else ("12 rows or more" if qm.amx else "none here"),
                                   "shapes": per, "sum_of_shapes": total}
    _print_table(report["candidates"], shapes)
    return report
