"""CPUOffload's gradient check: one round of fingerprints over a model's gradients, by the
``fingerprint`` capability of the optirs backend serving the device against torch's two reductions
(the int64 sum of the bit words and argmax), in one run, each beside the limit: reading the
gradients once at the device's copy bandwidth.

    python benchmarks/bench_fingerprint.py --json fingerprint.json      # GPT-2 1.3B's 292 gradients, CUDA
    python benchmarks/bench_fingerprint.py --device cpu --quick         # the script on the CPU (seconds)

A round is what ``step()`` queues (every gradient into its row of one table, then the comparison is
read back; "one a call" takes the same round by one request a gradient, as the hooks in backward
do); its host time is the Python that queues it, its total time includes the wait for the
device, and on CUDA its device time is measured with the launches queued behind a sleep (no host
gaps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_formats import gpt_shapes  # noqa: E402  (GPT2LMHeadModel's parameter shapes)


def copy_gbps(torch: Any, device: str, nbytes: int) -> float:
    """The device's copy bandwidth (bytes read + written a second), best of five."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(6):
        sync(torch, device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(torch, device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rounds(torch: Any, device: str) -> Dict[str, Callable[[List[Any], Any], None]]:
    """The ways to take a round: name -> fn(grads, table)."""
    from optirs.torch import offload

    out: Dict[str, Callable[[List[Any], Any], None]] = {}

    def by_torch(grads: List[Any], table: Any) -> None:
        for k, g in enumerate(grads):
            offload._fingerprint(g, table[k])

    out["torch"] = by_torch
    found = offload._fingerprint_backend(torch.device(device))  # the offload's own choice and probe
    if not found:
        print(f"bench_fingerprint: no optirs backend with the fingerprint capability serves {device!r} tensors")
        return out
    backend, hook = found

    def by_capability(grads: List[Any], table: Any) -> None:
        hook(backend.ctx, [offload._gradient_words(g) for g in grads], offload._words(table), list(range(len(grads))))

    def by_capability_each(grads: List[Any], table: Any) -> None:
        words = offload._words(table)
        for k, g in enumerate(grads):
            hook(backend.ctx, [offload._gradient_words(g)], words, [k])

    out[f"capability ({backend.name})"] = by_capability  # step()'s check: one request for every gradient
    out[f"one a call ({backend.name})"] = by_capability_each  # the hooks' form: one request a gradient
    return out


def time_round(torch: Any, device: str, fn: Callable, grads: List[Any], table: Any, repeats: int) -> Dict[str, float]:
    host, total = [], []
    differ = torch.zeros(len(grads), dtype=torch.bool, device=device)
    for r in range(repeats + 2):
        sync(torch, device)
        t0 = time.perf_counter()
        fn(grads, table)
        t1 = time.perf_counter()
        differ.copy_(table.ne(0).any(1))
        differ.cpu()  # the read back step() makes
        t2 = time.perf_counter()
        if r >= 2:
            host.append(t1 - t0)
            total.append(t2 - t0)
    row = {"host_ms": 1e3 * statistics.median(host), "total_ms": 1e3 * statistics.median(total)}
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(5e7))  # the launches queue behind it: device time without host gaps
            start.record()
            fn(grads, table)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        row["device_ms"] = statistics.median(times)
    return row


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="gradient dtypes: float32, bfloat16, float16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="a tiny model (seconds): checks the script")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.device not in ("cuda", "cpu"):
        ap.error(f"--device {args.device!r}: expected cuda or cpu")
    if args.layers < 1 or args.embd < 1 or args.repeats < 1:
        ap.error(f"--layers {args.layers}, --embd {args.embd}, --repeats {args.repeats}: expected positive numbers")
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    asked = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in asked if d not in dtypes]
    if bad or not asked:
        ap.error(f"--dtypes {args.dtypes!r}: expected some of {sorted(dtypes)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_fingerprint: --device cuda needs a CUDA device (--device cpu runs on the host)")
        return 2
    if args.quick:
        args.layers, args.embd, args.repeats = 1, 64, 2
    shapes = gpt_shapes(512 if args.quick else 50257, 64 if args.quick else 1024, args.embd, args.layers)
    ways = rounds(torch, args.device)
    gbps = copy_gbps(torch, args.device, (16 if args.quick else 1024) << 20)
    print(f"bench_fingerprint: {len(shapes)} gradients, {sum(map(math.prod, shapes)) / 1e6:.1f}M elements on "
          f"{args.device}; copy {gbps:.1f} GB/s", flush=True)
    results: Dict[str, Any] = {"device": args.device, "copy_GBps": gbps, "tensors": len(shapes), "rows": {}}
    for name in asked:
        dtype = dtypes[name]
        grads = [torch.randn(s, device=args.device).to(dtype) for s in shapes]
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        limit_ms = 1e3 * nbytes / (gbps * 1e9)  # the gradients read once at the copy's rate
        table = torch.zeros((len(grads), 2), dtype=torch.int64, device=args.device)
        for way, fn in ways.items():
            row = time_round(torch, args.device, fn, grads, table, args.repeats)
            row["limit_ms"] = limit_ms
            taken = row.get("device_ms", row["total_ms"])
            row["of_limit"] = limit_ms / taken if taken > 0 else None
            results["rows"][f"{name} {way}"] = row
            dev = f", device {row['device_ms']:.2f} ms" if "device_ms" in row else ""
            print(f"bench_fingerprint: {name:9s} {way:22s} host {row['host_ms']:7.2f} ms, total "
                  f"{row['total_ms']:7.2f} ms{dev} ({row['of_limit']:.2f} of reading them once at the copy's "
                  f"rate, {limit_ms:.2f} ms)", flush=True)
        for way in [w for w in ways if w != "torch"]:
            a, b = results["rows"][f"{name} torch"], results["rows"][f"{name} {way}"]
            key = "device_ms" if "device_ms" in a else "total_ms"
            print(f"bench_fingerprint: {name:9s} {way} against torch: {a[key] / b[key]:.2f}x ({key})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
