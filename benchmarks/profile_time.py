"""Symbolic profile vs one XLA compile of a GPT-2-small-like train step (CPU, abstract args only).

``automap.profile`` is timed as the median of ``--repeats`` runs; ``jax.jit(step).trace(*args)
.lower().compile()`` (the same pipeline as ``jit(step).lower(*args).compile()``, phases timed
apart) runs once. Both see only ``jax.ShapeDtypeStruct`` arguments, so nothing is allocated.
Prints both times and their ratio (target: the profile under 10% of the compile), the same ratio
without the jax tracing both must do (``automap.trace`` alone, median of ``--repeats``), the
profile's memory breakdown, and for reference XLA's own FLOPs and memory next to the profile's.

    python benchmarks/profile_time.py [--layers 12] [--d-model 768] [--seq 1024] [--vocab 50304]
                                      [--batch 8] [--scan] [--repeats 3] [--no-compile]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import jax

import automap
from automap import zoo
from automap.profile import fmt_bytes, fmt_flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--scan", action="store_true", help="scan over the layers instead of unrolling")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="time the profile only")
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()

    cfg = zoo.GPTConfig(layers=a.layers, d_model=a.d_model, heads=a.heads, seq=a.seq, vocab=a.vocab,
                        batch=a.batch, scan=a.scan)
    w = zoo.gpt_linen(cfg)
    args = w.abstract()
    print(f"{w.name}: {cfg}")
    print(f"backend {jax.default_backend()}, {jax.device_count()} device(s), abstract arguments only\n")

    def median_time(f):
        times, result = [], None
        for _ in range(a.repeats):
            start = time.perf_counter()
            result = f()
            times.append(time.perf_counter() - start)
        return statistics.median(times), times, result

    t_profile, times, prof = median_time(lambda: automap.profile(w.train_step, *args))
    gc.disable()  # as inside automap.profile
    t_trace, _, _ = median_time(lambda: automap.trace(w.train_step, args))
    gc.enable()
    print(prof.table(top=a.top))
    print()
    runs = ", ".join(f"{t:.3f}" for t in times)
    print(f"automap.profile     {t_profile:7.3f} s  (median of {a.repeats}: {runs}), of which jax tracing "
          f"{t_trace:.3f} s (GC paused, as in the profile)")
    if a.no_compile:
        return

    start = time.perf_counter()
    traced = jax.jit(w.train_step).trace(*args)
    t_jit_trace = time.perf_counter() - start
    lowered = traced.lower()
    t_lower = time.perf_counter() - start - t_jit_trace
    compiled = lowered.compile()
    t_compile = time.perf_counter() - start
    ratio = t_profile / t_compile
    print(f"XLA jit+compile     {t_compile:7.3f} s  (one run: trace {t_jit_trace:.3f} + lower "
          f"{t_lower:.3f} + XLA compile {t_compile - t_jit_trace - t_lower:.3f})")
    print(f"ratio profile / compile = {ratio:.3f} ({100 * ratio:.1f}%; target < 10%: "
          f"{'met' if ratio < 0.10 else 'MISSED'})")
    beyond = (t_profile - t_trace) / (t_compile - t_jit_trace)
    print(f"ratio without the jax tracing both do = {beyond:.3f} ({100 * beyond:.1f}%)")

    # XLA's own numbers next to the profile's (no while loops when unrolled: cost_analysis is exact)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    mem = compiled.memory_analysis()
    if cost and "flops" in cost:
        print(f"\nFLOPs: profile {fmt_flops(prof.totals.flops)} vs XLA cost_analysis {fmt_flops(cost['flops'])}"
              + (" (XLA counts a scan body once)" if a.scan else ""))
    if mem is not None:
        xla = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
        print(f"memory: profile peak {fmt_bytes(prof.memory['peak'])} vs XLA argument+output-alias+temp "
              f"{fmt_bytes(xla)} (temp {fmt_bytes(mem.temp_size_in_bytes)})")


if __name__ == "__main__":
    main()
