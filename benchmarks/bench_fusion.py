"""Fused vs op-by-op: a chain of 8 elementwise ops on 16M float32 elements.

Three ways to run the same graph, timed in ``--repeats`` rounds after a warm-up (compilation
excluded), every round running each variant once; times are medians, ratios medians of the
per-round ratios:

* fused: the planner's plan, one generated kernel for the whole chain;
* op-by-op, same backend: the ``unfused`` plan, one generated kernel per op;
* numpy op-by-op: ``FusionGraph.evaluate``, one numpy ufunc call per op.

Every variant allocates its outputs and intermediates per run, as numpy does; a fourth row
runs the fused kernel into a preallocated output, to compare with the copy at equal bytes.

Printed as ratios (the fused speed-up over each), beside the bytes each moves and a plain copy
of the same size (a numba ``prange`` loop with the same threads) as the memory-bandwidth yardstick
measured in the same run.

    python benchmarks/bench_fusion.py [--elements N] [--repeats R] [--backend cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numba
import numpy as np

from optirs.backends.cpu import cpu_name


def chain_graph(n: int):
    from optirs.analysis.fusion import FusionGraph

    g = FusionGraph()
    x = g.input("x", (n,), np.float32)
    v = g.op("mul", x, 1.5)
    v = g.op("add", v, 0.25)
    v = g.op("abs", v)
    v = g.op("square", v)
    v = g.op("add", v, 1.0)  # >= 1: no cancellation, so the three variants agree to rounding
    v = g.op("sqrt", v)
    v = g.op("maximum", v, 1.1)
    v = g.op("mul", v, 2.0)
    return g


def _copy(dst, src):
    for i in numba.prange(src.size):
        dst[i] = src[i]


def interleaved_times(variants: dict, repeats: int) -> dict:
    """Per variant, its time in each round; every round runs every variant once.

    Interleaving puts the variants under the same background load in each round (this machine
    is shared), so the per-round ratios are steadier than ratios of separately taken medians.
    """
    for fn in variants.values():  # warm-up: page faults of fresh outputs, thread pool start
        fn()
    times = {k: [] for k in variants}
    names = list(variants)
    for r in range(repeats):
        for k in names[r % len(names):] + names[: r % len(names)]:  # rotate the order
            t0 = time.perf_counter()
            variants[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def median_ratio(num, den) -> float:
    return statistics.median(a / b for a, b in zip(num, den))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=16 * 1024 * 1024)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)

    from optirs.analysis.fusion import FusionPlanner

    n = args.elements
    graph = chain_graph(n)
    planner = FusionPlanner()
    fused = planner.plan(graph)
    unfused = planner.plan(graph, method="unfused")
    cf, cu = fused.compile(args.backend), unfused.compile(args.backend)
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    inputs = {"x": x}
    out = graph.outputs[0]

    # the three must agree before their speeds mean anything (tanh may differ in the last bit)
    a, b, c = cf.run(inputs)[out], cu.run(inputs)[out], graph.evaluate(inputs)[out]
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-6)

    dst = np.empty_like(x)
    # the yardstick: a copy with the same threads as the fused kernel (np.copyto uses one)
    par_copy = numba.njit(parallel=True)(_copy)
    par_copy(dst, x)
    res_out = {out: np.empty_like(x)}
    times = interleaved_times({
        "fused": lambda: cf.run(inputs),
        "fused_preallocated": lambda: cf.run(inputs, res_out),
        "op_by_op": lambda: cu.run(inputs),
        "numpy_op_by_op": lambda: graph.evaluate(inputs),
        "parallel_copy": lambda: par_copy(dst, x),
        "np_copyto": lambda: np.copyto(dst, x),
    }, args.repeats)
    med = {k: statistics.median(v) for k, v in times.items()}
    t_fused, t_fused_pre, t_unfused = med["fused"], med["fused_preallocated"], med["op_by_op"]
    t_numpy, t_copy, t_npcopy = med["numpy_op_by_op"], med["parallel_copy"], med["np_copyto"]

    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_name()}, {os.cpu_count()} logical CPUs, numba threads {numba.config.NUMBA_NUM_THREADS}",
        "versions": {"python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__},
        "backend": args.backend,
        "elements": n,
        "repeats": args.repeats,
        "kernels": {"fused": cf.kernel_count, "op_by_op": cu.kernel_count},
        "bytes": {"fused": fused.bytes_after, "op_by_op": unfused.bytes_after},
        "seconds_median": med,
        # medians of the per-round ratios
        "ratio": {"op_by_op / fused": median_ratio(times["op_by_op"], times["fused"]),
                  "numpy_op_by_op / fused": median_ratio(times["numpy_op_by_op"], times["fused"])},
        # both move the same bytes into a preallocated array: the kernel's share of bandwidth
        "fused_fraction_of_copy": median_ratio(times["parallel_copy"], times["fused_preallocated"]),
    }
    print(f"fusion benchmark: chain of 8 elementwise ops, {n} float32 elements, backend {args.backend}")
    print(f"  {res['date']}; {res['machine']}; numpy {np.__version__}, numba {numba.__version__}")
    print(f"  {'variant':<26}{'kernels':>8}{'MB moved':>10}{'median ms':>11}{'GB/s':>8}")
    rows = [("fused (generated)", cf.kernel_count, fused.bytes_after, t_fused),
            ("fused, output preallocated", cf.kernel_count, fused.bytes_after, t_fused_pre),
            ("op-by-op (generated)", cu.kernel_count, unfused.bytes_after, t_unfused),
            ("numpy op-by-op", len(graph), unfused.bytes_after, t_numpy),
            ("parallel copy (yardstick)", 1, 2 * x.nbytes, t_copy),
            ("np.copyto (one thread)", 1, 2 * x.nbytes, t_npcopy)]
    for name, k, nbytes, t in rows:
        print(f"  {name:<26}{k:>8}{nbytes / 1e6:>10.0f}{t * 1e3:>11.2f}{nbytes / t / 1e9:>8.2f}")
    print(f"  fused speed-up: {res['ratio']['op_by_op / fused']:.2f}x over op-by-op on {args.backend}, "
          f"{res['ratio']['numpy_op_by_op / fused']:.2f}x over numpy op-by-op; "
          f"fused kernel (preallocated output) at {res['fused_fraction_of_copy']:.0%} of copy bandwidth")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
