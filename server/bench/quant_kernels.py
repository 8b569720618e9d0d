"""Microbenchmark of the weight-only linear kernels on a GGUF's real weights, against the memory's
read bandwidth: every linear of a decode step (all layers and the LM head) at 1, 8 and 32 rows.

    lmserve bench quant-kernels [--model smollm2] [--rounds 7]

Candidates (each a whole step's linears): torch's int4 (+ int8 head) and int8 kernels, bfloat16
on oneDNN, and the native kernel (quant_matmul.py) in int4 (+ Q8_0 head) and int8, where the
CPU grants AMX tiles once with them (the default) and once without (`-vnni`: the same modules with
the tiles turned off; the same bits either way). They take turns
within every round, in one process; each timing is the median of the rounds (min beside it), so a
neighbour's burst on a shared machine lands on every candidate alike.

The native candidates are also timed as kernel calls alone ("calls"): each layer's packed weight
through the library's entry point with outputs allocated once, no module, torch op or allocation
per call (~1 us of ctypes a call, 121 a step). That is what the native decode loop pays, and it keeps
Python's per-call cost (~2 ms a step) out of M=1, which would flatter the M=8 / M=1 ratio.

The memory's read bandwidth (a sum over 512 MiB) is taken once at the start and again every round,
beside the kernels: on a shared VM it moved by 2x within minutes, so the kernel calls' M=1 time is
also set against its own round's bandwidth ("same round"), and against the rate at which the
decode loop's pattern reads the same weights (machine_peaks.py: one parallel region per linear).

Two readings of the memory: "cold" passes first read a buffer of 2x the last-level cache (the
weights come from memory, the bound quoted against bandwidth), "warm" passes run back to back as
a serving loop does (weights that fit the cache may partly come from it). Beside each wall time,
the process's CPU time of the pass (all threads): on a machine shared with other work a pass
may wait for a core, which wall time counts and CPU time does not.
"""

from __future__ import annotations

import statistics
import time

import torch

from ...model.linear import kernels as K
from ...model.linear import quant_matmul as QM
from ...model.checkpoints.gguf_reader import read_gguf
from .machine import last_level_cache_bytes, taking_turns

FLAGS = {"model": "smollm2", "models_dir": None, "rounds": 7}

ROWS = (1, 8, 32)
CANDIDATES = {  # name -> (layers' kernel, head's kernel, dtype)
    "torch-int4": ("int4", "int8", torch.bfloat16),
    "torch-int8": ("int8", "int8", torch.bfloat16),
    "onednn-bf16": ("onednn", "onednn", torch.bfloat16),
    "native-int4": ("native-int4", "native-int8-a8", torch.bfloat16),
    "native-int8": ("native-int8", "native-int8-a8", torch.bfloat16),
    "native-int4-a8": ("native-int4-a8", "native-int8-a8", torch.bfloat16),  # one activation code, centred int4
    "native-int8-a8": ("native-int8-a8", "native-int8-a8", torch.bfloat16),  # one activation code
}


def read_bandwidth(mib: int = 512, repeats: int = 9) -> dict:
    """GB/s of a sum over a `mib` MiB float32 buffer on torch's threads (median and best)."""
    buf = torch.ones(mib << 18)  # mib MiB of float32
    buf.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    nbytes = buf.numel() * 4
    return {"buffer_mib": mib, "threads": torch.get_num_threads(), "median_gb_s": round(nbytes / statistics.median(times) / 1e9, 2),
            "best_gb_s": round(nbytes / min(times) / 1e9, 2)}


def role_sources(ck) -> dict[str, list[K.WeightSource]]:
    """Every layer's fused projections and the LM head, from the checkpoint's tensors and blocks."""
    def src(*names):
        return K.WeightSource.cat([K.WeightSource(ck.tensors[n], None, ck.q41.get(n), ck.q80.get(n)) for n in names])
    cfg = ck.config
    out = {r: [] for r in K.ROLES}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out["qkv"].append(src(*(p + f"self_attn.{x}_proj.weight" for x in "qkv")))
        out["o"].append(src(p + "self_attn.o_proj.weight"))
        out["gate_up"].append(src(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"))
        out["down"].append(src(p + "mlp.down_proj.weight"))
    head = "lm_head.weight" if "lm_head.weight" in ck.tensors else "model.embed_tokens.weight"
    out["head"].append(src(head))
    return out


def run(args) -> dict:
    from ...model.checkpoints.catalog import resolve_model

    gguf = resolve_model(args.model, models_dir=args.models_dir)
    torch.manual_seed(0)
    bw = read_bandwidth()
    print("read bandwidth", bw, flush=True)
    qm = QM.default_kernel()
    sets, amx_modes = build_candidates(gguf, qm)
    rounds = Rounds(sets, amx_modes, qm)
    with torch.inference_mode():
        rounds.warm_up()
        for rnd in range(args.rounds):
            rounds.measure(rnd)
            print(f"round {rnd + 1}/{args.rounds}", flush=True)
    if qm is not None:
        qm.set_amx(QM.AMX_BY_RULE)
    report = summarize(rounds, bw, gguf.name, args.rounds)
    print_summary(report)
    return report


def build_candidates(gguf, qm) -> tuple[dict, dict]:
    """Each candidate's modules per role ({name: {role: [module per layer]}}) and the AMX mode its passes
    run with; on a CPU whose native kernel uses AMX tiles, each native candidate again as `-vnni` (the
    same modules, the tiles turned off)."""
    ck = read_gguf(gguf, keep_q41=True)
    sources = role_sources(ck)
    sets = {}
    for name, (layer_kernel, head_kernel, dtype) in CANDIDATES.items():
        if name.startswith("native") and qm is None:
            continue
        sets[name] = {r: [K.build(head_kernel if r == "head" else layer_kernel, s, dtype) for s in srcs]
                      for r, srcs in sources.items()}
    del ck, sources
    amx_modes = {name: QM.AMX_BY_RULE for name in sets}
    if qm is not None and qm.amx:
        for name in ("native-int4", "native-int8", "native-int4-a8", "native-int8-a8"):
            sets[f"{name}-vnni"], amx_modes[f"{name}-vnni"] = sets[name], QM.AMX_NEVER
    return sets, amx_modes


class Rounds:
    """The timings of every candidate over the rounds, in which they take turns: whole-step passes
    cold and warm (wall and CPU time), the native candidates' kernel calls alone, and beside them each
    round's read bandwidth and, where machine_peaks runs, its product rate and the decode loop's read
    rate."""

    def __init__(self, sets: dict, amx_modes: dict, qm):
        self.sets, self.amx_modes, self.qm = sets, amx_modes, qm
        self.nbytes = {n: sum(m.nbytes for ls in s.values() for m in ls) for n, s in sets.items()}
        in_features = {m.in_features for s in sets.values() for ls in s.values() for m in ls}
        self.xs = {k: torch.randn(max(ROWS), k).bfloat16() for k in in_features}
        self.flush = torch.ones(2 * last_level_cache_bytes() // 4)
        self.samples = {n: {mode: {r: {role: [] for role in K.ROLES} for r in ROWS} for mode in ("cold", "warm")}
                        for n in sets}
        self.cpu = {n: {mode: {r: [] for r in ROWS} for mode in ("cold", "warm")} for n in sets}
        self.calls = {n: {r: [] for r in ROWS} for n in sets if n.startswith("native")}  # cold, kernel calls alone
        self.outs: dict = {}  # (module, rows) -> its output, allocated once for the "calls" passes
        # the machine's bandwidth moves by up to 2x within minutes on a shared VM: read again every round,
        # beside the kernels, so that each round's M=1 time is set against that round's bandwidth
        self.bw_rounds: list[float] = []
        self.peaks = None  # machine_peaks: products a second and the decode loop's read rate, over native-int4-a8's
        self.step_read: list[float] = []
        self.products_rounds: list[float] = []
        if "native-int4-a8" in sets:
            from . import machine_peaks as MP

            layers = [m for role in K.ROLES for m in sets["native-int4-a8"][role]]
            self.read_bufs = [m.packed for m in layers]
            self.read_groups = [m.packed.numel() // (m.out_features // QM.GROUP_COLS) for m in layers]
            try:
                self.peaks = MP.Peaks()
            except RuntimeError as exc:
                print("machine peaks not measured:", exc, flush=True)

    def run_pass(self, layers, rows: int) -> float:
        t0 = time.perf_counter()
        for m in layers:
            m(self.xs[m.in_features][:rows])
        return time.perf_counter() - t0

    def run_calls(self, layers, rows: int) -> float:
        """The native modules' kernel calls alone (QuantMatmul's entry point, outputs reused)."""
        threads = torch.get_num_threads()
        args = []
        for m in layers:
            x = self.xs[m.in_features][:rows]
            y = self.outs.setdefault((m, rows), torch.empty(rows, m.out_features, dtype=x.dtype))
            args.append((m.bits, int(m.precise), x.data_ptr(), rows, m.in_features, m.packed.data_ptr(),
                         m.out_features, y.data_ptr()))
        fn = self.qm._fn
        t0 = time.perf_counter()
        for bits, precise, xp, r, k, wp, n, yp in args:
            fn(bits, precise, xp, 1, r, k, wp, n, yp, 1, threads)
        return time.perf_counter() - t0

    def warm_up(self) -> None:
        """First calls and the outputs' page faults, out of the timings."""
        for s in self.sets.values():
            for ls in s.values():
                for r in ROWS:
                    self.run_pass(ls, r)

    def measure(self, rnd: int) -> None:
        """One round: the machine's rates, then every candidate in this round's turn."""
        self.bw_rounds.append(read_bandwidth(repeats=3)["median_gb_s"])
        if self.peaks is not None:
            threads = torch.get_num_threads()
            self.step_read.append(self.peaks.read_gb_s(self.read_bufs, self.read_groups, threads, False, repeats=3))
            self.products_rounds.append(self.peaks.products_per_second(threads, repeats=3))
        for name, s in taking_turns(self.sets.items(), rnd):
            if self.qm is not None:
                self.qm.set_amx(self.amx_modes[name])
            for rows in ROWS:
                for mode in ("cold", "warm"):
                    if mode == "cold":
                        self.flush.sum()
                    else:
                        for ls in s.values():
                            self.run_pass(ls, rows)  # the pass before: as a serving loop runs
                    c0 = time.process_time()
                    for role in K.ROLES:
                        self.samples[name][mode][rows][role].append(self.run_pass(s[role], rows))
                    self.cpu[name][mode][rows].append(time.process_time() - c0)
                if name in self.calls:
                    self.flush.sum()
                    self.calls[name][rows].append(sum(self.run_calls(s[role], rows) for role in K.ROLES))


def _med(v) -> float:
    return round(statistics.median(v) * 1e3, 3)


def summarize(m: Rounds, bw: dict, gguf_name: str, rounds: int) -> dict:
    """The report: per candidate its step times (medians over the rounds), set against the bandwidth."""
    report = {"threads": torch.get_num_threads(), "native_path": m.qm.name if m.qm else None, "read_bandwidth": bw,
              "gguf": gguf_name, "timing": "medians over rounds in which the candidates take turns; "
              "per-role ms are summed over all layers", "candidates": {}}
    report["read_bandwidth_rounds_gb_s"] = m.bw_rounds
    if m.peaks is not None:
        report["machine_peaks"] = {
            "products_g_per_s_rounds": [round(r / 1e9, 1) for r in m.products_rounds],
            "step_read_gb_s_rounds": [round(r, 1) for r in m.step_read],
            "note": "step read: native-int4-a8's packed weights read as the decode loop reads them (a parallel "
                    "region per linear), each round beside the sum over 512 MiB (read_bandwidth_rounds_gb_s)"}
    for name in m.sets:
        c = {"weight_mb": round(m.nbytes[name] / 1e6, 1),
             "bound_ms_at_bandwidth": round(m.nbytes[name] / bw["median_gb_s"] / 1e6, 3)}
        for mode in ("cold", "warm"):
            c[mode] = _passes(m, name, mode, rounds, c["bound_ms_at_bandwidth"])
        if name in m.calls:
            c["calls"] = _calls(m, name, c["bound_ms_at_bandwidth"])
        report["candidates"][name] = c
    if "onednn-bf16" in report["candidates"]:
        ref = report["candidates"]["onednn-bf16"]
        for c in report["candidates"].values():
            for mode in ("cold", "warm"):
                c[mode]["m32_vs_onednn_bf16"] = round(ref[mode]["rows"][32]["step_ms"] / c[mode]["rows"][32]["step_ms"], 3)
            if "calls" in c:
                c["calls"]["m32_vs_onednn_bf16"] = round(ref["cold"]["rows"][32]["step_ms"] / c["calls"]["step_ms"][32], 3)
    return report


def _passes(m: Rounds, name: str, mode: str, rounds: int, bound_ms: float) -> dict:
    """A candidate's whole-step passes in one mode (cold or warm): step and per-role times per row count."""
    per = {}
    for rows in ROWS:
        roles = m.samples[name][mode][rows]
        steps = [sum(roles[role][i] for role in K.ROLES) for i in range(rounds)]
        per[rows] = {"step_ms": _med(steps), "step_ms_min": round(min(steps) * 1e3, 3),
                     "cpu_ms_all_threads": _med(m.cpu[name][mode][rows]),
                     "roles_ms": {role: _med(v) for role, v in roles.items()}}
    per1 = per[1]["step_ms"]
    return {"rows": per, "m1_fraction_of_bandwidth": round(bound_ms / per1, 3),
            "m8_over_m1": round(per[8]["step_ms"] / per1, 3), "m32_over_m1": round(per[32]["step_ms"] / per1, 3)}


def _calls(m: Rounds, name: str, bound_ms: float) -> dict:
    """A native candidate's kernel calls alone, against the bandwidth and (where measured) the machine's
    peaks of the same round."""
    nbytes, times = m.nbytes[name], m.calls[name]
    per = {rows: _med(times[rows]) for rows in ROWS}
    paired = [nbytes / (b * 1e9) / t for b, t in zip(m.bw_rounds, times[1])]
    out = {"step_ms": per, "m1_fraction_of_bandwidth": round(bound_ms / per[1], 3),
           "m1_fraction_of_bandwidth_same_round": round(statistics.median(paired), 3),
           "m8_over_m1": round(per[8] / per[1], 3), "m32_over_m1": round(per[32] / per[1], 3)}
    if m.step_read:
        from . import machine_peaks as MP

        out["m1_fraction_of_step_read_same_round"] = round(statistics.median(
            nbytes / (r * 1e9) / t for r, t in zip(m.step_read, times[1])), 3)
        # the least M=8 can take in each round (machine_peaks.bounds at that round's rates) over M=1's
        per_row = sum(q.in_features * q.out_features * (2 if q.precise else 1)
                      for ls in m.sets[name].values() for q in ls)
        out["m8_products_fraction_of_peak_same_round"] = round(statistics.median(
            8 * per_row / rate / t for rate, t in zip(m.products_rounds, times[8])), 3)
        out["m8_over_m1_bound_same_round"] = round(statistics.median(
            MP.bounds(r, rate, nbytes, per_row)["m8_over_m1_bound"]
            for rate, r in zip(m.products_rounds, m.step_read)), 3)
    return out


def print_summary(report: dict) -> None:
    for name, c in report["candidates"].items():
        print(f"{name:12s} {c['weight_mb']:7.1f} MB  cold ms " +
              " ".join(f"M{r}={c['cold']['rows'][r]['step_ms']:.2f}" for r in ROWS) +
              f"  bw {c['cold']['m1_fraction_of_bandwidth']:.2f}  m8/m1 {c['cold']['m8_over_m1']:.2f}  warm ms " +
              " ".join(f"M{r}={c['warm']['rows'][r]['step_ms']:.2f}" for r in ROWS) + "  cpu ms " +
              " ".join(f"M{r}={c['cold']['rows'][r]['cpu_ms_all_threads']:.2f}" for r in ROWS))
        if "calls" in c:
            print(f"{'':12s} kernel calls alone, cold ms " + " ".join(f"M{r}={v:.2f}" for r, v in c["calls"]["step_ms"].items())
                  + f"  bw {c['calls']['m1_fraction_of_bandwidth']:.2f}"
                  + f" (same round {c['calls']['m1_fraction_of_bandwidth_same_round']:.2f})"
                  + f"  m8/m1 {c['calls']['m8_over_m1']:.2f}")
