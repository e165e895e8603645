"""AdamW (or another family with formats) in every step format beside the peers, in one run, on one backend.

Through the public API only: ``optirs.torch.AdamW(..., master_weights=, state_dtype=,
stochastic_rounding=, backend=)`` on torch tensors (``--backend cuda``: CUDA tensors; ``cpu``:
CPU tensors), or ``GpuAdamW(..., precision=Precision(...))`` on pyopencl arrays (``--backend
opencl``). Shapes: GPT-2 124M (148 tensors; the test suite checks them against transformers'
model) on a GPU, a 14M-parameter GPT (vocab 8192, width 384, 6 layers) on the cpu backend, tiny
ones with ``--smoke``; ``--model 1.3b``: GPT-2 1.3B (``GPT2Config(n_embd=2048, n_layer=24)``, 292
tensors); ``--flat``: the same count of parameters as one tensor, ``--split N`` as N equal
tensors, ``--min-size`` without the small tensors, ``--misalign K`` behind a tensor of K elements,
``--one-buffer`` with each tensor's parameters and gradients views of one allocation (what the
tensor mix, the state's alignment and the allocations cost).
AdamW lr 1e-3, weight decay 0.1 on every tensor; ``--family`` sgd (momentum 0.9), rmsprop, adagrad,
lion or lamb (max_grad_norm 1.0) in the same formats, with torch's own optimizer (fused where torch
has it, else foreach) and bitsandbytes' 8-bit one as the peers.

For each row: ms per step (back-to-back steps after warm-up, synchronized at the ends; the
median of batches), the kernels' own time per step on CUDA (torch's profiler: the device time
without the host's part) and on OpenCL (the steps queued behind a user event, then run back to
back: the device's time without the host's), the format's own bytes per parameter (each array read and written once, the
gradient read), GB/s, its ratio to the copy bandwidth measured in the same run (torch ``copy_`` on
CUDA, numpy ``copyto`` on the host, a buffer copy on OpenCL), its speed relative to the fastest
peer (best peer ms / ms: above 1 is faster), and the state bytes per parameter as allocated
(masters + optimizer state). Peers where they import, on the same device: torch
AdamW(fused=True) in float32 and on bfloat16 parameters, bitsandbytes AdamW8bit, torchao
AdamW8bit / AdamW4bit / AdamWFp8, FlashOptim FlashAdamW (OpenCL: the torch CUDA peers when CUDA is there).

    python benchmarks/bench_formats.py --backend cuda --json h200-formats.json
    python benchmarks/bench_formats.py --backend opencl --json h200-opencl-formats.json
    python benchmarks/bench_formats.py --backend cuda --model 1.3b --only "int8 sqrt;float8;fused"
    python benchmarks/bench_formats.py --backend cpu
    python benchmarks/bench_formats.py --backend cpu --smoke   # seconds; skips cleanly without the device
    python benchmarks/bench_formats.py --family lamb --only "int8 sqrt;bf16 state"
    python benchmarks/bench_formats.py --compare h200-formats.json h200-opencl-formats.json  # per format
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from bench_cpu_formats import bytes_per_param  # the bytes a format's step moves, counted once

LR, BETAS, EPS, DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.1

# (label, param dtype, master, state dtype, stochastic rounding)
FORMATS = [
    ("fp32 params, fp32 state (the ordinary step)", "float32", None, "float32", False),
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
    ("bf16 params, remainder8, int8 sqrt state", "bfloat16", "remainder8", "int8_sqrt", False),
    ("bf16 params, stochastic rounding, int8 sqrt state", "bfloat16", None, "int8_sqrt", True),
    ("fp32 params, int8 sqrt state", "float32", None, "int8_sqrt", False),
    ("bf16 params, remainder8, float8 state", "bfloat16", "remainder8", "float8_e4m3fn", False),
    ("bf16 params, stochastic rounding, float8 state", "bfloat16", None, "float8_e4m3fn", True),
    ("fp32 params, float8 state", "float32", None, "float8_e4m3fn", False),
]


def gpt_shapes(vocab: int, pos: int, d: int, layers: int) -> List[Tuple[int, ...]]:
    shapes: List[Tuple[int, ...]] = [(vocab, d), (pos, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


MODELS = {"124m": (768, 12), "1.3b": (2048, 24)}  # GPT-2 width and layers (1.3B: GPT2Config(n_embd=2048, n_layer=24))


def gpt2_shapes(model: str) -> List[Tuple[int, ...]]:
    """GPT-2's parameter shapes (vocabulary 50257, 1024 positions) of ``model``, a key of MODELS."""
    return gpt_shapes(50257, 1024, *MODELS[model])


def model_shapes(backend: str, smoke: bool, model: Optional[str] = None) -> List[Tuple[int, ...]]:
    if smoke:
        return [(64, 96), (96,), (5000,), (33,)]
    if backend == "cpu" and model is None:
        return gpt_shapes(8192, 512, 384, 6)
    return gpt2_shapes(model or "124m")


def variant_shapes(shapes, flat: bool = False, split: Optional[int] = None, min_size: int = 0,
                   misalign: int = 0, split_align: int = 256) -> List[Tuple[int, ...]]:
    """``shapes`` as ``--flat``, ``--split``, ``--min-size`` and ``--misalign`` remake them (the same
    count of parameters as one tensor or as ``split`` equal ones, a multiple of ``split_align`` each
    but the last; without the tensors under ``min_size``; behind a tensor of ``misalign`` elements)."""
    n = sum(math.prod(s) for s in shapes)
    if flat:
        shapes = [(n,)]
    elif split is not None:
        if split_align < 1 or not 1 <= split <= n // split_align:
            raise SystemExit(f"--split {split} --split-align {split_align}: expected 1 to {n // max(split_align, 1)} "
                             "tensors of a multiple of at least 1 element")
        part = n // split // split_align * split_align
        shapes = [(part,)] * (split - 1) + [(n - (split - 1) * part,)]
    if min_size < 0 or misalign < 0:
        raise SystemExit(f"--min-size {min_size} / --misalign {misalign}: expected counts >= 0")
    shapes = [s for s in shapes if math.prod(s) >= min_size]
    return [(misalign,)] + shapes if misalign else shapes


class Family(NamedTuple):
    """One family's rows: optirs.torch's class and the seed API's (``Gpu*`` and its hyperparameters)
    with the same settings, its state slots, and torch's own optimizer for the peers (None: none)."""

    torch_name: str
    gpu_name: str
    params_name: str
    kwargs: Dict[str, Any]
    slots: int
    torch_peer: Optional[str]
    bnb_peer: Optional[str]


FAMILIES = {
    "adamw": Family("AdamW", "GpuAdamW", "AdamParams", dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY), 2,
                    "AdamW", "AdamW8bit"),
    "sgd": Family("SGD", "GpuSgd", "SgdParams", dict(lr=1e-2, momentum=0.9, weight_decay=DECAY), 1, "SGD", "SGD8bit"),
    "rmsprop": Family("RMSprop", "GpuRmsprop", "RmspropParams", dict(lr=1e-3, alpha=0.99, eps=EPS), 1, "RMSprop",
                      "RMSprop8bit"),
    "adagrad": Family("Adagrad", "GpuAdagrad", "AdagradParams", dict(lr=1e-2), 1, "Adagrad", "Adagrad8bit"),
    "lion": Family("Lion", "GpuLion", "LionParams", dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=DECAY), 1, None,
                   "Lion8bit"),
    "lamb": Family("Lamb", "GpuLamb", "LambParams", dict(lr=LR, betas=BETAS, eps=1e-6, weight_decay=0.01,
                                                         max_grad_norm=1.0), 2, None, "LAMB8bit"),
}


def seed_hyperparameters(family: str) -> Any:
    """The family's settings as the seed API's hyperparameters (``betas`` as beta1 and beta2)."""
    import optirs

    f = FAMILIES[family]
    kw = dict(f.kwargs)
    if "betas" in kw:
        kw["beta1"], kw["beta2"] = kw.pop("betas")
    return getattr(optirs, f.params_name)(**kw)


def format_bytes(pdt: str, master: Optional[str], state: str, family: str = "adamw") -> float:
    """Bytes per parameter one step moves (:func:`bench_cpu_formats.bytes_per_param`: gradients in
    the parameters' dtype; LAMB with its gradient norm, max_grad_norm being set)."""
    return bytes_per_param(pdt, pdt, master, state, FAMILIES[family].slots, family, clips=family == "lamb")


def error_text(exc: BaseException) -> str:
    """A failed row's error for the JSON, whole (an out-of-memory error says what holds the memory
    past its first 200 characters); the printed line and table take its start."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:2000]}"


def timed(sync: Callable[[], None], fn: Callable[[], None], steps: int, batches: int) -> float:
    """Median ms per call over ``batches`` batches of ``steps`` back-to-back calls (after warm-up)."""
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(times)


def nbytes(value: Any) -> int:
    """Bytes of a state entry: tensors, numpy / device arrays, nested dicts and lists; scalars count 0."""
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    if hasattr(value, "__tensor_flatten__"):  # torchao's quantized subclasses
        names, _ = value.__tensor_flatten__()
        return sum(nbytes(getattr(value, a)) for a in names)
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.numel()) * int(value.element_size()) if value.numel() > 1 else 0
    if hasattr(value, "nbytes") and hasattr(value, "size"):
        return int(value.nbytes) if int(value.size) > 1 else 0
    return 0


# ---------------------------------------------------------------- the backends


class Device:
    """What one backend's rows need: the copy bandwidth, a sync, optirs's step per format."""

    name = ""

    def copy_gb_per_s(self, n: int, steps: int, batches: int) -> float:
        raise NotImplementedError

    def sync(self) -> None:
        pass

    def optirs_row(self, shapes, spec, steps: int, batches: int, family: str = "adamw") -> Dict[str, Any]:
        raise NotImplementedError


class TorchDevice(Device):
    """cuda (CUDA tensors) or cpu (CPU tensors) through optirs.torch.AdamW."""

    def __init__(self, torch: Any, backend: str):
        self.torch, self.backend = torch, backend
        self.device = "cuda" if backend == "cuda" else "cpu"
        self.name = torch.cuda.get_device_name() if backend == "cuda" else "host CPU"

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def copy_gb_per_s(self, n: int, steps: int, batches: int) -> float:
        torch = self.torch
        src = torch.ones(n, device=self.device)
        dst = torch.empty_like(src)
        ms = timed(self.sync, lambda: dst.copy_(src), steps, batches)
        return 2 * 4 * n / (ms * 1e-3) / 1e9

    def kernel_ms(self, fn: Callable[[], None], steps: int) -> Optional[float]:
        """The device time of one call's kernels (and copies), from torch's profiler over ``steps``
        calls: the kernel alone, without the host's part. None on the host, or where the profiler
        cannot tell."""
        if self.device != "cuda":
            return None
        try:
            from torch.profiler import ProfilerActivity, profile

            self.sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    fn()
                self.sync()
            cuda = self.torch.autograd.DeviceType.CUDA
            total = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == cuda)
            return total / 1e3 / steps if total > 0 else None
        except Exception as exc:  # an old profiler or no CUPTI: the end-to-end time still stands
            print(f"# kernel time not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None

    # the parameters and gradients as views of one allocation each (--one-buffer), as a flat-parameter
    # wrapper lays them out, instead of an allocation per tensor
    one_buffer = False

    def tensors(self, shapes, dtype) -> List[Any]:
        torch = self.torch
        if self.one_buffer:
            sizes = [math.prod(s) for s in shapes]
            flat_p = (torch.randn(sum(sizes), device=self.device) * 0.02).to(dtype)
            flat_g = (torch.randn(sum(sizes), device=self.device) * 1e-3).to(dtype)
            params, at = [], 0
            for s, k in zip(shapes, sizes):
                p = torch.nn.Parameter(flat_p[at:at + k].view(s))
                p.grad = flat_g[at:at + k].view(s)
                params.append(p)
                at += k
            return params
        params = [torch.nn.Parameter(torch.randn(s, device=self.device).to(dtype) * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        return params

    def optirs_row(self, shapes, spec, steps: int, batches: int, family: str = "adamw") -> Dict[str, Any]:
        import optirs.torch as ot

        label, pdt, master, state_dtype, sr = spec
        torch = self.torch
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[pdt]
        params = self.tensors(shapes, dtype)
        opt = getattr(ot, FAMILIES[family].torch_name)(params, **FAMILIES[family].kwargs,
                                                       master_weights=master if pdt != "float32" else None,
                                                       state_dtype=state_dtype, stochastic_rounding=sr, seed=1234,
                                                       backend=self.backend)
        ms = timed(self.sync, opt.step, steps, batches)
        kms = self.kernel_ms(opt.step, steps)
        n = sum(p.numel() for p in params)
        return {"label": f"optirs {label}", "ms": ms, "kernel_ms": kms,
                "bytes_per_param": format_bytes(pdt, master, state_dtype, family),
                "state_bytes_per_param": nbytes(opt.state_dict()["state"]) / n}


class OpenclDevice(Device):
    """opencl: pyopencl arrays (bfloat16 / float16 arrays of the ml_dtypes / numpy dtypes) through GpuAdamW."""

    def __init__(self):
        import optirs

        self.b = optirs.get_backend("opencl")
        self.ctx = self.b.ctx
        self.name = f"{self.ctx.device.name.strip()} ({self.ctx.device.max_compute_units} compute units)"

    def sync(self) -> None:
        self.ctx.queue.finish()

    def copy_gb_per_s(self, n: int, steps: int, batches: int) -> float:
        import numpy as np
        import pyopencl as cl
        import pyopencl.array as cla

        src = cla.to_device(self.ctx.queue, np.ones(n, np.float32))
        dst = cla.empty_like(src)
        ms = timed(self.sync, lambda: cl.enqueue_copy(self.ctx.queue, dst.data, src.data), steps, batches)
        return 2 * 4 * n / (ms * 1e-3) / 1e9

    def kernel_ms(self, fn: Callable[[], None], steps: int, batches: int) -> Optional[float]:
        """The device's time per call with the host out of the way: the queue waits on a user
        event while ``steps`` calls are queued, then runs them back to back (the median of
        ``batches``). None when a call waited on the queue itself (a watchdog then opens it)."""
        import threading

        import pyopencl as cl

        q, lock = self.ctx.queue, threading.Lock()
        times = []
        for _ in range(batches):
            q.finish()
            gate = cl.UserEvent(self.ctx.context)
            opened = []

            def release() -> None:
                with lock:
                    if not opened:
                        opened.append(time.perf_counter())
                        gate.set_status(cl.command_execution_status.COMPLETE)

            cl.enqueue_barrier(q, wait_for=[gate])
            watchdog = threading.Timer(30.0, release)  # a call that waits on the queue would wait forever
            watchdog.start()
            try:
                for _ in range(steps):
                    fn()
            finally:
                late = bool(opened)
                release()
                q.finish()
                end = time.perf_counter()
                watchdog.cancel()
            if late:
                print("# kernel time not measured: a step waited on the queue", file=sys.stderr)
                return None
            times.append((end - opened[0]) * 1e3 / steps)
        return statistics.median(times)

    def optirs_row(self, shapes, spec, steps: int, batches: int, family: str = "adamw") -> Dict[str, Any]:
        import ml_dtypes
        import numpy as np
        import pyopencl.array as cla

        import optirs
        from optirs import GpuOptimizerConfig, Precision

        label, pdt, master, state_dtype, sr = spec
        dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[pdt]
        rng = np.random.default_rng(0)
        q = self.ctx.queue
        params = [cla.to_device(q, (rng.standard_normal(s, dtype=np.float32) * 0.02).astype(dtype)) for s in shapes]
        grads = [cla.to_device(q, (rng.standard_normal(s, dtype=np.float32) * 1e-3).astype(dtype)) for s in shapes]
        precision = Precision(master_weights=master if pdt != "float32" else None, state_dtype=state_dtype,
                              stochastic_rounding=sr, seed=1234)
        opt = getattr(optirs, FAMILIES[family].gpu_name)(seed_hyperparameters(family), GpuOptimizerConfig("opencl"),
                                                         precision=precision)
        ms = timed(self.sync, lambda: opt.step_gpu(params, grads), steps, batches)
        kms = self.kernel_ms(lambda: opt.step_gpu(params, grads), steps, batches)
        n = sum(int(p.size) for p in params)
        return {"label": f"optirs {label}", "ms": ms, "kernel_ms": kms,
                "bytes_per_param": format_bytes(pdt, master, state_dtype, family),
                "state_bytes_per_param": nbytes(opt.state_dict()["state"]) / n}


# ---------------------------------------------------------------- the peers


def peers(torch: Any, family: str = "adamw") -> List[Tuple[str, Callable, Any, float]]:
    if family != "adamw":
        return family_peers(torch, family)
    # bytes per parameter: fp32 parameters read and written (8) and the gradient read (4), plus the state
    out = [("torch fused AdamW fp32", lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY,
                                                                  fused=True), torch.float32, 28.0),
           ("torch fused AdamW bf16 params and state",
            lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY, fused=True),
            torch.bfloat16, 14.0)]
    try:
        import bitsandbytes as bnb

        out.append(("bitsandbytes AdamW8bit (fp32 params)",
                    lambda ps: bnb.optim.AdamW8bit(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY),
                    torch.float32, 12 + 2 * 2 * (1 + 4 / 2048)))
    except Exception as exc:
        print(f"# bitsandbytes not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
    try:
        from torchao.optim import AdamW4bit, AdamW8bit

        out.append(("torchao AdamW8bit (fp32 params)",
                    lambda ps: AdamW8bit(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY), torch.float32,
                    12 + 2 * 2 * (1 + 4 / 256)))
        out.append(("torchao AdamW4bit (fp32 params)",
                    lambda ps: AdamW4bit(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY), torch.float32,
                    12 + 2 * 2 * (0.5 + 4 / 128)))
    except Exception as exc:
        print(f"# torchao not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
    try:
        from torchao.optim import AdamWFp8

        # float8_e4m3fn moments in blocks of 256 with a float32 scale each: the float8 rows' layout
        out.append(("torchao AdamWFp8 (fp32 params)",
                    lambda ps: AdamWFp8(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY, block_size=256),
                    torch.float32, 12 + 2 * 2 * (1 + 4 / 256)))
    except Exception as exc:
        print(f"# torchao AdamWFp8 not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
    try:
        from flashoptim import FlashAdamW

        out.append(("FlashOptim FlashAdamW (bf16 + 8-bit correction)",
                    lambda ps: FlashAdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY), torch.bfloat16, 12.0))
    except Exception as exc:
        print(f"# FlashOptim not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
    return out


def family_peers(torch: Any, family: str) -> List[Tuple[str, Callable, Any, float]]:
    """Another family's peers: torch's own optimizer (fused where torch has it, else foreach) in
    float32 and on bfloat16 parameters and state, and bitsandbytes' 8-bit one (float32 parameters)."""
    f = FAMILIES[family]
    out = []
    if f.torch_peer is not None:
        how = "fused" if f.torch_peer == "SGD" else "foreach"
        make = lambda ps: getattr(torch.optim, f.torch_peer)(ps, **f.kwargs, **{how: True})  # noqa: E731
        out += [(f"torch {how} {f.torch_peer} fp32", make, torch.float32, 12.0 + 8 * f.slots),
                (f"torch {how} {f.torch_peer} bf16 params and state", make, torch.bfloat16, 6.0 + 4 * f.slots)]
    try:
        import bitsandbytes as bnb

        keys = ("lr", "betas", "eps", "weight_decay", "momentum", "alpha")
        kw = {k: v for k, v in f.kwargs.items() if k in keys}
        out.append((f"bitsandbytes {f.bnb_peer} (fp32 params)",
                    lambda ps: getattr(bnb.optim, f.bnb_peer)(ps, **kw), torch.float32,
                    12 + 2 * f.slots * (1 + 4 / 2048)))
    except Exception as exc:
        print(f"# bitsandbytes not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
    return out


def peer_row(dev: TorchDevice, shapes, label: str, make: Callable, dtype: Any, bytes_pp: float, steps: int,
             batches: int) -> Dict[str, Any]:
    params = dev.tensors(shapes, dtype)
    try:
        opt = make(params)
        ms = timed(dev.sync, opt.step, steps, batches)
        kms = dev.kernel_ms(opt.step, steps)
    except Exception as exc:  # a peer that imports but cannot run here: say why, keep the run
        return {"label": label, "peer": True, "error": error_text(exc)}
    n = sum(p.numel() for p in params)
    return {"label": label, "peer": True, "ms": ms, "kernel_ms": kms, "bytes_per_param": bytes_pp,
            "state_bytes_per_param": nbytes([dict(s) for s in opt.state.values()]) / n}


# ---------------------------------------------------------------- the run


def open_device(backend: str) -> Tuple[Optional[Device], Optional[Any], str]:
    """(device, torch for the peers or None, why not) for ``backend``."""
    try:
        import torch
    except ImportError:
        torch = None
    if backend in ("cuda", "cpu"):
        if torch is None:
            return None, None, "torch is not importable (optirs.torch drives this backend)"
        if backend == "cuda" and not torch.cuda.is_available():
            return None, None, f"torch {torch.__version__} sees no CUDA device"
        import optirs

        status = {s.name: s for s in optirs.list_backends()}.get(backend)
        if status is None or not status.available:
            return None, None, f"the {backend} backend cannot open: {getattr(status, 'reason', 'not installed')}"
        dev = TorchDevice(torch, backend)
        return dev, dev, ""
    try:
        dev = OpenclDevice()
    except Exception as exc:
        return None, None, f"the opencl backend cannot open: {type(exc).__name__}: {exc}"
    peer = TorchDevice(torch, "cuda") if torch is not None and torch.cuda.is_available() else None
    return dev, peer, ""


def finish_rows(rows: List[Dict[str, Any]], n: int, copy: float) -> Optional[float]:
    """Adds GB/s, the share of copy bandwidth and the speed relative to the best peer; returns the best peer's ms."""
    timed_peers = [r["ms"] for r in rows if r.get("peer") and "ms" in r]
    best = min(timed_peers) if timed_peers else None
    for r in rows:
        if "ms" not in r:
            continue
        r["gb_per_s"] = r["bytes_per_param"] * n / (r["ms"] * 1e-3) / 1e9
        r["of_copy"] = r["gb_per_s"] / copy
        if r.get("kernel_ms"):
            r["kernel_of_copy"] = r["bytes_per_param"] * n / (r["kernel_ms"] * 1e-3) / 1e9 / copy
        r["vs_best_peer"] = best / r["ms"] if best else None
    return best


def print_table(rows: List[Dict[str, Any]], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    headers = ["implementation", "ms", "kernel ms", "B/param", "GB/s", "of copy", "kernel of copy", "vs best peer",
               "state B/p"]

    def cells(r):
        if "ms" not in r:
            return [r["label"], "error: " + r["error"][:200]] + [""] * (len(headers) - 2)
        vs = f"{r['vs_best_peer']:.2f}x" if r.get("vs_best_peer") else "-"
        gbs = f"{r['gb_per_s']:.0f}" if r["gb_per_s"] >= 100 else f"{r['gb_per_s']:.2f}"
        kms = f"{r['kernel_ms']:.3f}" if r.get("kernel_ms") else "-"
        kcopy = f"{r['kernel_of_copy']:.1%}" if r.get("kernel_of_copy") else "-"
        return [r["label"], f"{r['ms']:.3f}", kms, f"{r['bytes_per_param']:.2f}", gbs,
                f"{r['of_copy']:.1%}", kcopy, vs, f"{r['state_bytes_per_param']:.2f}"]

    if Console is not None:
        table = Table(title=title)
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right")
        for r in rows:
            table.add_row(*cells(r))
        Console(width=190).print(table)
        return
    print(title)
    print(f"{headers[0]:58s} " + " ".join(f"{h:>12s}" for h in headers[1:]))
    for r in rows:
        c = cells(r)
        print(f"{c[0]:58s} " + " ".join(f"{x:>12s}" for x in c[1:]))


def compare(paths: List[str]) -> None:
    """Each optirs format's ms and kernel ms in two runs' JSON files (two backends, or a run before
    and after a change) side by side, with the second's time over the first's."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    a, b = ({r["label"]: r for r in run["rows"] if not r.get("peer")} for run in runs)
    names = [f"{run['backend']} ({path})" for run, path in zip(runs, paths)]
    print(f"# A = {names[0]}, B = {names[1]}; B/A above 1: B slower")
    print(f"{'format':58s} {'A ms':>8s} {'B ms':>8s} {'B/A':>6s} {'A kernel':>9s} {'B kernel':>9s} {'B/A':>6s}")

    def ratio(x, y):
        return f"{y / x:.2f}" if x and y else "-"

    for label in [k for k in a if k in b]:
        ra, rb = a[label], b[label]
        cells = [f"{r[key]:.3f}" if r.get(key) else "-" for key in ("ms",) for r in (ra, rb)]
        kcells = [f"{r[key]:.3f}" if r.get(key) else "-" for key in ("kernel_ms",) for r in (ra, rb)]
        print(f"{label[len('optirs '):]:58s} {cells[0]:>8s} {cells[1]:>8s} {ratio(ra.get('ms'), rb.get('ms')):>6s} "
              f"{kcells[0]:>9s} {kcells[1]:>9s} {ratio(ra.get('kernel_ms'), rb.get('kernel_ms')):>6s}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cuda", "opencl", "cpu"), default="cuda")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="adamw",
                    help="the optimizer (default adamw; lamb with max_grad_norm 1.0)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few steps")
    ap.add_argument("--model", choices=sorted(MODELS),
                    help="GPT-2 shapes (default: 124m on a GPU, a 14M-parameter GPT on cpu)")
    mix = ap.add_mutually_exclusive_group()
    mix.add_argument("--flat", action="store_true",
                     help="the model's parameters as one tensor of the same count (sets the tensor mix apart from "
                          "the size)")
    mix.add_argument("--split", type=int, metavar="N",
                     help="the model's parameters as N tensors of equal size, a multiple of --split-align (the last "
                          "takes the rest)")
    ap.add_argument("--split-align", type=int, default=256, metavar="K",
                    help="--split's tensors a multiple of K elements (default 256)")
    ap.add_argument("--min-size", type=int, default=0, metavar="N", help="leave out the tensors of fewer than N elements")
    ap.add_argument("--misalign", type=int, default=0, metavar="K",
                    help="a tensor of K elements in front of the others (the layout places every later tensor's "
                         "state at a multiple of 8 whatever K is; before it did, K off that grid put them all off it)")
    ap.add_argument("--one-buffer", action="store_true",
                    help="cuda: the parameters and the gradients as views of one allocation each")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--steps", type=int, help="steps per batch (default 20 on a GPU, 3 on cpu)")
    ap.add_argument("--batches", type=int, help="batches (default 5 on a GPU, 3 on cpu)")
    ap.add_argument("--no-peers", action="store_true", help="optirs rows only")
    ap.add_argument("--only", help="words separated by ';': run only the formats and peers whose label "
                                   "contains one of them (a short run when device time is scarce)")
    ap.add_argument("--dump-binaries", metavar="DIR",
                    help="opencl: after the rows, write each formats program's driver binary (NVIDIA's driver: its "
                         "PTX) as DIR/<family>-<codes>-u<slots>-s<signed>.ptx, with its cache key beside it (.key)")
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                    help="print the optirs rows of two runs' --json files side by side (B's time over A's), run nothing")
    args = ap.parse_args(argv)
    if args.compare:
        compare(args.compare)
        return 0
    shapes = variant_shapes(model_shapes(args.backend, args.smoke, args.model), args.flat, args.split, args.min_size,
                            args.misalign, args.split_align)
    n = sum(math.prod(s) for s in shapes)
    if args.one_buffer and args.backend == "opencl":
        raise SystemExit("--one-buffer: the torch rows only (--backend cuda or cpu)")
    TorchDevice.one_buffer = args.one_buffer  # the peers' tensors too
    dev, peer_dev, why = open_device(args.backend)
    if dev is None:
        print(f"skipped: {why}")
        return 0
    gpu = args.backend != "cpu"
    steps = args.steps or (2 if args.smoke else 20 if gpu else 3)
    batches = args.batches or (2 if args.smoke else 5 if gpu else 3)
    copy_n = (1 << 20) if args.smoke else (256 << 20) if gpu else 4 * n  # host: 2x the bf16+f32 format's bytes
    copy = dev.copy_gb_per_s(copy_n, steps, batches)
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith("OPTIRS_")}  # tuning variables
    title = (f"{FAMILIES[args.family].torch_name} step formats, {args.backend} backend on {dev.name}: {len(shapes)} tensors, {n} parameters; "
             f"copy {copy:.1f} GB/s" + "".join(f"; {k}={v}" for k, v in settings.items()))
    print(f"# {title}", flush=True)
    rows: List[Dict[str, Any]] = []
    words = [w.strip() for w in args.only.split(";")] if args.only else None

    def wanted(label: str) -> bool:
        return words is None or any(w in label for w in words)

    def done(row: Dict[str, Any]) -> None:
        """Print the row as it finishes and rewrite the JSON: a run cut short keeps every row so far."""
        rows.append(row)
        kernel = f", kernel {row['kernel_ms']:.3f} ms" if row.get("kernel_ms") else ""
        print(f"#   {row['label']}: {row.get('ms', str(row.get('error'))[:200])}{kernel}", flush=True)
        best = finish_rows(rows, n, copy)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"backend": args.backend, "family": args.family, "device": dev.name, "params": n, "tensors": len(shapes),
                           "copy_gb_per_s": copy, "best_peer_ms": best, "settings": settings, "rows": rows}, f,
                          indent=1)

    for spec in FORMATS:
        if not wanted(f"optirs {spec[0]}"):
            continue
        try:
            row = dev.optirs_row(shapes, spec, steps, batches, args.family)
        except Exception as exc:
            row = {"label": f"optirs {spec[0]}", "error": error_text(exc)}
        done(row)
    if peer_dev is not None and not args.no_peers:
        for label, make, dtype, bytes_pp in peers(peer_dev.torch, args.family):
            if wanted(label):
                done(peer_row(peer_dev, shapes, label, make, dtype, bytes_pp, steps, batches))
    finish_rows(rows, n, copy)
    print_table(rows, title)
    if args.dump_binaries and args.backend == "opencl":
        dump_binaries(dev, args.dump_binaries)
    return 0


def dump_binaries(dev: Any, directory: str) -> None:
    """The opencl formats programs this run built, as the driver compiled them (to read its PTX)."""
    from optirs.backends.opencl.formats import built_binaries

    os.makedirs(directory, exist_ok=True)
    for stem, key, binary in built_binaries(dev.b.ctx):
        with open(os.path.join(directory, f"{stem}.ptx"), "wb") as f:
            f.write(binary.rstrip(b"\0"))
        with open(os.path.join(directory, f"{stem}.key"), "w") as f:
            f.write(key + "\n")
        print(f"# wrote {os.path.join(directory, stem)}.ptx ({len(binary)} bytes)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
