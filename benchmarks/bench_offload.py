"""The CPU-offloaded optimizer on the H200 (issue 14): optirs.torch.CPUOffload beside no offload
and beside torchao's CPUOffloadOptimizer, on one GPT-2 training step, in one run.

Rows (fresh model per row, same seed and batches):

* ``none``: forward and backward only (no optimizer step), the floor;
* ``torch_fused``: ``torch.optim.AdamW(fused=True)`` on the device (the no-offload baseline);
* ``optirs_torch``: ``optirs.torch.AdamW`` on the device (backend cuda);
* ``offload``: ``optirs.torch.CPUOffload("AdamW", accumulation_steps=accum)`` (CPU steps in ``step()``);
* ``offload_sib``: the same with ``step_in_backward=True`` (CPU steps during the last backward);
* ``torchao``: ``torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True)`` (its row
  says why when torchao does not import).

Also measured in the same run: a parallel host copy (torch ``copy_`` of a big pinned tensor,
``torch.set_num_threads(os.cpu_count())``) and pinned device-to-host / host-to-device copies. The
offload rows are run again with :class:`optirs.torch.offload.OffloadTiming` to split the time they
add into CPU step, conversions, transfers and what overlapped. GPU memory for optimizer state is
``torch.cuda.memory_allocated()`` after the steps (gradients freed) minus before the optimizer.

    python benchmarks/bench_offload.py --json h200-offload.json        # GPT-2 1.3B, 4x1024, accum 8
    python benchmarks/bench_offload.py --layers 2 --accum 2 --micro 1   # a small smoke run on the GPU
    python benchmarks/bench_offload.py --quick                          # tiny model on the CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench_torch_step's plain-torch GPT-2 (when transformers is missing)

ADAMW_BYTES = 28  # the CPU step: p, g, m, v read; p, m, v written (float32)
LR, DECAY = 1e-4, 0.1
ROWS = ("none", "torch_fused", "optirs_torch", "offload", "offload_sib", "torchao")


# ------------------------------------------------------------------ the model


def build_model(cfg: Dict[str, int], device: str, dtype):
    """(model, loss(idx), source): transformers' GPT2LMHeadModel when importable, else the same shapes in torch."""
    import torch

    torch.manual_seed(0)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["seq"], n_embd=cfg["embd"],
                            n_layer=cfg["layers"], n_head=cfg["heads"])
        model = GPT2LMHeadModel(config).to(device=device, dtype=dtype)
        return model, (lambda idx: model(input_ids=idx, labels=idx).loss), "transformers.GPT2LMHeadModel"
    except ImportError:
        from bench_torch_step import TinyGPT2

        model = TinyGPT2.build(dict(cfg, positions=cfg["seq"])).to(device=device, dtype=dtype)
        return model, (lambda idx: model(idx, idx)), "plain-torch GPT-2 (GPT2LMHeadModel's shapes)"


def param_groups(model) -> List[Dict[str, Any]]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": DECAY}, {"params": rest, "weight_decay": 0.0}]


def make_optimizer(row: str, model, device: str, accum: int) -> Tuple[Any, str]:
    """(optimizer or None, note); a row that cannot be built here raises RuntimeError with the reason."""
    import torch

    groups = param_groups(model)
    if row == "none":
        return None, "forward + backward only"
    if row == "torch_fused":
        return torch.optim.AdamW(groups, lr=LR, fused=True), "torch.optim.AdamW(fused=True)"
    if row == "optirs_torch":
        import optirs.torch as ot

        backend = "cuda" if device == "cuda" else "cpu"
        return ot.AdamW(groups, lr=LR, backend=backend), f"optirs.torch.AdamW(backend={backend!r})"
    if row in ("offload", "offload_sib"):
        import optirs.torch as ot

        sib = row == "offload_sib"
        return (ot.CPUOffload("AdamW", groups, lr=LR, accumulation_steps=accum, step_in_backward=sib),
                f"optirs.torch.CPUOffload('AdamW', accumulation_steps={accum}, step_in_backward={sib})")
    if row == "torchao":
        try:
            from torchao.optim import CPUOffloadOptimizer
        except Exception as exc:  # noqa: BLE001 - any import failure is the row's reason
            raise RuntimeError(f"torchao does not import ({type(exc).__name__}: {exc})") from exc
        try:
            opt = CPUOffloadOptimizer(groups, torch.optim.AdamW, lr=LR, fused=True)
        except Exception as exc:  # noqa: BLE001 - e.g. its assertion that the device is CUDA or XPU
            reason = f"torchao's CPUOffloadOptimizer refused this setup ({type(exc).__name__}: {exc})"
            raise RuntimeError(reason) from exc
        return opt, "torchao.optim.CPUOffloadOptimizer(torch.optim.AdamW, fused=True)"
    raise ValueError(row)


# ------------------------------------------------------------------ timing


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def train_step(model, loss_fn, opt, batches, device: str) -> None:
    import torch

    for idx in batches:
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = loss_fn(idx) / len(batches)
        loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)


def bench_row(row: str, cfg: Dict[str, int], args, device: str, dtype, progress) -> Dict[str, Any]:
    import torch

    from optirs.torch.offload import OffloadTiming

    model, loss_fn, source = build_model(cfg, device, dtype)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg["vocab"], (args.micro, cfg["seq"]), generator=g).to(device)
               for _ in range(args.accum)]
    synchronize(device)
    cuda = device == "cuda"
    before = torch.cuda.memory_allocated() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        opt, note = make_optimizer(row, model, device, args.accum)
    except RuntimeError as exc:
        return {"skipped": str(exc)}
    out: Dict[str, Any] = {"note": note, "model": source}
    times = []
    for i in range(args.warmup + args.steps):
        synchronize(device)
        t0 = time.perf_counter()
        train_step(model, loss_fn, opt, batches, device)
        synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        progress(row)
    out["step_ms"] = 1e3 * statistics.median(times)
    out["step_ms_all"] = [1e3 * t for t in times]
    if cuda:
        out["opt_state_gpu_bytes"] = torch.cuda.memory_allocated() - before
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    if row.startswith("offload"):
        opt.timing = OffloadTiming()
        for _ in range(args.split_steps):
            train_step(model, loss_fn, opt, batches, device)
            synchronize(device)
            progress(row)
        out["timing"] = {k: v / args.split_steps for k, v in opt.timing.as_dict().items() if k != "steps"}
        opt.timing = None
        opt.remove_hooks()
    out["parameters"] = sum(p.numel() for p in model.parameters())
    del opt, model, batches
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # torch keeps freed pinned blocks cached
    return out


def host_copy_gbps(nbytes: int, pin: bool, reps: int = 5) -> float:
    """A parallel host copy (torch on every core): bytes read + written per second."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    src = torch.ones(nbytes // 4, dtype=torch.float32, pin_memory=pin)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times) / 1e9


def pinned_copy_gbps(nbytes: int, reps: int = 5) -> Dict[str, float]:
    """Pinned device-to-host and host-to-device bandwidth (torch copy_, CUDA events)."""
    import torch

    dev = torch.ones(nbytes // 4, device="cuda")
    host = torch.empty(nbytes // 4, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        best = float("inf")
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        out[name] = nbytes / best / 1e9
    return out


# ------------------------------------------------------------------ the report


def analyse(results: Dict[str, Any]) -> Dict[str, Any]:
    rows, bw = results["rows"], results["bandwidth"]
    base = rows.get("torch_fused", {}).get("step_ms")
    out: Dict[str, Any] = {}
    for name, r in rows.items():
        if "step_ms" in r and base is not None:
            r["added_ms"] = r["step_ms"] - base
    ao = rows.get("torchao", {}).get("added_ms")
    for name in ("offload", "offload_sib"):
        r = rows.get(name, {})
        t = r.get("timing")
        if not t:
            continue
        cpu_ms, conv_ms = 1e3 * t["cpu_step_s"], 1e3 * t["convert_s"]
        xfer_ms = 1e3 * (t["d2h_s"] + t["h2d_s"])
        split = {"cpu_step_ms": cpu_ms, "convert_ms": conv_ms, "transfer_ms": xfer_ms,
                 "waited_in_step_ms": 1e3 * t["step_call_s"]}
        if "added_ms" in r:
            split["overlapped_ms"] = max(0.0, cpu_ms + conv_ms + xfer_ms - r["added_ms"])
            if ao:
                split["added_vs_torchao"] = r["added_ms"] / ao
        if t["cpu_step_s"] > 0:
            split["cpu_step_GBps"] = ADAMW_BYTES * r["parameters"] / t["cpu_step_s"] / 1e9
            split["cpu_step_of_host_copy"] = split["cpu_step_GBps"] / bw["host_copy_GBps"]
        busy = t["d2h_s"] + t["h2d_s"]
        if busy > 0:
            split["transfer_GBps"] = (t["d2h_bytes"] + t["h2d_bytes"]) / busy / 1e9
            if bw.get("pinned_GBps"):
                split["transfer_of_pinned"] = split["transfer_GBps"] / min(bw["pinned_GBps"].values())
        out[name] = split
    return out


def report(results: Dict[str, Any]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = Table = None  # type: ignore[assignment]
    bw, rows, split = results["bandwidth"], results["rows"], results["analysis"]
    gb = lambda b: "" if b is None else f"{b / 1e9:.2f}"  # noqa: E731
    header = ["row", "step ms", "added ms", "opt state GPU GB", "peak GPU GB"]
    lines = []
    for name in results["rows_run"]:
        r = rows[name]
        if "skipped" in r:
            lines.append([name, "skipped", "", "", ""])
            continue
        lines.append([name, f"{r['step_ms']:.1f}", f"{r.get('added_ms', float('nan')):.1f}",
                      gb(r.get("opt_state_gpu_bytes")), gb(r.get("peak_gpu_bytes"))])
    what = [f"{name}: {rows[name].get('note') or 'skipped: ' + rows[name]['skipped']}" for name in results["rows_run"]]
    pinned = bw.get("pinned_GBps") or {}
    notes = what + [f"host copy {bw['host_copy_GBps']:.1f} GB/s (read + write, {os.cpu_count()} threads)",
             "pinned " + (", ".join(f"{k} {v:.1f} GB/s" for k, v in pinned.items()) or "n/a (no CUDA)")]
    for name, s in split.items():
        parts = [f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()]
        notes.append(f"{name}: " + ", ".join(parts))
    if Table is None:
        print(" | ".join(header))
        for line in lines:
            print(" | ".join(line))
        print("\n".join(notes))
        return
    table = Table(title=f"one training step: {results['config']}")
    for h in header:
        table.add_column(h)
    for line in lines:
        table.add_row(*line)
    console = Console(width=max(120, Console().width))
    console.print(table)
    for n in notes:
        console.print(n)


def environment() -> Dict[str, Any]:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()}
    for mod in ("numpy", "numba", "optirs", "transformers", "torchao"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = None
    return env


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model on the CPU (seconds): checks the script")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4, help="micro-batch size")
    ap.add_argument("--accum", type=int, default=8, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row (the median is reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--split-steps", type=int, default=2, help="steps with OffloadTiming for the split")
    ap.add_argument("--copy-mb", type=int, default=2048, help="size of the bandwidth probes")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"a subset of {','.join(ROWS)}")
    ap.add_argument("--json", help="write the results here (a bare name goes to benchmarks/results/)")
    args = ap.parse_args(argv)
    import torch

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; expected some of {list(ROWS)}")
    if args.quick:
        args.layers, args.embd, args.heads, args.vocab, args.seq = 2, 64, 2, 512, 32
        args.micro, args.accum, args.steps, args.warmup, args.split_steps, args.copy_mb = 2, 2, 3, 2, 1, 16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.quick:
        print("bench_offload: needs a CUDA device (use --quick to check the script on the CPU)")
        return 2
    cfg = {k: getattr(args, k) for k in ("layers", "embd", "heads", "vocab", "seq", "micro", "accum")}
    results: Dict[str, Any] = {"environment": environment(), "config": cfg, "device": device, "rows_run": rows}
    nbytes = args.copy_mb << 20
    results["bandwidth"] = {"host_copy_GBps": host_copy_gbps(nbytes, pin=device == "cuda"),
                            "pinned_GBps": pinned_copy_gbps(nbytes) if device == "cuda" else None}
    total = len(rows) * (args.warmup + args.steps) + 2 * args.split_steps
    try:
        from rich.progress import Progress
    except ImportError:
        Progress = None  # type: ignore[assignment]
    results["rows"] = {}
    if Progress is None:
        for row in rows:
            print(f"bench_offload: {row} ...", flush=True)
            results["rows"][row] = bench_row(row, cfg, args, device, torch.float32, lambda r: None)
    else:
        with Progress(transient=True) as bar:
            task = bar.add_task("steps", total=total)
            for row in rows:
                bar.update(task, description=row)
                results["rows"][row] = bench_row(row, cfg, args, device, torch.float32,
                                                 lambda r: bar.advance(task))
    results["analysis"] = analyse(results)
    report(results)
    if args.json:
        path = Path(args.json)
        if path.parent == Path("."):
            path = HERE / "results" / path
        path.write_text(json.dumps(results, indent=2))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
