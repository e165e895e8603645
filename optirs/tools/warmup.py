"""``optirs warmup``: compile, or load from the disk cache, the kernels some optimizers and step
formats need, so that a training job's first step does not wait for the compiler.

Each case steps a few tiny arrays twice through the seed API (the second step of a format runs
another kernel than the first: a fresh state is a constant of the compiled loop) and reports whether
it compiled anything. Kernels are specialised per backend, optimizer, format and the state slots
the hyperparameters use (AMSGrad's max, SGD's momentum): the optimizer's benchmark hyperparameters
(``optirs bench``'s) stand for the usual ones. Run it where the cache lives (an image build, a CI
cache step); docs/compile_cache.md.

    optirs warmup                                   # adamw, every format, backend="auto"
    optirs warmup --backend cpu --optimizer adamw sgd --format float32 bf16-masters+int8-state
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from optirs.core.errors import (BackendUnavailableError, GpuOptimError, InvalidParameterError,
                                UnsupportedOperationError)

# The parameters' half of a format name: parameter dtype and the Precision fields it sets.
PARAM_FORMATS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "float32": ("float32", {}),
    "bf16": ("bfloat16", {}),
    "bf16-stochastic": ("bfloat16", {"stochastic_rounding": True}),
    "bf16-masters": ("bfloat16", {"master_weights": "float32"}),
    "bf16-remainder16": ("bfloat16", {"master_weights": "remainder16"}),
    "bf16-remainder8": ("bfloat16", {"master_weights": "remainder8"}),
    "fp16": ("float16", {}),
    "fp16-masters": ("float16", {"master_weights": "float32"}),
}
# The state's half: "" is float32 state.
STATE_FORMATS: Dict[str, str] = {"": "float32", "bf16-state": "bfloat16", "int8-state": "int8"}


class WarmupFormat(NamedTuple):
    """A named step format (docs/formats.md): parameter dtype, master weights, state dtype, rounding."""

    name: str
    param_dtype: str
    precision: Dict[str, Any]


def _format_table() -> Dict[str, WarmupFormat]:
    out = {}
    for pname, (dtype, fields) in PARAM_FORMATS.items():
        for sname, state in STATE_FORMATS.items():
            name = pname if not sname else sname if pname == "float32" else f"{pname}+{sname}"
            out[name] = WarmupFormat(name, dtype, dict(fields, state_dtype=state))
    return out


FORMATS = _format_table()
# A 2-d tensor above the int8 threshold (4096 elements; its last 256-block short), a 1-d one and a
# small 2-d one below it: every buffer kind of the formats runs, in the shapes of a model's layers.
SHAPES = ((70, 61), (300,), (17, 9))


class CaseResult(NamedTuple):
    optimizer: str
    format: str
    seconds: float
    compiled: int  # kernels compiled: the compile log's records (optirs.core.compile_cache)
    compile_seconds: float

    @property
    def label(self) -> str:
        return f"{self.optimizer} {self.format}"

    @property
    def outcome(self) -> str:
        if self.compiled:
            return f"compiled {self.compiled} kernel{'s' if self.compiled > 1 else ''} ({self.compile_seconds:.1f} s)"
        return "loaded from cache"  # no compile reported: see docs/compile_cache.md for CUDA and OpenCL


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="optirs warmup", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="compile (or load from the disk cache) the kernels of some optimizers and step formats, "
                    "so that a first step does not wait for the compiler",
        epilog="formats: " + ", ".join(FORMATS) + "\n(params[+state]: bf16/fp16 parameters, with float32 "
               "masters, remainder16/remainder8 masters or stochastic rounding; bf16 or int8 state)")
    ap.add_argument("--backend", default="auto", help="a backend name or 'auto' (default: auto)")
    ap.add_argument("--optimizer", dest="optimizers", action="extend", nargs="+", metavar="NAME",
                    help="optimizers to warm (several allowed; default: adamw)")
    ap.add_argument("--format", dest="formats", action="extend", nargs="+", metavar="FORMAT",
                    help="step formats to warm (several allowed; default: every format the backend runs "
                         "for the optimizer)")
    return ap


def _backend(name: str) -> str:
    """The backend to open: a known name that opens here, or what 'auto' picks.

    :raises BackendUnavailableError: an unknown name, a backend that does not open here, or none for 'auto'.
    """
    from optirs.plugin.registry import REGISTRY, choose_auto

    if name == "auto":
        choice = choose_auto()
        if choice.name is None:
            raise BackendUnavailableError(f"no backend opens here: {choice.reason}")
        return choice.name
    known = REGISTRY.backend_names()
    if name not in known:
        raise BackendUnavailableError(f"unknown backend {name!r}; known backends: {', '.join(known)}, auto")
    probe = REGISTRY.probe(name)
    if not probe.available:
        raise BackendUnavailableError(f"backend {name!r} is unavailable here: {probe.reason}")
    return name


def plan(backend: str, optimizers: Sequence[str], formats: Optional[Sequence[str]]) -> List[Tuple[str, str]]:
    """The (optimizer, format) cases to run, checked against the backend's step support first.

    :raises InvalidParameterError: an unknown optimizer or format.
    :raises UnsupportedOperationError: an optimizer or format the backend does not step.
    """
    from optirs.core.definitions import DEFINITIONS
    from optirs.plugin.registry import REGISTRY

    support = REGISTRY.step_support(backend)
    for name in optimizers:
        if name not in DEFINITIONS:
            raise InvalidParameterError(f"unknown optimizer {name!r}; known optimizers: {', '.join(DEFINITIONS)}")
        if name not in support.optimizers:
            raise UnsupportedOperationError(
                f"backend {backend!r} does not step {name}; it steps {', '.join(support.optimizers)}")
    for fmt in formats or ():
        if fmt not in FORMATS:
            raise InvalidParameterError(f"unknown format {fmt!r}; known formats: {', '.join(FORMATS)}")
    cases = []
    for name in optimizers:
        runs_formats = name in support.formats
        if formats is None:
            wanted = list(FORMATS) if runs_formats else ["float32"]
        else:
            wanted = list(formats)
            refused = [f for f in wanted if f != "float32" and not runs_formats]
            if refused:
                raise UnsupportedOperationError(
                    f"backend {backend!r} steps {name} in float32 only, not in {', '.join(refused)}")
        cases.extend((name, f) for f in wanted)
    return cases


def run_case(backend: str, optimizer: str, fmt: str, seed: int = 0) -> CaseResult:
    """Two steps of ``optimizer`` in format ``fmt`` on tiny arrays, on ``backend``."""
    import ml_dtypes
    import numpy as np

    import optirs
    from optirs import GpuOptimizerConfig, Precision
    from optirs.core.compile_cache import compile_records
    from optirs.core.definitions import DEFINITIONS

    spec = FORMATS[fmt]
    dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[spec.param_dtype]
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s).astype(np.float32).astype(dtype) for s in SHAPES]
    grads = [(rng.standard_normal(s) * 0.1).astype(np.float32).astype(dtype) for s in SHAPES]
    before = len(compile_records())
    t0 = time.perf_counter()
    opt = optirs.OPTIMIZERS[optimizer](DEFINITIONS[optimizer].benchmark_params(), GpuOptimizerConfig(backend),
                                       precision=Precision(**spec.precision))
    opt.step_gpu(params, grads)
    opt.step_gpu(params, grads)
    seconds = time.perf_counter() - t0
    new = compile_records()[before:]
    return CaseResult(optimizer, fmt, seconds, len(new), sum(r.seconds for r in new))


def main(argv: List[str]) -> int:
    args = _parser().parse_args(argv)
    from rich.console import Console

    err = Console(stderr=True)
    try:
        backend = _backend(args.backend)
        cases = plan(backend, args.optimizers or ["adamw"], args.formats)
    except GpuOptimError as exc:  # what the arguments ask for, refused before anything compiles
        err.print(f"optirs warmup: {exc}", markup=False, highlight=False)
        return 2
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from optirs.core.compile_cache import prepare_kernel_compilation

    console = Console()
    location = prepare_kernel_compilation()  # the compile events tell "compiled" from "loaded"
    console.print(f"optirs warmup on {backend}: {len(cases)} cases; kernels cache in {location.where}",
                  markup=False, highlight=False)
    if not location.persistent:
        err.print(f"optirs warmup: {location.reason}: what this compiles is lost at exit", markup=False)
    results: List[CaseResult] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("warming", total=len(cases))
        for optimizer, fmt in cases:
            progress.update(task, description=f"{optimizer} {fmt}")
            try:
                results.append(run_case(backend, optimizer, fmt))
            except Exception as exc:  # a case the checks above did not refuse: say which, and stop
                progress.stop()
                err.print(f"optirs warmup: {optimizer} {fmt} on {backend} failed: {type(exc).__name__}: {exc}",
                          markup=False, highlight=False)
                return 1
            progress.advance(task)
    table = Table(title=f"optirs warmup ({backend})")
    for col, justify in (("case", "left"), ("seconds", "right"), ("kernels", "left")):
        table.add_column(col, justify=justify)
    for r in results:
        table.add_row(r.label, f"{r.seconds:.2f}", r.outcome)
    console.print(table)
    compiled = sum(1 for r in results if r.compiled)
    console.print(f"{compiled} of {len(results)} cases compiled, {len(results) - compiled} loaded from the cache; "
                  f"{sum(r.seconds for r in results):.1f} s in all", markup=False, highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
