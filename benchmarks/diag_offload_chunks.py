"""Where each CPUOffload chunk step's time goes: one offload row of ``bench_offload.py`` (the same
model, param groups and optimizer), and in one step after the warm-up every chunk's
``inner.step`` under its own cProfile, in the worker thread that runs it.

Prints each chunk's elements, tensors, wall time and ns an element, then the functions that took
the most time in the ``--top`` chunks with the most ns an element (the small-tensor chunk of GPT-2
1.3B's second param group took 9.7 ns an element in the H200's pipeline, the 64M chunks 0.2).

    python benchmarks/diag_offload_chunks.py --row offload_bf16_r8_int8sqrt_sib     # GPT-2 1.3B, CUDA
    python benchmarks/diag_offload_chunks.py --quick                                 # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import threading
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_offload as bo  # noqa: E402  (the rows, the model and the optimizers)


def profile_chunks(opt: Any) -> List[Dict[str, Any]]:
    """Wrap each chunk's inner step: a list that fills with (index, elements, tensors, wall s, stats)."""
    records: List[Dict[str, Any]] = []
    lock = threading.Lock()
    for index, chunk in enumerate(opt._chunks):
        inner_step = chunk.inner.step

        def step(*args: Any, _index: int = index, _chunk: Any = chunk, _step: Any = inner_step, **kwargs: Any):
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            try:
                return _step(*args, **kwargs)
            finally:
                prof.disable()
                wall = time.perf_counter() - t0
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
                with lock:
                    records.append(dict(index=_index, elements=sum(h.numel() for h in _chunk.host),
                                        tensors=len(_chunk.host), wall_s=wall, thread=threading.get_ident(),
                                        profile=text.getvalue()))

        chunk.inner.step = step
    return records


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--row", default="offload_bf16_r8_int8sqrt_sib",
                    help=f"an offload row of bench_offload.py ({', '.join(bo.OFFLOAD_ROWS)})")
    ap.add_argument("--quick", action="store_true", help="a tiny model on the CPU (seconds): checks the script")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the profiled one")
    ap.add_argument("--top", type=int, default=2, help="chunks whose profiles are printed (most ns an element)")
    args = ap.parse_args(argv)
    if bo.row_kind(args.row) not in bo.OFFLOAD_ROWS:
        ap.error(f"--row {args.row!r}: expected an offload row, one of {list(bo.OFFLOAD_ROWS)}")
    if args.warmup < 1 or args.top < 0:
        ap.error(f"--warmup {args.warmup}, --top {args.top}: expected warmup >= 1 and top >= 0")
    import torch

    cfg = dict(layers=24, embd=2048, heads=16, vocab=50257, seq=1024, micro=4, accum=8)
    if args.quick:
        cfg.update(layers=2, embd=64, heads=2, vocab=512, seq=32, micro=2, accum=2)
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if device == "cpu" and not args.quick:
        print("diag_offload_chunks: needs a CUDA device (--quick runs a tiny model on the CPU)")
        return 2
    from optirs.torch.offload import DEFAULT_BUCKET_ELEMENTS

    model, loss_fn, _ = bo.build_model(cfg, device, getattr(torch, bo.param_dtype(args.row)))
    opt, note = bo.make_optimizer(bo.row_kind(args.row), model, device, cfg["accum"], DEFAULT_BUCKET_ELEMENTS,
                                  bo.row_threads(args.row))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg["vocab"], (cfg["micro"], cfg["seq"]), generator=g).to(device)
               for _ in range(cfg["accum"])]
    for _ in range(args.warmup):
        bo.train_step(model, loss_fn, opt, batches, device)
    bo.synchronize(device)
    records = profile_chunks(opt)
    bo.train_step(model, loss_fn, opt, batches, device)
    bo.synchronize(device)
    print(f"diag_offload_chunks: {note}")
    for r in sorted(records, key=lambda r: r["index"]):
        r["ns_per_element"] = 1e9 * r["wall_s"] / max(1, r["elements"])
        print(f"  chunk {r['index']:3d}: {r['elements'] / 1e6:8.2f}M elements in {r['tensors']:4d} tensors, "
              f"{1e3 * r['wall_s']:8.2f} ms, {r['ns_per_element']:7.2f} ns an element")
    for r in sorted(records, key=lambda r: -r["ns_per_element"])[: args.top]:
        print(f"\nchunk {r['index']} ({r['tensors']} tensors, {1e3 * r['wall_s']:.2f} ms):\n{r['profile']}")
    opt.remove_hooks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
