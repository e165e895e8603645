"""One optirs.torch AdamW step per step format, each between cudaProfilerStart/Stop, for Nsight Compute.

Shapes: GPT-2 124M (148 tensors) or GPT-2 1.3B (``GPT2Config(n_embd=2048, n_layer=24)`` shapes,
1.31G parameters). After the profiled step, 20 back-to-back steps are timed with CUDA events
(end to end, the host included), so ncu's kernel time and the step's time sit side by side:

    ncu --profile-from-start off --clock-control none --csv \\
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\\
launch__registers_per_thread,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active,\\
smsp__inst_executed.sum \\
        python benchmarks/ncu_formats.py 124m bf16_masters r8_int8 > ncu.csv

``--flat`` steps the model's parameter count as one tensor.

``OPTIRS_CUDA_FORMATS_BLOCK`` picks the formats kernels' block size (a tuning knob, see
optirs/backends/cuda/formats.py).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_formats import MODELS, gpt2_shapes, variant_shapes  # noqa: E402  (GPT-2's parameter shapes, as the formats rows')

# name: (parameter dtype, master, state dtype, stochastic rounding)
KINDS = {
    "fp32": ("float32", None, "float32", False),
    "bf16_masters": ("bfloat16", "float32", "float32", False),
    "bf16_masters_bf16": ("bfloat16", "float32", "bfloat16", False),
    "r16": ("bfloat16", "remainder16", "float32", False),
    "r16_int8": ("bfloat16", "remainder16", "int8", False),
    "r8_bf16": ("bfloat16", "remainder8", "bfloat16", False),
    "r8_int8": ("bfloat16", "remainder8", "int8", False),
    "nearest_bf16": ("bfloat16", None, "bfloat16", False),
    "sr_bf16": ("bfloat16", None, "bfloat16", True),
    "sr_int8": ("bfloat16", None, "int8", True),
    "fp32_bf16": ("float32", None, "bfloat16", False),
    "fp32_int8": ("float32", None, "int8", False),
    "r8_sqrt": ("bfloat16", "remainder8", "int8_sqrt", False),
    "sr_sqrt": ("bfloat16", None, "int8_sqrt", True),
    "fp32_sqrt": ("float32", None, "int8_sqrt", False),
    "r8_fp8": ("bfloat16", "remainder8", "float8_e4m3fn", False),
    "sr_fp8": ("bfloat16", None, "float8_e4m3fn", True),
    "fp32_fp8": ("float32", None, "float8_e4m3fn", False),
    "fp16_masters": ("float16", "float32", "float32", False),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", choices=sorted(MODELS))
    ap.add_argument("kinds", nargs="+", choices=sorted(KINDS), metavar="KIND", help=", ".join(KINDS))
    ap.add_argument("--flat", action="store_true", help="the model's parameters as one tensor of the same count")
    args = ap.parse_args(argv)
    import torch

    import optirs.torch as ot

    if not torch.cuda.is_available():
        print("skipped: torch sees no CUDA device", file=sys.stderr)
        return 0
    shapes = variant_shapes(gpt2_shapes(args.shapes), flat=args.flat)
    for kind in args.kinds:
        pdt, master, state, sr = KINDS[kind]
        dtype = getattr(torch, pdt)
        params = [(torch.randn(s, device="cuda") * 0.02).to(dtype).requires_grad_(True) for s in shapes]
        for p in params:
            p.grad = (torch.randn(p.shape, device="cuda") * 1e-3).to(dtype)
        opt = ot.AdamW(params, lr=1e-3, weight_decay=0.1, master_weights=master, state_dtype=state,
                       stochastic_rounding=sr, seed=1)
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        opt.step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            opt.step()
        end.record()
        torch.cuda.synchronize()
        print(f"{args.shapes}{' flat' if args.flat else ''} {kind}: {start.elapsed_time(end) / 20:.3f} ms per step (events, end to end)", flush=True)
        del opt, params
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
