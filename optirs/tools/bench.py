"""``optirs bench``: every optimizer on every available backend, beside torch.optim, as fractions of copy bandwidth.

Cases (the full sizes, each times the size scale):

* ``flat``: one 256M-element float32 tensor;
* ``model``: 300 tensors of lognormal sizes (seed 0) summing to about 134M parameters, each size
  rounded up to a multiple of 64 elements as real layer shapes are;
* ``small``: 1M parameters in 50 tensors (same recipe, seed 1): the wall time of a whole step,
  host included, where launch and Python overheads dominate.

Sized for the machine, per backend: the full sizes (and 10 steps x 7 batches) for a backend whose
device is not the host's processor (a GPU), else a CPU run at 1/64 of them (4M flat, 2M model, 16K small; 3
steps x 5 batches, fewer where a measurement would take over 2 s, as a peer's steps can on a
busy machine) that takes about a minute and well under 2 GB; ``--full`` forces the full
run, ``--size-scale`` / ``--reps`` / ``--repeats`` / ``--warmup`` set each part. By default a
backend whose device is the host's processor is measured only where ``backend="auto"`` would
rank it first among those (the cpu backend rather than OpenCL on PoCL); ``--backends`` names any.

Per case and optimizer it reports the step time (median over batches of back-to-back steps through
the public API, ``step_gpu``), the kernel time (the backend's step hook alone, no validation),
the effective bandwidth (bytes the optimizer must move / kernel time), the fraction of the
device's copy bandwidth measured in the same run at the case's own size, and the speedup over torch.optim (fused where
torch has it for that optimizer and device, else foreach) on the same device. Before timing,
every optimizer is checked against :mod:`optirs.core.reference` on a small model.

Device arrays come from each backend's own kind: numba device arrays (cuda), pyopencl arrays on
the backend's queue (opencl), numpy (cpu). Timing uses CUDA events on the CUDA device, and
synchronize + perf_counter elsewhere; arrays are random (never zeros), every buffer (state
included) exists before the timed steps, and warm-up steps run first. Not in a terminal, one line
per case goes to stderr as it finishes; Ctrl-C prints the results so far and exits 130.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from optirs.core.definitions import DEFINITIONS
from optirs.core.simulator import cuda_simulator_enabled
from optirs.plugin.registry import SUPPORTED_BACKENDS

FLAT = 256 * 2**20
MODEL_TOTAL = 134_000_000
MODEL_TENSORS = 300
SMALL_TOTAL = 1_000_000
SMALL_TENSORS = 50
CASES = ("flat", "model", "small")
CPU_SCALE = 1 / 64  # the default size scale where every measured device is the host's processor
# DeviceInfo.kind values of devices that are the host's processor (the numpy peer runs there too).
HOST_DEVICE_KINDS = frozenset({"cpu"})

# Bytes per element each optimizer must move with the default hyperparameters used here:
# read p, g and every state slot, write p and every state slot (4 bytes each). LAMB needs the
# per-tensor norms of p and of the update before any p is written, so every element is read in
# two passes: (p, g, m, v) in, (m, v) out; then (p, m, v) in, p out.
BYTES_PER_ELEMENT = {name: d.bytes_per_element() for name, d in DEFINITIONS.items()}


def default_hyperparameters() -> Dict[str, Any]:
    """The hyperparameters each optimizer is timed with (its definition's ``benchmark``)."""
    return {name: d.benchmark_params() for name, d in DEFINITIONS.items()}


def lognormal_sizes(total: int, count: int, seed: int, multiple: int = 64) -> List[int]:
    """``count`` lognormal sizes summing to about ``total``, each a multiple of ``multiple``."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=0.0, sigma=1.5, size=count)
    sizes = np.maximum(multiple, np.ceil(raw / raw.sum() * total / multiple) * multiple).astype(np.int64)
    return [int(s) for s in sizes]


def case_sizes(case: str, scale: float) -> List[int]:
    if case == "flat":
        return [max(64, int(FLAT * scale) // 64 * 64)]
    if case == "model":
        return lognormal_sizes(max(MODEL_TENSORS * 64, int(MODEL_TOTAL * scale)), MODEL_TENSORS, seed=0)
    if case == "small":
        return lognormal_sizes(max(SMALL_TENSORS * 64, int(SMALL_TOTAL * scale)), SMALL_TENSORS, seed=1)
    raise ValueError(case)


# ------------------------------------------------------------------ device kinds


class Kind:
    """Arrays, synchronization and timing for one backend's device, through the backend's own hooks
    (so any backend, a third party's too, is measured): the ``measure`` capability gives device
    timing, the copy yardstick and the torch device of the peers; without it, host timing and a
    numpy copy."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.name = backend.name
        self.measured = backend.supports("measure")

    def make(self, host: np.ndarray) -> Any:
        """A device array holding ``host``, shaped like it (optirs_to_device gives a flat array;
        shape matters to optimizers such as Adafactor that factor 2-d tensors)."""
        flat = self.backend.to_device(self.backend.ctx, host)
        return flat.reshape(host.shape) if hasattr(flat, "reshape") else flat

    def to_host(self, array: Any) -> np.ndarray:
        if hasattr(array, "detach"):  # a torch tensor (the peers' arrays)
            return array.detach().cpu().numpy()
        return np.asarray(self.backend.to_host(self.backend.ctx, array))

    def sync(self) -> None:
        self.backend.synchronize()

    def time_ms(self, fn: Callable[[], None], reps: int) -> float:
        """Milliseconds per call over ``reps`` back-to-back calls (device finished)."""
        self.sync()
        if self.measured:
            return self.backend.hook("measure", "optirs_measure_elapsed_ms")(self.backend.ctx, fn, reps)
        return self.wall_ms(fn, reps)

    def wall_ms(self, fn: Callable[[], None], reps: int) -> float:
        self.sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3 / reps

    def copy_candidates(self, n: int) -> List[Tuple[str, Callable[[], None]]]:
        out = []
        host = np.zeros(4, np.float32)
        if self.backend.host_view(host) is not None:  # host memory: numpy's own copy is a candidate too
            src, dst = _random(n, 7), np.zeros(n, np.float32)
            out.append(("numpy copyto", lambda: np.copyto(dst, src)))
        if self.measured:
            out.append(self.backend.hook("measure", "optirs_measure_copy")(self.backend.ctx, n))
        elif not out:
            src, dst = self.make(_random(n, 7)), self.make(np.zeros(n, np.float32))
            out.append(("host round trip", lambda: self.make(self.to_host(src))))
        return out

    def torch_device(self) -> Optional[str]:
        if self.measured:
            return self.backend.hook("measure", "optirs_torch_device")(self.backend.ctx)
        return None

    def describe(self) -> str:
        d = self.backend.devices[0] if self.backend.devices else None
        if d is None:
            return self.name
        cc = d.details.get("compute_capability")
        return f"{d.name} ({d.compute_units} {'SMs' if cc else 'units'}" + (f", CC {cc})" if cc else ")")


def make_kind(backend: Any) -> Kind:
    return Kind(backend)


def _random(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = rng.random(n, dtype=np.float32)
    out -= np.float32(0.5)
    return out


# ------------------------------------------------------------------ peers


def torch_optimizer(name: str, params: List[Any], hp: Any, device: str):
    """torch.optim's implementation of ``name`` (fused where supported, else foreach), or (None, reason)."""
    import torch

    ctor = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
            "rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad,
            "adafactor": getattr(torch.optim, "Adafactor", None), "nadam": torch.optim.NAdam,
            "radam": torch.optim.RAdam, "adamax": torch.optim.Adamax, "adadelta": torch.optim.Adadelta,
            "asgd": torch.optim.ASGD, "rprop": torch.optim.Rprop}.get(name)
    if ctor is None:
        return None, "torch.optim has no " + name
    kwargs = {
        "adam": lambda: dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay),
        "adamw": lambda: dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay),
        "sgd": lambda: dict(lr=hp.lr, momentum=hp.momentum),
        "rmsprop": lambda: dict(lr=hp.lr, alpha=hp.alpha, eps=hp.eps),
        "adagrad": lambda: dict(lr=hp.lr, eps=hp.eps),
        "adafactor": lambda: dict(lr=hp.lr, beta2_decay=hp.beta2_decay, eps=hp.eps, d=hp.d,
                                  weight_decay=hp.weight_decay, maximize=hp.maximize),
        "nadam": lambda: dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay,
                              momentum_decay=hp.momentum_decay, decoupled_weight_decay=hp.decoupled_weight_decay),
        "radam": lambda: dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay,
                              decoupled_weight_decay=hp.decoupled_weight_decay),
        "adamax": lambda: dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay),
        "adadelta": lambda: dict(lr=hp.lr, rho=hp.rho, eps=hp.eps, weight_decay=hp.weight_decay),
        "asgd": lambda: dict(lr=hp.lr, lambd=hp.lambd, alpha=hp.alpha, t0=hp.t0, weight_decay=hp.weight_decay),
        "rprop": lambda: dict(lr=hp.lr, etas=(hp.etaminus, hp.etaplus),
                              step_sizes=(hp.step_size_min, hp.step_size_max)),
    }[name]()
    for mode in ("fused", "foreach"):
        try:
            opt = ctor(params, **kwargs, **{mode: True})
            opt.step()  # fused support is checked at the first step on some versions
            return opt, mode
        except (RuntimeError, TypeError, ValueError):
            continue
    return None, "torch rejected fused and foreach"


def numpy_step(name: str, hp: Any):
    """(make_state(p) -> state, step(p, g, state, t)): a float32 in-place numpy step (the CPU peer),
    its state and scratch allocated by ``make_state`` before any timed step; None where not written."""
    f32 = np.float32
    if name in ("adam", "adamw"):
        def make(p):
            return {"m": np.zeros_like(p), "v": np.zeros_like(p), "t": np.empty_like(p)}

        def step(p, g, st, t):
            m, v, tmp = st["m"], st["v"], st["t"]
            if name == "adamw":
                p *= f32(1 - hp.lr * hp.weight_decay)
            m *= f32(hp.beta1); np.multiply(g, f32(1 - hp.beta1), out=tmp); m += tmp
            v *= f32(hp.beta2); np.multiply(g, g, out=tmp); tmp *= f32(1 - hp.beta2); v += tmp
            np.sqrt(v, out=tmp); tmp /= f32(np.sqrt(1 - hp.beta2**t)); tmp += f32(hp.eps)
            np.divide(m, tmp, out=tmp); tmp *= f32(hp.lr / (1 - hp.beta1**t)); p -= tmp
        return make, step
    if name == "sgd":
        def make(p):
            return {"b": np.empty_like(p), "t": np.empty_like(p)}

        def step(p, g, st, t):
            b, tmp = st["b"], st["t"]
            if t > 1:
                b *= f32(hp.momentum); b += g
            else:
                np.copyto(b, g)  # torch's first momentum buffer is the gradient
            np.multiply(b, f32(hp.lr), out=tmp); p -= tmp
        return make, step
    if name in ("adagrad", "rmsprop"):
        def make(p):
            return {"s": np.zeros_like(p), "t": np.empty_like(p)}

        if name == "adagrad":
            def step(p, g, st, t):
                s, tmp = st["s"], st["t"]
                np.multiply(g, g, out=tmp); s += tmp; np.sqrt(s, out=tmp); tmp += f32(hp.eps)
                np.divide(g, tmp, out=tmp); tmp *= f32(hp.lr); p -= tmp
        else:
            def step(p, g, st, t):
                s, tmp = st["s"], st["t"]
                s *= f32(hp.alpha); np.multiply(g, g, out=tmp); tmp *= f32(1 - hp.alpha); s += tmp
                np.sqrt(s, out=tmp); tmp += f32(hp.eps); np.divide(g, tmp, out=tmp); tmp *= f32(hp.lr); p -= tmp
        return make, step
    return None


# ------------------------------------------------------------------ results


@dataclass
class Row:
    backend: str
    impl: str  # "optirs", "torch fused", "torch foreach", "numpy"
    optimizer: str
    case: str
    elements: int
    tensors: int
    ms: float  # a whole step through the public API (median)
    kernel_ms: Optional[float] = None  # the step hook alone (optirs) / same as ms (peers)
    gbps: Optional[float] = None
    copy_fraction: Optional[float] = None
    speedup_vs_torch: Optional[float] = None
    check: str = ""
    note: str = ""


@dataclass
class Report:
    date: str
    host: str
    versions: Dict[str, str]
    devices: Dict[str, str] = field(default_factory=dict)
    copy_gbps: Dict[str, float] = field(default_factory=dict)  # "backend/case": measured at the case's size
    copy_method: Dict[str, str] = field(default_factory=dict)
    checks: Dict[str, str] = field(default_factory=dict)
    rows: List[Row] = field(default_factory=list)
    settings: Dict[str, Any] = field(default_factory=dict)
    interrupted: bool = False  # Ctrl-C: the rows are those measured before it


def _versions() -> Dict[str, str]:
    out = {"python": platform.python_version()}
    for mod in ("optirs", "numpy", "numba", "numba_cuda", "torch", "pyopencl"):
        try:
            m = __import__(mod)
            out[mod] = str(getattr(m, "__version__", "?"))
        except Exception:
            pass
    try:
        from numba import cuda

        if not cuda_simulator_enabled() and cuda.is_available():
            ver = cuda.cudadrv.driver.driver.get_version()
            out["cuda_driver"] = ".".join(str(v) for v in ver)
    except Exception:
        pass
    return out


# ------------------------------------------------------------------ measuring


# The CPU profile's cap on one measurement: a peer that collapses on a busy machine (torch's
# OpenMP steps took seconds each here) is timed over fewer steps, not for minutes.
CPU_BUDGET_S = 2.0
BUDGET_S: Optional[float] = None  # the backend being measured: its Sizing's budget_s


# Ctrl-C, seen by the handler that main installs: a KeyboardInterrupt raised while numba compiles can
# land in llvmlite's ctypes callback, where Python reports and drops it, and the run would go on
_INTERRUPTED = threading.Event()


class _CtrlC:
    """While in effect, Ctrl-C sets :data:`_INTERRUPTED` and raises KeyboardInterrupt; one that Python
    drops (raised inside a ctypes callback) is not printed, and the measurements raise it again at their
    next batch (:func:`_stop_if_interrupted`)."""

    def __enter__(self) -> "_CtrlC":
        _INTERRUPTED.clear()
        self._handler, self._hook = signal.getsignal(signal.SIGINT), sys.unraisablehook

        def on_sigint(signum, frame):
            _INTERRUPTED.set()
            raise KeyboardInterrupt

        def unraisable(info):
            if not (info.exc_type is not None and issubclass(info.exc_type, KeyboardInterrupt)):
                self._hook(info)

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, on_sigint)
        sys.unraisablehook = unraisable
        return self

    def __exit__(self, *exc) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._handler)
        sys.unraisablehook = self._hook


def _stop_if_interrupted() -> None:
    if _INTERRUPTED.is_set():
        raise KeyboardInterrupt


def _median_ms(kind: Kind, fn: Callable[[], None], reps: int, repeats: int, warmup: int, wall: bool = False) -> float:
    _stop_if_interrupted()
    for _ in range(max(1, warmup)):  # at least one: buffers a first step allocates are not timed
        t0 = time.perf_counter()
        fn()
        kind.sync()
        last = time.perf_counter() - t0
    if BUDGET_S is not None and last * reps * repeats > BUDGET_S:
        reps = max(1, int(BUDGET_S / (last * max(3, repeats // 2))))
        repeats = max(3, min(repeats, int(BUDGET_S / (last * reps))))
    timer = kind.wall_ms if wall else kind.time_ms
    times = []
    for _ in range(repeats):
        _stop_if_interrupted()
        times.append(timer(fn, reps))
    value = statistics.median(times)
    if not value > 0:
        raise RuntimeError(f"timer returned {value} ms: too few repetitions to measure")
    return value


def check_against_reference(backend_name: str, kind: Kind, name: str, hp: Any) -> str:
    """Three steps on a small model through the public API, compared with optirs.core.reference."""
    import optirs
    from optirs.core import reference
    from optirs.optim.optimizers import OPTIMIZERS

    try:
        return _check(backend_name, kind, name, hp)
    except Exception as exc:
        return f"FAILED ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"


def _check(backend_name: str, kind: Kind, name: str, hp: Any) -> str:
    import optirs
    from optirs.core import reference
    from optirs.optim.optimizers import OPTIMIZERS

    rng = np.random.default_rng(3)
    shapes = [(1000,), (37,), (65, 63), (4099,)]
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    expected, _ = reference.run(name, host, grads, hp)
    params = [kind.make(h) for h in host]
    opt = OPTIMIZERS[name](hp, optirs.GpuOptimizerConfig(backend=backend_name))
    for gs in grads:
        opt.step_gpu(params, [kind.make(g) for g in gs])
    worst = 0.0
    for p, e in zip(params, expected):
        a = kind.to_host(p).reshape(e.shape)
        scale = float(np.max(np.abs(e))) or 1.0
        worst = max(worst, float(np.max(np.abs(a - e) / (1e-5 * scale + 1e-5 * np.abs(e)))))
    if worst > 1.0:
        return f"FAILED (error {worst:.2f}x the 1e-5 tolerance)"
    return f"ok ({worst:.2f}x tol)"


def measure_copy(kind: Kind, n: int, reps: int, repeats: int) -> Tuple[float, str]:
    best, method = 0.0, ""
    for label, fn in kind.copy_candidates(n):
        ms = _median_ms(kind, fn, reps, repeats, warmup=2)
        gbps = 2 * 4 * n / ms / 1e6  # bytes read + written
        if gbps > best:
            best, method = gbps, label
    return best, method


def bench_optirs(backend: Any, kind: Kind, name: str, hp: Any, params: List[Any], grads: List[Any], sizes: List[int],
                 reps: int, repeats: int, warmup: int, wall: bool) -> Tuple[float, float]:
    """(API step ms, hook-only ms) for one optimizer on prepared device arrays: the whole step through
    ``step_gpu``, then the backend's ``optirs_step`` alone on the same engine's state (no checks)."""
    import optirs
    from optirs.optim.optimizers import OPTIMIZERS
    from optirs.plugin.hookspecs import StepControls, StepRequest

    opt = OPTIMIZERS[name](hp, optirs.GpuOptimizerConfig(backend=backend.name))
    api_ms = _median_ms(kind, lambda: opt.step_gpu(params, grads), reps, repeats, warmup, wall=wall)
    engine = opt.engine
    staged = backend.stage(backend.ctx, params, grads, None)
    request = StepRequest(engine.definition, staged.params, staged.grads, engine.state, engine.layout,
                          opt.step_scalars(2), StepControls(2))
    hook_ms = _median_ms(kind, lambda: backend.step(backend.ctx, request), reps, repeats, warmup, wall=wall)
    del opt, engine, staged, request
    return api_ms, hook_ms


def default_backends(statuses: Dict[str, Any]) -> Tuple[List[str], List[str]]:
    """(backends measured by default, notes on those left out): every available backend whose
    device is not the host's processor, and of those whose device is, the one ``backend="auto"``
    ranks first (two backends on the same cores measure the cores twice)."""
    from optirs.plugin.registry import choose_auto

    available = [n for n in SUPPORTED_BACKENDS if n in statuses and statuses[n].available]
    available += [n for n, st in statuses.items() if st.available and n not in available]
    on_host = [n for n in available if _on_host(statuses[n])]
    ranked = [n for n in choose_auto().ranking if n in on_host] + on_host
    keep = set(available) - set(on_host) | set(ranked[:1])
    notes = [f"{n}: its device is this host's processor, measured by {ranked[0]} (--backends {n} times it)"
             for n in on_host if n not in keep]
    return [n for n in available if n in keep], notes


def _on_host(status: Any) -> bool:
    return any(d.kind in HOST_DEVICE_KINDS for d in status.devices[:1])


@dataclass
class Sizing:
    """How one backend is measured: the profile (``host`` where its device is the host's processor
    and ``--full`` was not given, else ``full``) with what the user set in its place."""

    profile: str
    size_scale: float
    reps: int
    repeats: int
    warmup: int
    budget_s: Optional[float]


PROFILES = {"host": (CPU_SCALE, 3, 5, 1, CPU_BUDGET_S), "full": (1.0, 10, 7, 3, None)}


def sizing_for(args: argparse.Namespace, status: Any) -> Sizing:
    profile = "host" if _on_host(status) and not args.full else "full"
    defaults = PROFILES[profile]
    chosen = [getattr(args, key) if getattr(args, key) is not None else value
              for key, value in zip(("size_scale", "reps", "repeats", "warmup"), defaults)]
    return Sizing(profile, *chosen, defaults[4])


class CaseProgress:
    """A line per finished case on stderr when it is not a terminal (logs, CI, a pipe); a live
    bar per backend in a terminal, its finished cases left printed above it."""

    def __init__(self, console: Any, total_cases: int):
        self.console, self.total, self.done = console, total_cases, 0
        self.bar = None
        if console.is_terminal:
            from rich.progress import Progress

            self.bar = Progress(console=console, transient=True)

    def __enter__(self) -> "CaseProgress":
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def start(self, label: str, steps: int) -> None:
        self.t0 = time.perf_counter()
        if self.bar is not None:
            self.task = self.bar.add_task(label, total=steps)

    def step(self, label: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=label)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def finish(self, text: str) -> None:
        self.done += 1
        line = f"[{self.done}/{self.total}] {text} ({time.perf_counter() - self.t0:.1f} s)"
        if self.bar is not None:
            self.bar.remove_task(self.task)
        self.console.print(line, markup=False, highlight=False)


def run(args: argparse.Namespace, console: Any, report: Report, statuses: Dict[str, Any], names: Sequence[str],
        progress_console: Any) -> Report:
    """Measure into ``report`` (filled as it goes, so a Ctrl-C leaves the cases finished so far)."""
    import optirs
    from optirs.plugin.hookspecs import OPTIMIZER_NAMES

    hps = default_hyperparameters()
    optimizers = args.optimizers or list(OPTIMIZER_NAMES)
    report.settings.update({"cases": args.cases, "optimizers": optimizers, "backends": list(names),
                            "sizing": {}})
    torch = None
    if not args.no_torch:
        try:
            import torch  # noqa: F811
        except ImportError:
            torch = None

    with CaseProgress(progress_console, len(names) * len(args.cases)) as progress:
        for bname in names:
            global BUDGET_S
            sz = sizing_for(args, statuses[bname])
            BUDGET_S = sz.budget_s
            report.settings["sizing"][bname] = asdict(sz)
            backend = optirs.get_backend(bname)
            kind = make_kind(backend)
            # numpy's loops are a peer only where the backend computes on the host's own processor.
            on_host = _on_host(statuses[bname])
            report.devices[bname] = kind.describe()
            for name in optimizers:
                report.checks[f"{bname}/{name}"] = check_against_reference(bname, kind, name, hps[name])
            tdev = kind.torch_device() if torch is not None else None
            for case in args.cases:
                progress.start(f"{bname} {case}", len(optimizers))
                sizes = case_sizes(case, sz.size_scale)
                total = sum(sizes)
                wall = case == "small"
                reps = max(3, sz.reps if not wall else sz.reps * 10)
                key = f"{bname}/{case}"
                report.copy_gbps[key], report.copy_method[key] = measure_copy(kind, total, reps, sz.repeats)
                copy = report.copy_gbps[key]
                hosts_p = [_random(n, 11 + i) for i, n in enumerate(sizes)]
                hosts_g = [_random(n, 1000 + i) * np.float32(0.01) for i, n in enumerate(sizes)]
                params = [kind.make(h) for h in hosts_p]
                grads = [kind.make(h) for h in hosts_g]
                for name in optimizers:
                    progress.step(f"{bname} {case} {name}")
                    check = report.checks[f"{bname}/{name}"]
                    torch_ms = None
                    if tdev is not None and name != "lamb":
                        tp = [torch.from_numpy(h).to(tdev) for h in hosts_p]
                        for p, h in zip(tp, hosts_g):
                            p.grad = torch.from_numpy(h).to(tdev)
                        topt, mode = torch_optimizer(name, tp, hps[name], tdev)
                        if topt is not None:
                            torch_ms = _median_ms(kind, topt.step, reps, sz.repeats, sz.warmup, wall=wall)
                            report.rows.append(_row(bname, f"torch {mode}", name, case, sizes, torch_ms, torch_ms,
                                                    None, copy, ""))
                        del tp, topt
                    peer = numpy_step(name, hps[name]) if on_host and not args.no_numpy else None
                    if peer is not None:
                        make_state, fn = peer
                        nps = [h.copy() for h in hosts_p]
                        states = [make_state(p) for p in nps]
                        counter = [0]

                        def np_step():
                            counter[0] += 1
                            for p, g, st in zip(nps, hosts_g, states):
                                fn(p, g, st, counter[0])

                        ms = _median_ms(kind, np_step, reps, sz.repeats, sz.warmup, wall=True)
                        report.rows.append(_row(bname, "numpy", name, case, sizes, ms, ms, torch_ms, copy, ""))
                        del nps, states
                    try:
                        api_ms, hook_ms = bench_optirs(backend, kind, name, hps[name], params, grads, sizes, reps,
                                                       sz.repeats, sz.warmup, wall)
                        report.rows.append(_row(bname, "optirs", name, case, sizes, api_ms, hook_ms, torch_ms,
                                                copy, check))
                    except Exception as exc:  # report and carry on with the other cases
                        report.rows.append(Row(bname, "optirs", name, case, total, len(sizes), float("nan"),
                                               check=check, note=f"{type(exc).__name__}: {exc}"))
                    progress.advance()
                count = f"{len(optimizers)} optimizer" + ("" if len(optimizers) == 1 else "s")
                progress.finish(f"{bname} {case}: {count}, {_count(total)} elements in {_tensors(len(sizes))}")
                del params, grads, hosts_p, hosts_g
    return report


def _row(backend: str, impl: str, name: str, case: str, sizes: Sequence[int], ms: float, kernel_ms: float,
         torch_ms: Optional[float], copy_gbps: float, check: str) -> Row:
    total = sum(sizes)
    gbps = BYTES_PER_ELEMENT[name] * total / kernel_ms / 1e6
    return Row(backend, impl, name, case, total, len(sizes), ms, kernel_ms, gbps, gbps / copy_gbps if copy_gbps else None,
               (torch_ms / ms) if torch_ms else None, check)


# ------------------------------------------------------------------ output


# Column headers kept short so a table fits 80 columns: a pipe has no wider terminal to use.
IMPL_SHORT = {"torch fused": "torch-fused", "torch foreach": "torch-4each"}


def print_report(report: Report, console: Any) -> None:
    """One table per backend and case (their sizes and copy bandwidth in the title), each within 80
    columns; a check's detail and a row's error are listed under the tables, never cut."""
    from rich.table import Table

    from optirs.tools.cli import table_box

    console.print(f"optirs bench, {report.date}; " + ", ".join(f"{k} {v}" for k, v in report.versions.items()),
                  markup=False, highlight=False)
    for b, d in report.devices.items():
        console.print(f"  {b}: {d}", markup=False, highlight=False)
    style = table_box(console)
    notes: List[str] = []
    for key in dict.fromkeys(f"{r.backend}/{r.case}" for r in report.rows):
        rows = [r for r in report.rows if f"{r.backend}/{r.case}" == key]
        first = rows[0]
        title = (f"{first.backend}, {first.case}: {_count(first.elements)} elements in {_tensors(first.tensors)}; "
                 f"copy {report.copy_gbps.get(key, 0):.1f} GB/s")
        table = Table(title=title, box=style, title_justify="left")
        for col in ("optimizer", "impl", "step\nms", "kernel\nms", "GB/s", "of\ncopy", "vs\ntorch", "check"):
            table.add_column(col, justify="left" if col in ("optimizer", "impl", "check") else "right",
                             overflow="fold")
        for r in rows:
            check = (r.check or "").split(" ")[0] or ("error" if r.note else "")
            if r.note or check == "FAILED":
                notes.append(f"{r.backend} {r.case} {r.optimizer} {r.impl}: {r.note or r.check}")
            table.add_row(r.optimizer, IMPL_SHORT.get(r.impl, r.impl), _ms(r.ms), _ms(r.kernel_ms),
                          _f(r.gbps, 0), _pct(r.copy_fraction), _times(r.speedup_vs_torch), check)
        console.print(table)
    for line in notes:
        console.print(line, markup=False, highlight=False)
    console.print("step ms: a whole step through step_gpu (small case: wall time, host included); kernel ms: "
                  "the backend's step hook alone (optirs) or the same step (peers); GB/s: bytes the optimizer "
                  "must move / kernel ms; of copy: of the copy bandwidth at the case's size; vs torch: torch "
                  "step ms / step ms; torch-4each: torch's foreach implementation.", markup=False, highlight=False)
    if report.interrupted:
        console.print("interrupted (Ctrl-C): the cases above are those finished before it", markup=False,
                      highlight=False)


def _ms(v: Optional[float]) -> str:
    """Four significant digits (6 characters at most below 10 s): a column stays narrow."""
    return "-" if v is None or v != v else f"{v:.4g}" if v < 1e4 else f"{v:.0f}"


def _times(v: Optional[float]) -> str:
    return "-" if not v else f"{v:.2f}x" if v < 10 else f"{v:.1f}x" if v < 100 else f"{v:.0f}x"


def _tensors(n: int) -> str:
    return f"{n} tensor" + ("" if n == 1 else "s")


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K" if n >= 1e3 else str(n)


def _f(v: Optional[float], digits: int) -> str:
    return "-" if v is None or v != v else f"{v:.{digits}f}"


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def write_plot(report: Report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.copy_fraction is not None and r.case != "small"]
    groups = sorted({(r.backend, r.case, r.optimizer) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    impls = sorted({r.impl for r in rows}, key=lambda s: (s != "optirs", s))
    width = 0.8 / max(1, len(impls))
    fig, ax = plt.subplots(figsize=(max(8, len(groups) * 0.7), 4.5))
    for k, impl in enumerate(impls):
        values = []
        for g in groups:
            match = [r.copy_fraction for r in rows if (r.backend, r.case, r.optimizer) == g and r.impl == impl]
            values.append(100 * match[0] if match else 0.0)
        ax.bar(np.arange(len(groups)) + k * width, values, width, label=impl)
    ax.set_xticks(np.arange(len(groups)) + width * (len(impls) - 1) / 2)
    ax.set_xticklabels([f"{b}\n{c}\n{o}" for b, c, o in groups], fontsize=7)
    ax.set_ylabel("% of copy bandwidth")
    ax.axhline(100, color="grey", linewidth=0.5)
    ax.legend()
    ax.set_title(f"optirs bench {report.date}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _names(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: Optional[List[str]] = None) -> int:
    from optirs.plugin.hookspecs import OPTIMIZER_NAMES

    parser = argparse.ArgumentParser(prog="optirs bench", description=__doc__.split("\n")[0],
                                     epilog="Sized for the machine: see the module docstring (optirs/tools/bench.py) "
                                            "and docs/benchmarks.md.")
    parser.add_argument("--backends", type=_names, default=None,
                        help="comma-separated backend names (default: each available device once)")
    parser.add_argument("--optimizers", type=_names, default=None, help=f"comma-separated from {','.join(OPTIMIZER_NAMES)}")
    parser.add_argument("--cases", type=_names, default=list(CASES), help="comma-separated from flat,model,small")
    parser.add_argument("--full", action="store_true",
                        help="the full sizes (256M flat, 134M model, 1M small) even on a CPU")
    parser.add_argument("--size-scale", type=float, default=None,
                        help=f"scale every case's size (default 1, or {CPU_SCALE:g} when every device is a CPU)")
    parser.add_argument("--reps", type=int, default=None, help="back-to-back steps per timed batch, x10 for small "
                        "(default 10; 3 on a CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed batches; the median is reported "
                        "(default 7; 5 on a CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 on a CPU)")
    parser.add_argument("--no-torch", action="store_true", help="do not time torch.optim")
    parser.add_argument("--no-numpy", action="store_true", help="do not time the numpy peer (cpu)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PNG", help="write a bar chart of the fractions of copy bandwidth")
    args = parser.parse_args(argv)
    for value, allowed, what in ((args.optimizers or [], OPTIMIZER_NAMES, "optimizer"), (args.cases, CASES, "case")):
        bad = [v for v in value if v not in allowed]
        if bad:
            parser.error(f"unknown {what} {', '.join(map(repr, bad))}; known: {', '.join(allowed)}")
    for key in ("size_scale", "reps", "repeats", "warmup"):
        value = getattr(args, key)
        if value is not None and not (value > 0 or (key == "warmup" and value == 0)):
            parser.error(f"--{key.replace('_', '-')} {value}, expected a number > 0" + (" (or 0)" if key == "warmup" else ""))
    import optirs
    from optirs.plugin.registry import REGISTRY

    known = REGISTRY.backend_names()
    bad = [b for b in args.backends or [] if b not in known]
    if bad:
        parser.error(f"unknown backend {', '.join(map(repr, bad))}; known: {', '.join(sorted(known))}")
    statuses = {s.name: s for s in optirs.list_backends()}
    if args.backends:
        names, notes = list(dict.fromkeys(args.backends)), []
        missing = [f"{b} ({statuses[b].reason})" for b in names if not statuses[b].available]
        if missing:
            print(f"optirs bench: not available here: {'; '.join(missing)}", file=sys.stderr)
            return 2
    else:
        names, notes = default_backends(statuses)
        if not names:
            print("optirs bench: no backend is available here (optirs info says why)", file=sys.stderr)
            return 2
    from rich.console import Console

    from optirs.tools.cli import plain_console

    console = plain_console()
    progress = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
    report = Report(datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    platform.node(), _versions())
    sizings = {n: sizing_for(args, statuses[n]) for n in names}
    progress.print("optirs bench: " + "; ".join(f"{n} at {z.profile} sizes (scale {z.size_scale:g}, {z.reps} steps x "
                                                f"{z.repeats} batches)" for n, z in sizings.items())
                   + "".join(f"\n  left out: {n}" for n in notes), markup=False, highlight=False)
    try:
        with _CtrlC():
            run(args, console, report, statuses, names, progress)
    except KeyboardInterrupt:
        report.interrupted = True
    report.interrupted = report.interrupted or _INTERRUPTED.is_set()
    print_report(report, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=1, default=float)
        console.print(f"wrote {args.json}", markup=False, highlight=False)
    if args.plot and report.rows:
        write_plot(report, args.plot)
        console.print(f"wrote {args.plot}", markup=False, highlight=False)
    if report.interrupted:
        return 130
    failed = [k for k, v in report.checks.items() if v.startswith("FAILED")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
