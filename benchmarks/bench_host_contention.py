"""Pinned copies and the host's cores on one memory: how much of each is left when both run.

CPUOffload's CPU step streams the host's memory on every core while the gradients' copies land
in it and the new parameters' copies read from it. This measures, on one machine in one run:
a parallel host copy alone (numba ``prange``, the CPU steps' threads), pinned device-to-host and
host-to-device copies alone and both at once, then each copy while the host copy runs on every
core (and the host copy's rate meanwhile). The ratios say whether "transfers at the pinned rate"
and "the CPU step at the host copy's rate" can hold at the same time.

    python benchmarks/bench_host_contention.py --json contention.json
    python benchmarks/bench_host_contention.py --mib 512 --host-mib 2048 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu_formats import host_copy_kernel  # noqa: E402  (the format loops' reference copy)


class HostLoad:
    """The host copy on every numba thread, over and over in a thread of its own, counting bytes."""

    def __init__(self, mib: int):
        import numpy as np

        words = mib * (1 << 20) // 8
        self.src, self.dst = np.ones(words, np.uint64), np.zeros(words, np.uint64)
        self.copy = host_copy_kernel()
        self.copy(self.src, self.dst, 1 << 15)  # compile and touch
        self.stop, self.bytes, self.seconds = threading.Event(), 0, 0.0
        self.thread: Optional[threading.Thread] = None

    def once(self) -> float:
        """One copy's GB/s (read + write)."""
        t0 = time.perf_counter()
        self.copy(self.src, self.dst, 1 << 15)
        return 2 * self.src.nbytes / (time.perf_counter() - t0) / 1e9

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop.is_set():
            self.copy(self.src, self.dst, 1 << 15)
            self.bytes += 2 * self.src.nbytes
        self.seconds = time.perf_counter() - t0

    def __enter__(self) -> "HostLoad":
        self.stop.clear()
        self.bytes, self.seconds = 0, 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        time.sleep(0.2)  # the threads running before the copies start
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()

    def rate(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else float("nan")


def _copies(torch, pairs, repeats: int) -> List[float]:
    """GB/s of each direction's copies, all directions at once (each on its own stream), median of repeats."""
    streams = [torch.cuda.Stream() for _ in pairs]
    rates: List[List[float]] = [[] for _ in pairs]
    for _ in range(repeats):
        events = []
        for (dst, src), s in zip(pairs, streams):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                start.record(s)
                dst.copy_(src, non_blocking=True)
                end.record(s)
            events.append((start, end, src.numel() * src.element_size()))
        torch.cuda.synchronize()
        for k, (start, end, nbytes) in enumerate(events):
            rates[k].append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return [statistics.median(r) for r in rates]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="MiB each copy moves (default 1024)")
    ap.add_argument("--host-mib", type=int, default=2048, help="MiB the host copy moves each pass (default 2048)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    for name in ("mib", "host_mib", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}, expected an int >= 1")
    try:
        import torch
    except ImportError:
        print("bench_host_contention: needs torch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_host_contention: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    import numba

    n = args.mib * (1 << 20) // 4
    pinned_out = torch.empty(n, dtype=torch.float32, pin_memory=True)
    pinned_in = torch.ones(n, dtype=torch.float32, pin_memory=True)
    dev_src = torch.ones(n, dtype=torch.float32, device="cuda")
    dev_dst = torch.empty(n, dtype=torch.float32, device="cuda")
    d2h, h2d = (pinned_out, dev_src), (dev_dst, pinned_in)
    load = HostLoad(args.host_mib)
    print(f"bench_host_contention: {torch.cuda.get_device_name()}, {os.cpu_count()} cpus, "
          f"{numba.get_num_threads()} numba threads; copies of {args.mib} MiB, host copy of {args.host_mib} MiB",
          flush=True)
    r: Dict[str, float] = {}
    r["host_copy_alone"] = statistics.median(load.once() for _ in range(args.repeats))
    r["d2h_alone"], = _copies(torch, [d2h], args.repeats)
    r["h2d_alone"], = _copies(torch, [h2d], args.repeats)
    r["d2h_both"], r["h2d_both"] = _copies(torch, [d2h, h2d], args.repeats)
    print(f"alone: host copy {r['host_copy_alone']:.1f} GB/s, d2h {r['d2h_alone']:.1f}, h2d {r['h2d_alone']:.1f}; "
          f"both directions at once: d2h {r['d2h_both']:.1f}, h2d {r['h2d_both']:.1f} GB/s", flush=True)
    for label, pairs, keys in (("d2h", [d2h], ["d2h_loaded"]), ("h2d", [h2d], ["h2d_loaded"]),
                               ("both", [d2h, h2d], ["d2h_both_loaded", "h2d_both_loaded"])):
        with load:
            rates = _copies(torch, pairs, args.repeats)
        r.update(zip(keys, rates))
        r[f"host_copy_during_{label}"] = load.rate()
        shown = ", ".join(f"{k.split('_')[0]} {v:.1f} GB/s ({v / r[k.split('_')[0] + '_alone']:.2f} of alone)"
                          for k, v in zip(keys, rates))
        print(f"while the host copy runs: {shown}; the host copy meanwhile "
              f"{load.rate():.1f} GB/s ({load.rate() / r['host_copy_alone']:.2f} of alone)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), cpus=os.cpu_count(),
                           threads=numba.get_num_threads(), mib=args.mib, host_mib=args.host_mib,
                           torch=torch.__version__, numba=numba.__version__, gbps=r), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
