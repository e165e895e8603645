"""AdamW in every step format on the H200, beside the peers, in one run (issue 13).

GPT-2 124M shapes (``transformers.GPT2Config()``: 148 tensors, 124.4M parameters; by hand when
transformers is missing), AdamW (lr 1e-3, weight decay 0.1 on every tensor). optirs is driven
through the cuda backend's ``formats`` hooks (stage, step) on torch CUDA tensors: the optimizer
classes' ``precision=`` option is a later task, so this measures the kernels plus the hooks' host
path. For each format: ms per step (CUDA events over back-to-back steps after warm-up, the median
of batches), the format's own bytes per parameter (each array read and written once), GB/s and its
ratio to the copy bandwidth measured in the same run (torch ``copy_``), and the state bytes per
parameter (masters + optimizer state as allocated).

Peers where they import: torch.optim.AdamW(fused=True) in float32 and on bfloat16 parameters,
bitsandbytes AdamW8bit, torchao AdamW8bit / AdamW4bit, FlashOptim FlashAdamW.

    python benchmarks/bench_formats_cuda.py --json h200-formats.json
    python benchmarks/bench_formats_cuda.py --smoke     # tiny shapes; skips cleanly without CUDA
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

LR, BETAS, EPS, DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.1

# (label, param dtype, master, state dtype, stochastic rounding)
FORMATS = [
    ("bf16 params, fp32 masters, fp32 state", "bfloat16", "float32", "float32", False),
    ("bf16 params, fp32 masters, bf16 state", "bfloat16", "float32", "bfloat16", False),
    ("bf16 params, remainder16, fp32 state", "bfloat16", "remainder16", "float32", False),
    ("bf16 params, remainder16, int8 state", "bfloat16", "remainder16", "int8", False),
    ("bf16 params, remainder8, bf16 state", "bfloat16", "remainder8", "bfloat16", False),
    ("bf16 params, remainder8, int8 state", "bfloat16", "remainder8", "int8", False),
    ("bf16 params, no masters (nearest), fp32 state", "bfloat16", None, "float32", False),
    ("bf16 params, stochastic rounding, bf16 state", "bfloat16", None, "bfloat16", True),
    ("bf16 params, stochastic rounding, int8 state", "bfloat16", None, "int8", True),
    ("fp16 params, fp32 masters, fp32 state", "float16", "float32", "float32", False),
    ("fp32 params, bf16 state", "float32", None, "bfloat16", False),
    ("fp32 params, int8 state", "float32", None, "int8", False),
]


def gpt2_shapes(smoke: bool) -> List[Tuple[int, ...]]:
    if smoke:
        return [(64, 96), (96,), (5000,), (33,)]
    try:
        from transformers import GPT2Config

        c = GPT2Config()
        vocab, pos, d, layers = c.vocab_size, c.n_positions, c.n_embd, c.n_layer
    except ImportError:
        vocab, pos, d, layers = 50257, 1024, 768, 12
    shapes: List[Tuple[int, ...]] = [(vocab, d), (pos, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def timed(torch: Any, fn: Callable[[], None], steps: int, batches: int) -> float:
    """Median ms per call over ``batches`` batches of ``steps`` back-to-back calls (after warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / steps)
    return statistics.median(times)


def copy_bandwidth(torch: Any, smoke: bool) -> float:
    n = (1 << 20) if smoke else (256 << 20)
    src = torch.ones(n, device="cuda")
    dst = torch.empty_like(src)
    ms = timed(torch, lambda: dst.copy_(src), 5 if smoke else 20, 3 if smoke else 5)
    return 2 * 4 * n / (ms * 1e-3) / 1e9


def format_bytes(pdt: str, master: Optional[str], state: str) -> float:
    """Bytes per parameter one step moves: p, master and two moments read and written, g read."""
    p = 2 if pdt != "float32" else 4
    m = {None: 0, "float32": 4, "remainder16": 2, "remainder8": 1}[master if pdt != "float32" else None]
    s = {"float32": 4, "bfloat16": 2, "int8": 1 + 4 / 256}[state]
    return 2 * p + p + 2 * m + 2 * 2 * s


def bench_optirs(torch: Any, shapes, spec, steps: int, batches: int) -> Dict[str, Any]:
    from optirs.backends.cuda import plugin
    from optirs.core.definitions import DEFINITIONS
    from optirs.core.formats import FormatState, StepFormat
    from optirs.core.layout import TensorLayout
    from optirs.core.params import AdamParams

    label, pdt, master, state_dtype, sr = spec
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[pdt]
    params = [torch.randn(s, device="cuda").to(tdt) * 0.02 for s in shapes]
    grads = [torch.randn(s, device="cuda").to(tdt) * 1e-3 for s in shapes]
    fmt = StepFormat(pdt, pdt, master if pdt != "float32" else None, state_dtype, sr)
    d = DEFINITIONS["adamw"]
    hp = AdamParams(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=DECAY)
    layout = TensorLayout(shapes)
    fs = FormatState(layout, [s for s in d.slots if s.needed(hp)], fmt)
    ctx = plugin.optirs_open({})
    fills, dtypes = fs.buffer_fills(d.state_slots(hp)), fs.buffer_dtypes()
    state = {k: plugin.optirs_alloc(ctx, max(1, n), dtypes[k], fills[k]) for k, n in fs.buffer_sizes().items()}
    state_bytes = sum(n * dtypes[k].itemsize for k, n in fs.buffer_sizes().items())
    count = [0]

    def step() -> None:
        count[0] += 1
        staged = plugin.optirs_formats_stage(ctx, params, grads, fmt)
        plugin.optirs_formats_step(ctx, "adam", staged.params, staged.grads, state, layout, fs, fmt,
                                   d.scalars(hp, count[0]), 1234, count[0], None)

    ms = timed(torch, step, steps, batches)
    return {"label": f"optirs {label}", "ms": ms, "bytes_per_param": format_bytes(pdt, fmt.master, state_dtype),
            "state_bytes_per_param": state_bytes / layout.total}


def bench_peer(torch: Any, shapes, label: str, make: Callable, dtype: Any, bytes_pp: float, steps: int,
               batches: int) -> Optional[Dict[str, Any]]:
    params = [torch.nn.Parameter(torch.randn(s, device="cuda").to(dtype) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    try:
        opt = make(params)
        ms = timed(torch, opt.step, steps, batches)
    except Exception as exc:  # a peer that imports but cannot run here: say why, keep the run
        return {"label": label, "error": f"{type(exc).__name__}: {exc}"}
    n = sum(p.numel() for p in params)
    state = 0
    for s in opt.state.values():
        for v in s.values():
            if torch.is_tensor(v) and v.numel() > 1:
                state += v.numel() * v.element_size()
            elif hasattr(v, "__tensor_flatten__"):  # torchao's quantized subclasses
                names, _ = v.__tensor_flatten__()
                state += sum(getattr(v, a).numel() * getattr(v, a).element_size() for a in names)
    return {"label": label, "ms": ms, "bytes_per_param": bytes_pp, "state_bytes_per_param": state / n}


def peers(torch: Any) -> List[Tuple[str, Callable, Any, float]]:
    out = [("torch fused AdamW fp32", lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY,
                                                                  fused=True), torch.float32, 28.0),
           ("torch fused AdamW bf16 params and state",
            lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY, fused=True),
            torch.bfloat16, 14.0)]
    try:
        import bitsandbytes as bnb

        out.append(("bitsandbytes AdamW8bit (fp32 params)",
                    lambda ps: bnb.optim.AdamW8bit(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY),
                    torch.float32, 12 + 4 + 2 * 2 * (1 + 4 / 2048)))
    except Exception as exc:
        print(f"# bitsandbytes not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
    try:
        from torchao.optim import AdamW4bit, AdamW8bit

        out.append(("torchao AdamW8bit (fp32 params)",
                    lambda ps: AdamW8bit(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY), torch.float32,
                    12 + 4 + 2 * 2 * (1 + 4 / 256)))
        out.append(("torchao AdamW4bit (fp32 params)",
                    lambda ps: AdamW4bit(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY), torch.float32,
                    12 + 2 * 2 * (0.5 + 4 / 128)))
    except Exception as exc:
        print(f"# torchao not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
    try:
        from flashoptim import FlashAdamW

        out.append(("FlashOptim FlashAdamW (bf16 + 8-bit correction)",
                    lambda ps: FlashAdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY), torch.bfloat16, 12.0))
    except Exception as exc:
        print(f"# FlashOptim not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few steps")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batches", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print(f"skipped: torch is not importable ({exc})")
        return 0
    if not torch.cuda.is_available():
        print(f"skipped: torch {torch.__version__} sees no CUDA device")
        return 0
    steps, batches = (2, 2) if args.smoke else (args.steps, args.batches)
    shapes = gpt2_shapes(args.smoke)
    n = sum(int(torch.Size(s).numel()) for s in shapes)
    gbs = copy_bandwidth(torch, args.smoke)
    print(f"# {len(shapes)} tensors, {n} parameters; copy bandwidth {gbs:.0f} GB/s ({torch.cuda.get_device_name()})")
    rows = []
    for spec in FORMATS:
        try:
            rows.append(bench_optirs(torch, shapes, spec, steps, batches))
        except Exception as exc:
            rows.append({"label": f"optirs {spec[0]}", "error": f"{type(exc).__name__}: {exc}"})
        torch.cuda.empty_cache()
    for label, make, dtype, bytes_pp in peers(torch):
        row = bench_peer(torch, shapes, label, make, dtype, bytes_pp, steps, batches)
        if row is not None:
            rows.append(row)
        torch.cuda.empty_cache()
    print(f"{'implementation':58s} {'ms':>8s} {'B/param':>8s} {'GB/s':>7s} {'of copy':>8s} {'state B/p':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['label']:58s} error: {r['error']}")
            continue
        r["gb_per_s"] = r["bytes_per_param"] * n / (r["ms"] * 1e-3) / 1e9
        r["of_copy"] = r["gb_per_s"] / gbs
        print(f"{r['label']:58s} {r['ms']:8.3f} {r['bytes_per_param']:8.2f} {r['gb_per_s']:7.0f} "
              f"{r['of_copy']:8.1%} {r['state_bytes_per_param']:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n, "tensors": len(shapes), "copy_gb_per_s": gbs, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
