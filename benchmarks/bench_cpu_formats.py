"""The cpu backend's format loops against a parallel host copy of the same bytes, in one run.

For each format: AdamW's format step through the cpu backend's step hook (no frontend: the loop
itself), the step time (median of batches), the bytes per parameter it moves (each array read and
written once, the gradient read; int8 state counts its block scales; LAMB's three passes count
what each reads and writes), GB/s, and the ratio to a
parallel host copy (numba ``prange`` over blocks, the kernels' thread count) moving the same
number of bytes, timed in alternation with the step so that both see the same load (other
processes on a shared machine move the figures; the ratio is what stays). Beside the wall-clock
figures, the process CPU time of both per parameter (all threads): on a loaded machine the
wall-clock ratio follows the other processes, the CPU-time ratio much less.

    python benchmarks/bench_cpu_formats.py                          # 16M parameters, every format
    python benchmarks/bench_cpu_formats.py --size 4194304 --formats int8 --json out.json
    python benchmarks/bench_cpu_formats.py --family lamb            # any family with a format step
    python benchmarks/bench_cpu_formats.py --check-digest           # bit digests of 3 steps per format

``--check-digest`` prints a digest of each format's parameters, masters and state after three
steps of random data (the same on every run of the same code): compare two branches with it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (label, param dtype, grad dtype, master, state dtype, stochastic rounding)
FORMATS = [
    ("fp32 params, fp32 state", "float32", "float32", None, "float32", False),
    ("fp32 params, bf16 state", "float32", "float32", None, "bfloat16", False),
    ("fp32 params, int8 state", "float32", "float32", None, "int8", False),
    ("bf16 params, fp32 masters, fp32 state", "bfloat16", "bfloat16", "float32", "float32", False),
    ("bf16 params, fp32 masters, bf16 state", "bfloat16", "bfloat16", "float32", "bfloat16", False),
    ("bf16 params, fp32 masters, int8 state", "bfloat16", "bfloat16", "float32", "int8", False),
    ("bf16 params, remainder16, fp32 state", "bfloat16", "bfloat16", "remainder16", "float32", False),
    ("bf16 params, remainder16, bf16 state", "bfloat16", "bfloat16", "remainder16", "bfloat16", False),
    ("bf16 params, remainder16, int8 state", "bfloat16", "bfloat16", "remainder16", "int8", False),
    ("bf16 params, remainder8, bf16 state", "bfloat16", "bfloat16", "remainder8", "bfloat16", False),
    ("bf16 params, remainder8, int8 state", "bfloat16", "bfloat16", "remainder8", "int8", False),
    ("bf16 params, no masters (nearest), fp32 state", "bfloat16", "bfloat16", None, "float32", False),
    ("bf16 params, stochastic rounding, bf16 state", "bfloat16", "bfloat16", None, "bfloat16", True),
    ("bf16 params, stochastic rounding, int8 state", "bfloat16", "bfloat16", None, "int8", True),
    ("fp16 params, fp32 masters, fp32 state", "float16", "float16", "float32", "float32", False),
    ("fp16 params, fp32 masters, int8 state", "float16", "float16", "float32", "int8", False),
    ("fp32 params, int8 sqrt state", "float32", "float32", None, "int8_sqrt", False),
    ("bf16 params, fp32 masters, int8 sqrt state", "bfloat16", "bfloat16", "float32", "int8_sqrt", False),
    ("bf16 params, remainder16, int8 sqrt state", "bfloat16", "bfloat16", "remainder16", "int8_sqrt", False),
    ("bf16 params, remainder8, int8 sqrt state", "bfloat16", "bfloat16", "remainder8", "int8_sqrt", False),
    ("bf16 params, stochastic rounding, int8 sqrt state", "bfloat16", "bfloat16", None, "int8_sqrt", True),
    ("fp32 params, float8 state", "float32", "float32", None, "float8_e4m3fn", False),
    ("bf16 params, fp32 masters, float8 state", "bfloat16", "bfloat16", "float32", "float8_e4m3fn", False),
    ("bf16 params, remainder16, float8 state", "bfloat16", "bfloat16", "remainder16", "float8_e4m3fn", False),
    ("bf16 params, remainder8, float8 state", "bfloat16", "bfloat16", "remainder8", "float8_e4m3fn", False),
    ("bf16 params, stochastic rounding, float8 state", "bfloat16", "bfloat16", None, "float8_e4m3fn", True),
]

_WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}
_MASTER = {None: 0, "float32": 4, "remainder16": 2, "remainder8": 1}
_STATE = {"float32": 4, "bfloat16": 2, "int8": 1 + 4 / 256, "int8_sqrt": 1 + 4 / 256, "float8_e4m3fn": 1 + 4 / 256}


def bytes_per_param(param: str, grad: str, master: Optional[str], state: str, slots: int, family: str = "adamw",
                    clips: bool = False) -> float:
    """Bytes one step moves per parameter: parameter, master and state read and written, gradient read.
    LAMB takes three passes: the gradient norm (``clips``: max_grad_norm set), the sums of pass 1
    (everything read, nothing written) and pass 2 (everything read again, then written)."""
    m = _MASTER[master] if param != "float32" else 0
    reads = _WIDTH[param] + _WIDTH[grad] + m + slots * _STATE[state]
    writes = _WIDTH[param] + m + slots * _STATE[state]
    if family == "lamb":
        return (_WIDTH[grad] if clips else 0) + 2 * reads + writes
    return reads + writes


def host_copy_kernel():
    """A parallel copy of 8-byte words in blocks (the same threads as the kernels; ``copy_blocks(src,
    dst, block)``, which releases the GIL: bench_host_contention runs it beside CUDA copies)."""
    from numba import prange

    from optirs.core.compile_cache import cached_njit

    @cached_njit()
    def copy_range(src, dst, s, e):
        dst[s:e] = src[s:e]

    @cached_njit(parallel=True, nogil=True)
    def copy_blocks(src, dst, block):
        n = src.shape[0]
        for b in prange((n + block - 1) // block):
            copy_range(src, dst, b * block, min(b * block + block, n))

    return copy_blocks


class Problem:
    """One format's AdamW step on ``shapes`` through the cpu backend's step hook."""

    def __init__(self, spec, shapes, family: str, seed: int = 7):
        import optirs
        from optirs.core import formats as F
        from optirs.core import reference as R
        from optirs.core.layout import TensorLayout

        self.label, pdt, gdt, master, sdt, sr = spec
        self.b = optirs.get_backend("cpu")
        self.d, self.hp = _family(family)
        self.fmt = F.StepFormat(pdt, gdt, master, sdt, sr)
        self.layout = TensorLayout(shapes)
        self.fs = F.FormatState(self.layout, F.format_slots(self.d, self.hp), self.fmt)
        self.state = R.fresh_buffers(self.fs, self.d, self.hp)
        rng = np.random.default_rng(seed)
        self.params = [_words(rng.standard_normal(s).astype(np.float32), pdt) for s in shapes]
        self.grads = [_words(rng.standard_normal(s).astype(np.float32) * np.float32(0.5), gdt) for s in shapes]
        self.staged = self.b.stage(self.b.ctx, self.params, self.grads, self.fmt)
        self.slots = len(self.fs.slot_names)
        self.seed, self.k = seed, 0

    def step(self) -> None:
        from optirs.plugin.hookspecs import StepControls, StepRequest

        self.k += 1
        self.b.step(self.b.ctx, StepRequest(self.d, self.staged.params, self.staged.grads, self.state, self.layout,
                                            self.d.scalars(self.hp, self.k), StepControls(self.k, self.seed, None,
                                                                                          False, None),
                                            self.fmt, self.fs))

    def nonfinite(self) -> int:
        """Parameters that are inf or NaN (a run that diverged times the loops' NaN handling)."""
        from optirs.core import reference as R

        dt = self.fmt.param_dtype
        values = (p if dt == "float32" else R.decode16(p, dt) for p in self.params)
        return sum(int(np.count_nonzero(~np.isfinite(v))) for v in values)

    def digest(self) -> str:
        h = hashlib.sha256()
        for p in self.params:
            h.update(np.ascontiguousarray(p).view(np.uint8).tobytes())
        for k in sorted(self.state):
            h.update(k.encode())
            h.update(np.ascontiguousarray(self.state[k]).view(np.uint8).tobytes())
        return h.hexdigest()[:16]


def _family(family: str):
    from optirs.core import params as P
    from optirs.core.definitions import DEFINITIONS

    hps = {"adamw": P.AdamParams(lr=1e-3, weight_decay=0.1), "sgd": P.SgdParams(lr=1e-2, momentum=0.9),
           "lion": P.LionParams(lr=1e-4, weight_decay=0.1), "lamb": P.LambParams(lr=1e-3, max_grad_norm=1.0),
           # not centered: every step repeats one gradient, so a centered variance falls to 0 and the
           # parameters reach inf and NaN within 30 steps (the loops would time their NaN handling)
           "rmsprop": P.RmspropParams(lr=1e-3, alpha=0.9, momentum=0.5),
           "adagrad": P.AdagradParams(lr=1e-2)}
    if family not in hps:
        raise SystemExit(f"--family {family!r}: expected one of {sorted(hps)}")
    return DEFINITIONS[family], hps[family]


def _words(x: np.ndarray, dtype: str) -> np.ndarray:
    from optirs.core import reference as R

    return x if dtype == "float32" else R.nearest16(x, dtype).reshape(x.shape)


def _ms(fn, steps: int):
    """(wall ms, process CPU ms) per call: the CPU time of all threads reads the same under load."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / steps, (time.process_time() - c0) * 1e3 / steps


def step_ns(problem: Problem, steps: int, batches: int) -> List[float]:
    """Wall ns a parameter of ``problem``'s step in each of ``batches`` batches of ``steps`` (after two
    steps of warm-up): the diagnostics' unit, whose spread they print."""
    for _ in range(2):
        problem.step()
    return [_ms(problem.step, steps)[0] * 1e6 / problem.layout.total for _ in range(batches)]


def measure(problem: Problem, copy, steps: int, batches: int) -> Dict[str, Any]:
    """The step and a copy of the same bytes, alternating batch by batch; medians of both."""
    n = problem.layout.total
    bpp = bytes_per_param(problem.fmt.param_dtype, problem.fmt.grad_dtype, problem.fmt.master,
                          problem.fmt.state_dtype, problem.slots, problem.d.name,
                          getattr(problem.hp, "max_grad_norm", 0) > 0)
    words = int(n * bpp / 16)  # a copy of half the bytes reads and writes them all
    src, dst = np.ones(words, np.uint64), np.zeros(words, np.uint64)
    block = 1 << 15
    for _ in range(2):
        problem.step()
        copy(src, dst, block)
    step, cp = [], []
    for _ in range(batches):
        step.append(_ms(problem.step, steps))
        cp.append(_ms(lambda: copy(src, dst, block), steps))
    s, c = statistics.median(t for t, _ in step), statistics.median(t for t, _ in cp)
    s_cpu, c_cpu = statistics.median(t for _, t in step), statistics.median(t for _, t in cp)
    gb = n * bpp / 1e9
    return dict(format=problem.label, params=n, bytes_per_param=round(bpp, 4), step_ms=round(s, 3),
                ns_per_param=round(s * 1e6 / n, 3), gb_per_s=round(gb / (s / 1e3), 2),
                copy_ms=round(c, 3), copy_gb_per_s=round(gb / (c / 1e3), 2), ratio=round(c / s, 3),
                cpu_ns_per_param=round(s_cpu * 1e6 / n, 3), copy_cpu_ns_per_param=round(c_cpu * 1e6 / n, 3),
                cpu_ratio=round(c_cpu / s_cpu, 3), nonfinite_params=problem.nonfinite())


def select(formats: str) -> List[Any]:
    """The FORMATS whose label holds any part of ``formats`` (empty: all). The parts are split on ';'
    where it holds one; else the whole where a label holds it (``fp32 params, int8 sqrt``), else
    split on ','."""
    if not formats:
        return list(FORMATS)
    if ";" in formats:
        parts = formats.split(";")
    elif any(formats in f[0] for f in FORMATS):
        parts = [formats]
    else:
        parts = formats.split(",")
    parts = [p for p in parts if p.strip()]
    return [f for f in FORMATS if any(p in f[0] for p in parts)]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1 << 24, help="parameters in all (default 16M)")
    ap.add_argument("--tensors", type=int, default=4, help="equal tensors the parameters are split into")
    ap.add_argument("--family", default="adamw")
    ap.add_argument("--formats", default="",
                    help="substrings of the format labels to run, separated by ';' (the labels hold commas), or by "
                         "',' where no ';' is given and no label holds the whole: 'remainder8, int8 sqrt;fp32 "
                         "params, int8 sqrt', 'fp32 params, int8 sqrt' or 'int8,bf16 state'")
    ap.add_argument("--steps", type=int, default=5, help="back-to-back steps per batch")
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--check-digest", action="store_true", help="print bit digests of 3 steps instead of timing")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    import numba

    specs = select(args.formats)
    if not specs:
        ap.error(f"--formats {args.formats!r} matches no format; the labels are: " + "; ".join(f[0] for f in FORMATS))
    if args.formats:
        print(f"{len(specs)} of {len(FORMATS)} formats: " + "; ".join(f[0] for f in specs), flush=True)
    if args.check_digest:
        shapes = [(257, 301), (40000,), (100,), (3, 7)]  # a short last block, small tensors
        for spec in specs:
            p = Problem(spec, shapes, args.family)
            for _ in range(3):
                p.step()
            print(f"{p.digest()}  {args.family}  {spec[0]}", flush=True)
        return 0
    per = args.size // args.tensors
    shapes = [(per,)] * args.tensors
    copy = host_copy_kernel()
    print(f"cpu formats, {args.family}, {per * args.tensors} parameters in {args.tensors} tensors, "
          f"{numba.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'format':48s} {'B/param':>8s} {'step ms':>9s} {'ns/param':>9s} {'GB/s':>7s} {'copy GB/s':>10s} "
          f"{'ratio':>6s} {'cpu ns/p':>9s} {'copy cpu':>9s} {'cpu ratio':>9s}", flush=True)
    rows = []
    for spec in specs:
        r = measure(Problem(spec, shapes, args.family), copy, args.steps, args.batches)
        rows.append(r)
        print(f"{r['format']:48s} {r['bytes_per_param']:8.2f} {r['step_ms']:9.2f} {r['ns_per_param']:9.3f} "
              f"{r['gb_per_s']:7.1f} {r['copy_gb_per_s']:10.1f} {r['ratio']:6.2f} {r['cpu_ns_per_param']:9.3f} "
              f"{r['copy_cpu_ns_per_param']:9.3f} {r['cpu_ratio']:9.2f}", flush=True)
        if r["nonfinite_params"]:
            print(f"  warning: {r['nonfinite_params']} parameters are inf or NaN after the run", flush=True)
        if args.json:
            _write(args, rows, numba.get_num_threads())
    return 0


def _write(args, rows, threads: int) -> None:
    with open(args.json, "w") as f:
        json.dump(dict(size=args.size, tensors=args.tensors, family=args.family, threads=threads,
                       load_average=os.getloadavg()[0], rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
