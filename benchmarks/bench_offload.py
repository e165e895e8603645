"""The CPU-offloaded optimizer on the H200: optirs.torch.CPUOffload beside no offload
and beside torchao's CPUOffloadOptimizer, on one GPT-2 training step, in one run.

Rows (fresh model per row, same seed and batches; bf16 autocast; fp32 parameters unless the row
says bf16):

* ``none``: forward and backward only (no optimizer step), the floor;
* ``torch_fused``: ``torch.optim.AdamW(fused=True)`` on the device (the no-offload baseline);
* ``optirs_torch``: ``optirs.torch.AdamW`` on the device (backend cuda);
* ``none_bf16`` / ``torch_fused_bf16``: the same on the model in bfloat16 (the floor and the
  baseline of the bf16 offload rows);
* ``offload`` / ``offload_int8``: ``optirs.torch.CPUOffload("AdamW", accumulation_steps=accum)``
  with float32 / int8 state (CPU steps in ``step()``);
* ``offload_bf16_f32`` / ``offload_bf16_f32_fused``: bf16 parameters, float32 masters and state
  on the host, stepped apart (``fuse_conversions=False``, WIDEN) / in the formats step (FUSED, the
  default);
* ``offload_bf16_r16`` / ``offload_bf16_r16_int8`` / ``offload_bf16_r16_bf16`` /
  ``offload_bf16_r8_int8`` / ``offload_bf16_r8_bf16``: bf16 parameters, the host keeping only the
  master's bits under them (``master_weights="remainder16"`` / ``"remainder8"``), float32 / int8 /
  bfloat16 state: only bf16 gradients and bf16 parameters cross the bus;
* ``<offload row>_sib``: each offload row with ``step_in_backward=True`` (CPU steps start during
  the last backward);
* ``torchao``: ``torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True)`` (its row
  says why when torchao does not import).

A row's added time is over the no-offload row of its parameter dtype (``torch_fused`` or
``torch_fused_bf16``); every offload row's is also given as a ratio of torchao's (fp32 parameters).

Also measured in the same run: a parallel host copy (torch ``copy_`` of a big pinned tensor,
``torch.set_num_threads(os.cpu_count())``), pinned device-to-host / host-to-device copies, and the
per-chunk CPU work on the host (``--chunk-elements``: bf16 parameters stepped the old way, widen +
float32 step + narrow, against the fused formats step with float32 masters and with the remainder
masters of the rows; float32 and int8 state; numpy's and torch's copy of the same bytes beside). The offload rows are run again with
:class:`optirs.torch.offload.OffloadTiming` to split the time they add into CPU step,
conversions, transfers, waits (the gradient check in ``step()`` among them) and what overlapped. "GPU state" is the bytes of the optimizer's
state tensors that live on the GPU (each storage once); "GPU alloc delta" is
``torch.cuda.memory_allocated()`` after the steps (gradients freed) minus before the optimizer.

    python benchmarks/bench_offload.py --steps 3 --warmup 2 --split-steps 1 --chunk-elements 0 \
        --rows torch_fused,torchao,offload,offload_int8,torch_fused_bf16,offload_bf16_r8_int8 \
        --json h200-offload.json        # GPT-2 1.3B, 4x1024, accum 8 (docs/offload.md: the rows the goals need)
    python benchmarks/bench_offload.py --layers 2 --accum 2 --micro 1   # a small smoke run on the GPU
    python benchmarks/bench_offload.py --quick                          # tiny model on the CPU, every row
    python benchmarks/bench_offload.py --chunk-only                     # only the per-chunk CPU work
    python benchmarks/bench_offload.py --bandwidth-only                 # copies: pinned alone and beside a host copy
    python benchmarks/bench_offload.py --rows torch_fused,offload_sib@16,offload_sib@14,offload_sib@16,offload_sib@14
        # one row's cpu_threads after @, alternated in one process (a repeat keeps its own result as #2)

A row that fails (an exception anywhere in it, after minutes of steps) is a row that says FAILED
with the reason, printed as it comes; the other rows, what the failed row measured before it
failed, and the JSON (written after every row) are kept, and the exit status is 1.
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
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench_torch_step's plain-torch GPT-2 (when transformers is missing)
sys.path.insert(0, str(HERE.parent))  # this checkout's optirs, not another installed one

LR, DECAY = 1e-4, 0.1
# The offload's formats, row -> (parameter dtype, CPUOffload's format keywords). bf16 parameters:
# float32 masters and state step apart (WIDEN, fuse_conversions=False) or in the formats step (FUSED); the
# remainder masters keep on the host only the bits under the GPU's bf16 copy, so only bf16
# gradients and bf16 parameters cross the bus.
OFFLOAD_FORMATS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "offload": ("float32", {"state_dtype": "float32"}),
    "offload_int8": ("float32", {"state_dtype": "int8"}),
    "offload_bf16_f32": ("bfloat16", {"master_weights": "float32", "fuse_conversions": False}),
    "offload_bf16_f32_fused": ("bfloat16", {"master_weights": "float32", "fuse_conversions": True}),
    "offload_bf16_r16": ("bfloat16", {"master_weights": "remainder16"}),
    "offload_bf16_r16_int8": ("bfloat16", {"master_weights": "remainder16", "state_dtype": "int8"}),
    "offload_bf16_r16_bf16": ("bfloat16", {"master_weights": "remainder16", "state_dtype": "bfloat16"}),
    "offload_bf16_r8_bf16": ("bfloat16", {"master_weights": "remainder8", "state_dtype": "bfloat16"}),
    "offload_bf16_r8_int8": ("bfloat16", {"master_weights": "remainder8", "state_dtype": "int8"}),
    "offload_int8sqrt": ("float32", {"state_dtype": "int8_sqrt"}),
    "offload_bf16_r8_int8sqrt": ("bfloat16", {"master_weights": "remainder8", "state_dtype": "int8_sqrt"}),
    "offload_fp8": ("float32", {"state_dtype": "float8_e4m3fn"}),
    "offload_bf16_r8_fp8": ("bfloat16", {"master_weights": "remainder8", "state_dtype": "float8_e4m3fn"}),
}
# row -> (parameter dtype, format keywords, step_in_backward): each format at step() and, as
# "<row>_sib", with its CPU steps started in the last backward
OFFLOAD_ROWS: Dict[str, Tuple[str, Dict[str, Any], bool]] = {
    **{row: (dtype, kw, False) for row, (dtype, kw) in OFFLOAD_FORMATS.items()},
    **{f"{row}_sib": (dtype, kw, True) for row, (dtype, kw) in OFFLOAD_FORMATS.items()},
}
# the rows without offload on bf16 parameters: the floor and the baseline of the bf16 offload rows
BF16_SUFFIX = "_bf16"
ROWS = ("none", "torch_fused", "optirs_torch", "none_bf16", "torch_fused_bf16", *OFFLOAD_ROWS, "torchao")
# the added time of a row is over the no-offload step of the same parameter dtype
BASELINES = {"float32": "torch_fused", "bfloat16": "torch_fused_bf16"}


def row_kind(row: str) -> str:
    """The row's name without its thread count: ``offload_sib@14`` (and its repeats,
    ``offload_sib@14#2``) is an ``offload_sib`` row."""
    return row.partition("@")[0].partition("#")[0]


def row_threads(row: str) -> Optional[int]:
    """The cpu_threads a row names after ``@`` (``offload_int8_sib@14``), None where it names none."""
    _, at, rest = row.partition("@")
    return int(rest.partition("#")[0]) if at else None


def param_dtype(row: str) -> str:
    """The dtype of the row's model parameters ("float32" or "bfloat16")."""
    row = row_kind(row)
    if row in OFFLOAD_ROWS:
        return OFFLOAD_ROWS[row][0]
    return "bfloat16" if row.endswith(BF16_SUFFIX) else "float32"


# ------------------------------------------------------------------ the model


def build_model(cfg: Dict[str, int], device: str, dtype):
    """(model, loss(idx), source): transformers' GPT2LMHeadModel when importable, else the same shapes in torch."""
    import torch

    torch.manual_seed(0)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["seq"], n_embd=cfg["embd"],
                            n_layer=cfg["layers"], n_head=cfg["heads"])
        with torch.device(device):  # initialised where it runs: 1.3B parameters initialise in seconds on the GPU
            model = GPT2LMHeadModel(config)
        model = model.to(device=device, dtype=dtype)
        return model, (lambda idx: model(input_ids=idx, labels=idx).loss), "transformers.GPT2LMHeadModel"
    except ImportError:
        from bench_torch_step import TinyGPT2

        model = TinyGPT2.build(dict(cfg, positions=cfg["seq"])).to(device=device, dtype=dtype)
        return model, (lambda idx: model(idx, idx)), "plain-torch GPT-2 (GPT2LMHeadModel's shapes)"


def param_groups(model) -> List[Dict[str, Any]]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": DECAY}, {"params": rest, "weight_decay": 0.0}]


def make_optimizer(row: str, model, device: str, accum: int, bucket: int,
                   cpu_threads: Optional[int] = None) -> Tuple[Any, str]:
    """(optimizer or None, note); a row that cannot be built here raises RuntimeError with the reason."""
    import torch

    groups = param_groups(model)
    kind = row[: -len(BF16_SUFFIX)] if row.endswith(BF16_SUFFIX) else row  # the same optimizer on bf16 parameters
    if kind == "none":
        return None, "forward + backward only"
    if kind == "torch_fused":
        return torch.optim.AdamW(groups, lr=LR, fused=True), "torch.optim.AdamW(fused=True)"
    if row == "optirs_torch":
        import optirs.torch as ot

        backend = "cuda" if device == "cuda" else "cpu"
        return ot.AdamW(groups, lr=LR, backend=backend), f"optirs.torch.AdamW(backend={backend!r})"
    if row in OFFLOAD_ROWS:
        import optirs.torch as ot

        _, formats, sib = OFFLOAD_ROWS[row]
        opt = ot.CPUOffload("AdamW", groups, lr=LR, accumulation_steps=accum, step_in_backward=sib,
                            bucket_elements=bucket, cpu_threads=cpu_threads, **formats)
        modes = sorted({c.mode for c in getattr(opt, "_chunks", ())})  # direct, widen or fused: how the chunks step
        given = "".join(f"{k}={v!r}, " for k, v in formats.items())
        return opt, (f"optirs.torch.CPUOffload('AdamW', {given}accumulation_steps={accum}, "
                     f"step_in_backward={sib}, bucket_elements={bucket}, cpu_threads={cpu_threads}) on {param_dtype(row)} "
                     f"parameters, chunks {'/'.join(modes)}")
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


def bench_row(row: str, cfg: Dict[str, int], args, device: str, progress,
              out: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One row's measurements, written into ``out`` as they are made (a failure keeps them)."""
    import torch

    from optirs.torch.offload import OffloadTiming

    out = {} if out is None else out
    out["param_dtype"] = param_dtype(row)
    model, loss_fn, source = build_model(cfg, device, getattr(torch, out["param_dtype"]))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg["vocab"], (args.micro, cfg["seq"]), generator=g).to(device)
               for _ in range(args.accum)]
    synchronize(device)
    cuda = device == "cuda"
    before = torch.cuda.memory_allocated() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        threads = row_threads(row)
        opt, note = make_optimizer(row_kind(row), model, device, args.accum, args.bucket,
                                   args.cpu_threads if threads is None else threads)
    except RuntimeError as exc:
        out["skipped"] = str(exc)
        return out
    out.update(note=note, model=source)
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
        out["opt_state_gpu_bytes"] = state_bytes(opt, "cuda")
        out["gpu_alloc_delta_bytes"] = torch.cuda.memory_allocated() - before
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    out["opt_state_host_bytes"] = state_bytes(opt, "cpu")
    if row_kind(row) in OFFLOAD_ROWS:
        out["gradient_check"] = opt.gradient_check
        opt.timing = OffloadTiming(timeline=args.timeline)
        for _ in range(args.split_steps):
            train_step(model, loss_fn, opt, batches, device)
            synchronize(device)
            progress(row)
        out["timing"] = {k: v / args.split_steps for k, v in opt.timing.as_dict().items() if k != "steps"}
        if args.timeline:  # the last split step's chunks
            out["timeline"] = dict(summary=opt.timing.timeline_summary(), chunks=opt.timing.timeline_rows())
            print(f"bench_offload: {row}: {timeline_line(out['timeline']['summary'])}", flush=True)
        opt.timing = None
        opt.remove_hooks()
    out["parameters"] = sum(p.numel() for p in model.parameters())
    del opt, model, batches
    return out


def timeline_line(t: Dict[str, Any]) -> str:
    """One line of OffloadTiming.timeline_summary(): the chunks stepped in backward beside those after it."""
    parts = []
    for label in ("in_backward", "after"):
        d = t.get(label, {})
        text = f"{label.replace('_', ' ')} {d.get('chunks', 0)} chunks, {d.get('elements', 0) / 1e6:.1f}M elements"
        if "cpu_ns_per_element" in d:
            text += (f", CPU {d['cpu_ms']:.1f} ms ({d['cpu_ns_per_element']:.3f} ns an element, "
                     f"{d['cpu_GBps']:.1f} GB/s)")
        if "h2d_GBps" in d:
            text += f", copies back {d['h2d_GBps']:.1f} GB/s"
        parts.append(text)
    if "last_step_end_ms" in t:
        parts.append(f"CPU steps from {t['first_step_start_ms']:.1f} to {t['last_step_end_ms']:.1f} ms of step(), "
                     f"{t['idle_between_steps_ms']:.1f} ms of it with none running")
    return "; ".join(parts)


def state_bytes(opt, device_type: str) -> Optional[int]:
    """Bytes of the optimizer's state tensors on ``device_type``, each storage counted once (views
    of one flat buffer are one storage): the state itself, nothing else that was allocated. None
    where the optimizer shows no state to count (torchao 0.18's CPUOffloadOptimizer has no ``.state``)."""
    import torch

    if opt is None:
        return 0
    states = [opt.state] if isinstance(getattr(opt, "state", None), dict) else []
    inner = getattr(opt, "optim_dict", None)  # torchao's CPUOffloadOptimizer: one optimizer per parameter
    if isinstance(inner, dict):
        states += [o.state for o in inner.values() if isinstance(getattr(o, "state", None), dict)]
    if not states:
        return None
    storages: Dict[Tuple[int, int], int] = {}

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            if value.device.type == device_type:
                s = value.untyped_storage()
                storages[(s.data_ptr(), s.nbytes())] = s.nbytes()
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    for state in states:
        walk(dict(state))
    return sum(storages.values())


def chunk_cpu(n: int, reps: int) -> Dict[str, Any]:
    """One chunk's CPU work on the host, n elements, as the offload runs it (no device involved).

    ``bf16_before``: the earlier offload for bf16 parameters: widen the bf16 gradient to fp32,
    the fp32 AdamW step on fp32 masters, narrow the masters to the bf16 parameters (three passes).
    ``bf16_fused``: what a FUSED chunk runs now: the formats step over the bf16 host copy with
    float32 masters (one pass reads the bf16 gradient, updates masters and state, writes bf16).
    ``bf16_r16``, ``bf16_r8_int8``, ...: the same step with the remainder masters of the
    offload rows (FUSED chunks too). ``*_int8``: int8 state; ``fp32``: a DIRECT chunk; ``torch_fused_fp32``:
    torch.optim.AdamW(fused=True) on the same chunk (the peer's CPU step). Bytes: every array read once,
    parameters, masters and state also written (the conversions' passes added for ``before``)."""
    import numpy as np
    import torch

    import optirs.torch as ot

    torch.set_num_threads(os.cpu_count() or 1)

    def best(fn) -> Tuple[float, float]:
        fn()
        fn()  # compiled and warm
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times), statistics.median(times)

    def touched(opt, p) -> int:
        state = sum(v.numel() * v.element_size() for k, v in opt.state[p].items()
                    if k != "step" and isinstance(v, torch.Tensor))
        return p.grad.numel() * p.grad.element_size() + 2 * p.numel() * p.element_size() + 2 * state

    out: Dict[str, Any] = {"elements": n, "threads": torch.get_num_threads()}
    a, b = np.ones(n, np.float32), np.empty(n, np.float32)
    t, _ = best(lambda: np.copyto(b, a))
    out["numpy_copy_GBps"] = 2 * 4 * n / t / 1e9
    ta, tb = torch.ones(n), torch.empty(n)
    t, _ = best(lambda: tb.copy_(ta))
    out["torch_copy_GBps"] = 2 * 4 * n / t / 1e9
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=g).bfloat16()
    g16 = (torch.randn(n, generator=g) * 1e-2).bfloat16()
    cases: Dict[str, Dict[str, Any]] = {}

    # before: three passes over fp32 masters
    p16, m32, g32 = p0.clone(), p0.float(), torch.empty(n)
    m32.grad = g32
    opt = ot.AdamW([m32], lr=1e-3, backend="cpu")

    def before():
        g32.copy_(g16)
        opt.step()
        p16.copy_(m32)

    t, med = best(before)
    cases["bf16_before"] = {"ms": 1e3 * t, "median_ms": 1e3 * med, "bytes": touched(opt, m32) + 6 * n + 6 * n}
    ref = p16.clone()
    # the formats step over bf16 copies: float32 masters, then each remainder format of the rows
    fused = [("bf16_fused", {"master_weights": "float32"}),
             ("bf16_fused_int8", {"master_weights": "float32", "state_dtype": "int8"})]
    fused += [(row[len("offload_"):], kw) for row, (dtype, kw) in OFFLOAD_FORMATS.items()
              if dtype == "bfloat16" and str(kw.get("master_weights")).startswith("remainder")]
    for name, kw in fused:
        q = p0.clone()
        q.grad = g16
        o = ot.AdamW([q], lr=1e-3, backend="cpu", **kw)
        t, med = best(o.step)
        cases[name] = {"ms": 1e3 * t, "median_ms": 1e3 * med, "bytes": touched(o, q)}
        if name == "bf16_fused":  # the same steps from the same start: the same bf16 parameters
            cases[name]["equals_before"] = bool(torch.equal(q, ref))
    for name, kw in (("fp32", {}), ("fp32_int8", {"state_dtype": "int8"})):
        q = p0.float()
        q.grad = g16.float()
        o = ot.AdamW([q], lr=1e-3, backend="cpu", **kw)
        t, med = best(o.step)
        cases[name] = {"ms": 1e3 * t, "median_ms": 1e3 * med, "bytes": touched(o, q)}
    # the peer's CPU step, the same chunk: torchao's CPUOffloadOptimizer steps with torch's fused AdamW
    # on the host (a copy's destination costs a read for ownership that a step's in-place writes do
    # not, so the host copy can read below what a step reaches: this is the figure to compare with)
    q = p0.float()
    q.grad = g16.float()
    o = torch.optim.AdamW([q], lr=1e-3, fused=True)
    t, med = best(o.step)
    cases["torch_fused_fp32"] = {"ms": 1e3 * t, "median_ms": 1e3 * med, "bytes": touched(o, q)}
    for c in cases.values():
        c["bytes_per_param"] = c["bytes"] / n
        c["GBps"] = c["bytes"] / (c["ms"] / 1e3) / 1e9
        c["of_numpy_copy"] = c["GBps"] / out["numpy_copy_GBps"]
        c["of_torch_copy"] = c["GBps"] / out["torch_copy_GBps"]
    out["cases"] = cases
    return out


def chunk_lines(chunk: Dict[str, Any]) -> List[str]:
    lines = [f"per-chunk CPU work, {chunk['elements']} elements ({16 * chunk['elements'] / 2**30:.2f} GiB of float32 "
             f"p, g, m, v), {chunk['threads']} threads: numpy copy "
             f"{chunk['numpy_copy_GBps']:.1f} GB/s (one thread), torch copy {chunk['torch_copy_GBps']:.1f} GB/s"]
    for name, c in chunk["cases"].items():
        extra = f", equals before: {c['equals_before']}" if "equals_before" in c else ""
        lines.append(f"  {name}: {c['ms']:.2f} ms (median {c['median_ms']:.2f}), {c['bytes_per_param']:.2f} B/param, "
                     f"{c['GBps']:.1f} GB/s = {c['of_numpy_copy']:.2f}x numpy copy, "
                     f"{c['of_torch_copy']:.2f}x torch copy{extra}")
    return lines


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


def pinned_copy_under_load_gbps(nbytes: int, reps: int = 5) -> Dict[str, float]:
    """The pinned copies of :func:`pinned_copy_gbps` while every core runs a host copy of pageable
    memory (as a CPU step does): whether a transfer overlapped with a CPU step can reach the pinned
    bandwidth, or the two share the host's memory. Also the host copy's own rate meanwhile."""
    import threading

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    src = torch.ones(max(nbytes, 1 << 28) // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    stop, copied = threading.Event(), [0, 0.0]

    def load() -> None:
        t0 = time.perf_counter()
        while not stop.is_set():
            dst.copy_(src)  # torch releases the GIL while it copies
            copied[0] += 2 * src.numel() * 4
        copied[1] = time.perf_counter() - t0

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        time.sleep(0.2)
        out = pinned_copy_gbps(nbytes, reps)
    finally:
        stop.set()
        worker.join()
    out["host_copy_meanwhile"] = copied[0] / copied[1] / 1e9 if copied[1] else float("nan")
    return out


# ------------------------------------------------------------------ the report


def added_ms(name: str, rows: Dict[str, Any]) -> Optional[float]:
    """The row's step time over the no-offload baseline of its parameter dtype (torch_fused or
    torch_fused_bf16), None until both have a time."""
    base = rows.get(BASELINES[param_dtype(name)], {})
    r = rows.get(name, {})
    if "failed" in r or "failed" in base or "step_ms" not in r or "step_ms" not in base:
        return None
    return r["step_ms"] - base["step_ms"]


def analyse(results: Dict[str, Any]) -> Dict[str, Any]:
    """Per offload row: the time it adds over the no-offload baseline of its parameter dtype,
    split into what it spent (summed busy times) and what of that overlapped; ratios against
    torchao's added time (float32 parameters, the one figure every row is held to) and the
    bandwidths of this run."""
    rows, bw = results["rows"], results["bandwidth"]
    ok = {name: r for name, r in rows.items() if "failed" not in r}
    out: Dict[str, Any] = {}
    for name, r in ok.items():
        added = added_ms(name, rows)
        if added is not None:
            r["added_ms"] = added
    ao = ok.get("torchao", {}).get("added_ms")
    for name in [n for n in rows if row_kind(n) in OFFLOAD_ROWS]:
        r = ok.get(name, {})
        t = r.get("timing")
        if not t:
            continue
        ms = {k: 1e3 * t.get(k, 0.0) for k in ("cpu_step_s", "convert_s", "d2h_s", "h2d_s", "wait_d2h_s",
                                                "h2d_tail_s", "check_s", "step_call_s")}
        xfer_ms = ms["d2h_s"] + ms["h2d_s"]
        split = {"cpu_step_ms": ms["cpu_step_s"], "convert_ms": ms["convert_s"], "transfer_ms": xfer_ms,
                 "d2h_ms": ms["d2h_s"], "h2d_ms": ms["h2d_s"],
                 "waited_d2h_ms": ms["wait_d2h_s"],  # workers blocked on gradient copies not yet landed
                 "h2d_tail_ms": ms["h2d_tail_s"],  # copies back still landing after the last CPU step
                 # step()'s gradient check: fingerprints again, compared, and the wait for the device to reach step()
                 "check_ms": ms["check_s"],
                 "in_step_ms": ms["step_call_s"],  # the caller's wait inside step()
                 "early_chunks": t["early_chunks"],  # chunk steps started before step()
                 "step_bytes_per_param": t["step_bytes"] / r["parameters"],
                 "copied_bytes_per_param": (t["d2h_bytes"] + t["h2d_bytes"]) / r["parameters"]}
        split["added_over"] = BASELINES[param_dtype(name)]
        if "added_ms" in r:
            busy = ms["cpu_step_s"] + ms["convert_s"] + xfer_ms
            split["overlapped_ms"] = max(0.0, busy - r["added_ms"])
            if ao:
                split["added_vs_torchao"] = r["added_ms"] / ao
        if t["cpu_step_s"] > 0:
            split["cpu_step_GBps"] = t["step_bytes"] / t["cpu_step_s"] / 1e9
            if bw.get("host_copy_GBps"):
                split["cpu_step_of_host_copy"] = split["cpu_step_GBps"] / bw["host_copy_GBps"]
        pinned = bw.get("pinned_GBps") or {}
        for way in ("d2h", "h2d"):
            if t[f"{way}_s"] > 0:
                split[f"{way}_GBps"] = t[f"{way}_bytes"] / t[f"{way}_s"] / 1e9
                if way in pinned:
                    split[f"{way}_of_pinned"] = split[f"{way}_GBps"] / pinned[way]
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
    header = ["row", "params", "step ms", "added ms", "x torchao", "GPU state GB", "GPU alloc delta GB",
              "host state GB", "peak GPU GB"]
    vs_ao = lambda name: split.get(name, {}).get("added_vs_torchao")  # noqa: E731
    lines = []
    for name in results["rows_run"]:
        r = rows.get(name, {"failed": "not run (interrupted)"})
        if "failed" in r or "skipped" in r:
            lines.append([name, param_dtype(name), "FAILED" if "failed" in r else "skipped"] + [""] * (len(header) - 3))
            continue
        lines.append([name, param_dtype(name), f"{r['step_ms']:.1f}", f"{r.get('added_ms', float('nan')):.1f}",
                      "" if vs_ao(name) is None else f"{vs_ao(name):.2f}", gb(r.get("opt_state_gpu_bytes")), gb(r.get("gpu_alloc_delta_bytes")),
                      gb(r.get("opt_state_host_bytes")), gb(r.get("peak_gpu_bytes"))])
    what = [f"{name}: {row_note(rows.get(name, {'failed': 'not run (interrupted)'}))}" for name in results["rows_run"]]
    pinned = bw.get("pinned_GBps") or {}
    notes = what + [f"host copy {bw['host_copy_GBps']:.1f} GB/s (read + write, {os.cpu_count()} threads)",
             "pinned " + (", ".join(f"{k} {v:.1f} GB/s" for k, v in pinned.items()) or "n/a (no CUDA)")]
    for name, s in split.items():
        parts = [f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()]
        notes.append(f"{name}: " + ", ".join(parts))
    if results.get("chunk_cpu"):
        chunk = results["chunk_cpu"]
        notes += [f"per-chunk CPU work: FAILED: {chunk['failed']}"] if "failed" in chunk else chunk_lines(chunk)
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


def row_note(r: Dict[str, Any]) -> str:
    if "failed" in r:
        return f"FAILED: {r['failed']}"
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    return r.get("note", "")


def row_line(name: str, r: Dict[str, Any], rows: Optional[Dict[str, Any]] = None) -> str:
    """One row as soon as it is done (the table comes at the end); its added time where its
    baseline ran before it (``rows``: the rows so far)."""
    if "failed" in r or "skipped" in r:
        return f"bench_offload: {name} {row_note(r)}"
    gb = lambda b: "n/a" if b is None else f"{b / 1e9:.3f} GB"  # noqa: E731
    added = added_ms(name, rows or {name: r})
    base = BASELINES[param_dtype(name)]
    return (f"bench_offload: {name}: {r['step_ms']:.1f} ms/step"
            + (f" ({added:+.1f} ms over {base})" if added is not None and name != base else "")
            + f", state on the host {gb(r.get('opt_state_host_bytes'))}"
            + (f", on the GPU {gb(r.get('opt_state_gpu_bytes'))}" if "opt_state_gpu_bytes" in r else ""))


def failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def release_memory(device: str) -> None:
    """What a finished (or failed) row held, given back before the next row."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # torch keeps freed pinned blocks cached


def run_rows(rows: List[str], cfg: Dict[str, int], args, device: str, results: Dict[str, Any],
             progress, say) -> bool:
    """Every row in turn into ``results["rows"]``; a row that raises is a row saying FAILED (with
    what it measured before), said at once; the JSON is written after every row. Returns whether
    every row ran (a KeyboardInterrupt stops the rows, keeping those done)."""
    for row in rows:
        out: Dict[str, Any] = {}
        results["rows"][row] = out
        try:
            bench_row(row, cfg, args, device, progress, out)
        except KeyboardInterrupt:
            out["failed"] = "interrupted"
            say(row_line(row, out, results["rows"]))
            return False
        except Exception as exc:  # noqa: BLE001 - the row's reason; the other rows go on
            out["failed"] = failure(exc)
            out["traceback"] = traceback.format_exc(limit=8)
        release_memory(device)
        say(row_line(row, out, results["rows"]))
        write(results, args.json, quiet=True)
    return True


def unique_rows(rows: List[str]) -> List[str]:
    """The rows as given, a repeat numbered (``offload_sib@14#2``) so each keeps its own results:
    alternating thread counts in one process (``offload_sib@16,offload_sib@14,offload_sib@16``)."""
    seen: Dict[str, int] = {}
    out = []
    for r in rows:
        seen[r] = seen.get(r, 0) + 1
        out.append(r if seen[r] == 1 else f"{r}#{seen[r]}")
    return out


def with_baselines(rows: List[str]) -> Tuple[List[str], List[str]]:
    """(the rows with the no-offload baseline of each offload row's and torchao's parameter dtype put
    in front where ``rows`` lacks it, the baselines so added): an offload row's added time is its step
    over that baseline's, measured in the same run, and torchao's added time is what every offload
    row is held to (``x torchao``)."""
    present = {row_kind(r) for r in rows}
    added = []
    for r in rows:
        base = BASELINES[param_dtype(r)]
        if (row_kind(r) in OFFLOAD_ROWS or row_kind(r) == "torchao") and base not in present:
            present.add(base)
            added.append(base)
    return added + rows, added


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
    ap.add_argument("--timeline", action="store_true",
                    help="keep each chunk's times of the last split step (OffloadTiming(timeline=True)) in the JSON "
                         "and print the chunks stepped in backward beside those after it")
    ap.add_argument("--copy-mb", type=int, default=2048, help="size of the bandwidth probes")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"a subset of {','.join(ROWS)}")
    ap.add_argument("--bucket", type=int, default=None, help="CPUOffload's bucket_elements (default: its own)")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="CPUOffload's cpu_threads: numba threads of a chunk's step (default: numba's count); "
                         "one row's own as ROW@N in --rows (offload_sib@14)")
    ap.add_argument("--chunk-elements", type=int, default=1 << 27,
                    help="size of the per-chunk CPU measurement (0: skip it); its float32 arrays should exceed "
                         "the host's last-level cache many times over, or it measures the cache (the default: 2 GB)")
    ap.add_argument("--chunk-reps", type=int, default=5)
    ap.add_argument("--chunk-only", action="store_true", help="only the per-chunk CPU measurement (no device needed)")
    ap.add_argument("--bandwidth-only", action="store_true",
                    help="only the bandwidth probes: host copy, pinned copies alone and under a host copy on every core")
    ap.add_argument("--json", help="write the results here (a bare name goes to benchmarks/results/)")
    args = ap.parse_args(argv)
    import torch

    rows = unique_rows([r.strip() for r in args.rows.split(",") if r.strip()])
    unknown = [r for r in rows if row_kind(r) not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; expected some of {list(ROWS)}")
    bad = [r for r in rows if "@" in r and (row_kind(r) not in OFFLOAD_ROWS or not r.partition("@")[2].partition("#")[0].isdigit()
                                            or row_threads(r) < 1)]
    if bad:
        ap.error(f"rows {bad}: a thread count goes after an offload row as @N with N >= 1 (offload_sib@14)")
    rows, added = with_baselines(rows)
    if added:
        print(f"bench_offload: adding {', '.join(added)}: the baseline of the offload rows' added time")
    if args.bucket is None:
        from optirs.torch.offload import DEFAULT_BUCKET_ELEMENTS

        args.bucket = DEFAULT_BUCKET_ELEMENTS
    if args.quick:
        args.layers, args.embd, args.heads, args.vocab, args.seq = 2, 64, 2, 512, 32
        args.micro, args.accum, args.steps, args.warmup, args.split_steps, args.copy_mb = 2, 2, 3, 2, 1, 16
        args.chunk_elements, args.chunk_reps = min(args.chunk_elements, 1 << 16), 2
    if args.chunk_only:
        results = {"environment": environment(), "chunk_cpu": chunk_cpu(args.chunk_elements, args.chunk_reps)}
        for line in chunk_lines(results["chunk_cpu"]):
            print(line)
        write(results, args.json)
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.quick:
        print("bench_offload: needs a CUDA device (use --quick to check the script on the CPU)")
        return 2
    cfg = {k: getattr(args, k) for k in ("layers", "embd", "heads", "vocab", "seq", "micro", "accum")}
    results: Dict[str, Any] = {"environment": environment(), "config": cfg, "device": device, "rows_run": rows}
    nbytes = args.copy_mb << 20
    results["bandwidth"] = {"host_copy_GBps": host_copy_gbps(nbytes, pin=device == "cuda"),
                            "pinned_GBps": pinned_copy_gbps(nbytes) if device == "cuda" else None}
    if args.bandwidth_only:
        bw = results["bandwidth"]
        if device == "cuda":
            bw["pinned_under_host_copy_GBps"] = pinned_copy_under_load_gbps(nbytes)
        print(f"host copy {bw['host_copy_GBps']:.1f} GB/s (read + write, {os.cpu_count()} threads)")
        for key in ("pinned_GBps", "pinned_under_host_copy_GBps"):
            if bw.get(key):
                print(f"{key}: " + ", ".join(f"{k} {v:.1f}" for k, v in bw[key].items()))
        write(results, args.json)
        return 0
    total = len(rows) * (args.warmup + args.steps) + sum(row_kind(r) in OFFLOAD_ROWS for r in rows) * args.split_steps
    try:
        from rich.progress import Progress
    except ImportError:
        Progress = None  # type: ignore[assignment]
    results["rows"] = {}

    def say(line: str) -> None:  # plain print: rich's live bar redirects stdout above itself, unwrapped
        print(line, flush=True)

    if Progress is None:
        finished = run_rows(rows, cfg, args, device, results, lambda r: None, say)
    else:
        with Progress(transient=True) as bar:
            task = bar.add_task("steps", total=total)

            def progress(row: str) -> None:
                bar.update(task, description=row, advance=1)

            finished = run_rows(rows, cfg, args, device, results, progress, say)
    if args.chunk_elements and finished:
        try:
            results["chunk_cpu"] = chunk_cpu(args.chunk_elements, args.chunk_reps)
        except Exception as exc:  # noqa: BLE001 - the table above is kept
            results["chunk_cpu"] = {"failed": failure(exc)}
    results["analysis"] = analyse(results)
    report(results)
    write(results, args.json)
    if not finished:
        return 130
    return 1 if any("failed" in r for r in results["rows"].values()) else 0


def write(results: Dict[str, Any], where: Optional[str], quiet: bool = False) -> None:
    if where:
        path = Path(where)
        if path.parent == Path("."):
            path = HERE / "results" / path
        path.write_text(json.dumps(results, indent=2, default=str))
        if not quiet:
            print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
