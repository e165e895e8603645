"""Time the opencl backend's format steps (issue 13) on GPT-2 124M shapes, beside a buffer copy.

Drives the ``formats`` hooks directly (the optimizer classes' ``precision=`` option is a later
task): one flat pyopencl buffer per kind, as a packed model, AdamW, every format of the issue.
Prints ms per step, the format's own bytes per parameter and the share of copy bandwidth.

    python benchmarks/bench_opencl_formats.py [--reps 50] [--small]
"""

from __future__ import annotations

import argparse

import numpy as np

import optirs
from optirs.core import formats as F
from optirs.core import formats_reference as R
from optirs.core.definitions import DEFINITIONS
from optirs.core.layout import TensorLayout

FORMATS = {  # name -> StepFormat fields
    "bf16 + f32 master, f32 state": ("bfloat16", "bfloat16", "float32", "float32", False),
    "bf16 + remainder16, f32 state": ("bfloat16", "bfloat16", "remainder16", "float32", False),
    "bf16 sr, bf16 state": ("bfloat16", "bfloat16", None, "bfloat16", True),
    "bf16 + remainder8, int8 state": ("bfloat16", "bfloat16", "remainder8", "int8", False),
    "f32, int8 state": ("float32", "float32", None, "int8", False),
}


def gpt2_shapes(small: bool):
    d, v, n = (768, 50257, 12) if not small else (64, 512, 2)
    shapes = [(v, d), (1024 if not small else 128, d)]
    for _ in range(n):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def bytes_per_param(fmt: F.StepFormat) -> float:
    p = 4 if fmt.param_dtype == "float32" else 2
    g = 4 if fmt.grad_dtype == "float32" else 2
    m = {None: 0, "float32": 4, "remainder16": 2, "remainder8": 1}[fmt.master]
    s = {"float32": 4, "bfloat16": 2, "int8": 1 + 4 / 256}[fmt.state_dtype]
    return 2 * p + g + 2 * m + 2 * 2 * s  # read+write p, master and both moments; read g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--small", action="store_true", help="tiny shapes (a smoke run on PoCL)")
    args = ap.parse_args()
    b = optirs.get_backend("opencl")
    ctx = b.ctx
    import pyopencl.array as cla

    layout = TensorLayout(gpt2_shapes(args.small))
    n = layout.total
    d, hp = DEFINITIONS["adamw"], optirs.AdamParams(lr=1e-3, weight_decay=0.01)
    copy_name, copy = b.hook("measure", "optirs_measure_copy")(ctx, n)
    elapsed = b.hook("measure", "optirs_measure_elapsed_ms")
    copy_ms = elapsed(ctx, copy, args.reps)
    copy_gbs = 2 * 4 * n / copy_ms / 1e6  # read and write n float32
    print(f"{ctx.device.name.strip()}: {len(layout)} tensors, {n} parameters; {copy_name} {copy_gbs:.0f} GB/s")
    step_hook = b.hook("formats", "optirs_formats_step")
    rng = np.random.default_rng(0)
    for name, fields in FORMATS.items():
        fmt = F.StepFormat(*fields)
        fs = F.FormatState(layout, F.format_slots(d, hp), fmt)
        state = {k: b.to_device(ctx, v) for k, v in R.fresh_buffers(fs, d, hp).items()}
        words = lambda dt: (rng.standard_normal(n, dtype=np.float32) if dt == "float32"
                            else R.nearest16(rng.standard_normal(n, dtype=np.float32), dt))
        flat_p, flat_g = cla.to_device(ctx.queue, words(fmt.param_dtype)), cla.to_device(ctx.queue, words(fmt.grad_dtype))
        params = [flat_p[int(o): int(o) + int(k)] for o, k in zip(layout.offsets, layout.sizes)]
        grads = [flat_g[int(o): int(o) + int(k)] for o, k in zip(layout.offsets, layout.sizes)]
        t = [1]

        def step():
            step_hook(ctx, d.kernel, params, grads, state, layout, fs, fmt, d.scalars(hp, t[0]), 0, t[0], None)
            t[0] += 1

        step()  # build and plan
        ms = elapsed(ctx, step, args.reps)
        nbytes = bytes_per_param(fmt)
        gbs = nbytes * n / ms / 1e6
        print(f"{name:34s} {ms:8.3f} ms  {nbytes:5.2f} B/param  {gbs:7.0f} GB/s  {100 * gbs / copy_gbs:5.1f}% of copy")


if __name__ == "__main__":
    main()
