"""optirs.torch.CPUOffload: the optimizer state and fp32 master weights in host memory, the step
on a host backend (``cpu``: any backend whose arrays are host memory that torch CPU tensors view
without a copy), the parameters and gradients where they are (a GPU).

``CPUOffload(ot.AdamW, model.parameters(), lr=1e-3)`` is a ``torch.optim.Optimizer``:
``param_groups`` (schedulers drive them), ``step(closure)``, ``zero_grad``, ``state_dict`` in the
wrapped optimizer's torch format, ``add_param_group``, GradScaler both ways, every step format of
the front end (``state_dtype="int8"``, ``master_weights=...``). Under it:

- the parameters are cut into *chunks* (per param group and dtype, in backward order, about
  ``bucket_elements`` elements each); every chunk has host copies of its parameters, a host
  gradient buffer and its own inner optirs.torch optimizer over the host copies (DIRECT, FUSED and
  WIDEN below say how 16-bit parameters and their masters are held);
- a post-accumulate-grad hook per parameter copies its gradient device-to-host as soon as
  autograd has it, in its own dtype, on a side stream ordered after the current one, into a
  pinned buffer, and records a fingerprint of it on the device (CPU tensors are copied in
  ``step()`` instead: a host copy is synchronous);
- a pool of worker threads runs a chunk's CPU step once its gradients have arrived (numba's
  parallel kernels release the GIL), then copies the updated parameters back on another stream;
- ``step()`` waits for what is still in flight and makes the current stream wait for the
  host-to-device copies.

When the CPU steps start (see docs/offload.md): by default at ``step()`` (the gradient copies
overlap the backward; the steps and the copies back overlap each other), which keeps every
torch contract (GradScaler, gradients clipped, unscaled or edited after backward, through
``.data`` or a numpy view too: a gradient whose tensor, version or fingerprint changed after its
copy is copied again). ``step_in_backward=True`` starts a chunk's step in the backward that
completes its gradients (the ``accumulation_steps``-th backward since the last step),
overlapping the CPU step with the rest of the backward; the gradients must then be final when
autograd writes them.

DTensor parameters (FSDP2's ``fully_shard``, tensor parallel) are offloaded shard by shard: the
host copies are each rank's local shards, the hooks copy the gradients' local shards (FSDP2 calls
the hooks of its sharded parameters after its reduce-scatter), the new values are copied into the
local tensors, and ``opt.state`` / ``state_dict`` show the state as DTensors over the host
buffers, placed as the parameters, for torch.distributed.checkpoint (docs/offload.md, "FSDP2").

A step is all or nothing where it can be: everything is checked before anything is stepped, a
chunk whose step fails holds back the chunks not yet started, and the error says what was
stepped (docs/offload.md, "Interrupted steps").
"""

from __future__ import annotations

import inspect
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from optirs.core.errors import (DeviceMemoryError, GpuOptimError, InvalidParameterError, PluginError,
                                ShapeMismatchError, UnsupportedOperationError)
from optirs.core.host_pages import advise_huge_pages
from optirs.core.interrupts import deferred_interrupts
from optirs.core.layout import TensorLayout
import optirs.torch.optimizers as _optimizers
from optirs.core.definitions import DEFINITIONS
from optirs.core.formats import INT8_STATES, resolve_format
from optirs.plugin import hookspecs
from optirs.plugin.hookspecs import Staged
from optirs.torch._dtensor import held, hosted, is_dtensor, local, refusal, sharded
from optirs.torch._gil import responsive_gil
from optirs.torch._frontend import OptirsOptimizer, check_flags, closure_and_amp
from optirs.torch._state import plain
from optirs.torch._stepcall import observed_step

OFFLOAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements per chunk: large enough that a chunk's fixed cost is small beside its CPU step, small
# enough that the first chunks are ready early in backward. The fixed cost is host time in which
# no CPU step runs (one front-end step, the next worker's turn, a few copy calls: 0.3-0.4 ms a
# chunk on the H200 host); for GPT-2 1.3B, 64M elements (21 chunks) left 8-11 ms of such gaps a
# step where 4M (99 chunks) left 18-26 (docs/benchmarks.md, 2026-12-04 19:49).
DEFAULT_BUCKET_ELEMENTS = 1 << 26
DEFAULT_WORKERS = 2
_GROUP_ONLY = ("params", "param_names")
# state_dict key of a 16-bit parameter's fp32 master weights: the front end's own key for its
# float32-master format, so checkpoints are the same whichever way the chunk steps.
MASTER_KEY = "master"


def resolve_optimizer_class(optimizer_class: Any) -> type:
    """An optirs.torch optimizer class, given as the class or its name (``"AdamW"``, ``"adamw"``)."""
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, OptirsOptimizer):
        return optimizer_class
    names = {n.lower(): n for n in _optimizers.__all__}
    if isinstance(optimizer_class, str) and optimizer_class.lower() in names:
        return getattr(_optimizers, names[optimizer_class.lower()])
    raise InvalidParameterError(
        f"optimizer_class={optimizer_class!r}, expected an optirs.torch optimizer class or one of the names "
        f"{sorted(_optimizers.__all__)}"
    )


def _pins(device: torch.device) -> bool:
    """Whether host buffers that a transfer touches are pinned: only CUDA copies gain from it."""
    return device.type == "cuda"


def _allocate(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """torch's host allocation (pinned through cudaHostAlloc where ``pin``): the one call that can run out.
    Ordinary memory asks for huge pages before anything writes it (optirs.core.host_pages)."""
    t = torch.empty(numel, dtype=dtype, pin_memory=pin)
    if not pin:
        advise_huge_pages(t.data_ptr(), t.numel() * t.element_size())
    return t


def _host_empty(numel: int, dtype: torch.dtype, pin: bool, what: str) -> torch.Tensor:
    try:
        return _allocate(numel, dtype, pin)
    except (RuntimeError, MemoryError) as exc:
        # torch reports a failed host or pinned allocation as RuntimeError or one of its subclasses
        # (torch.OutOfMemoryError, torch.AcceleratorError for a CUDA error from cudaHostAlloc);
        # numpy-backed allocations as MemoryError.
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        kind = "pinned host memory" if pin else "host memory"
        raise DeviceMemoryError(
            f"could not allocate {nbytes} bytes of {kind} for {what} ({numel} x {dtype}): "
            f"{type(exc).__name__}: {exc}") from exc


HOST_VIEW_HOOK = "optirs_host_view"
_HOOKS = frozenset(n for n in vars(hookspecs) if n.startswith("optirs_"))


def _raised_in(exc: BaseException) -> Tuple[Optional[str], Any]:
    """(the hook ``exc`` was raised in, its frame), or (None, None): the innermost frame of its
    traceback named after a hook (pluggy binds a hook implementation by its name)."""
    hook, frame = None, None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name in _HOOKS:
            hook, frame = tb.tb_frame.f_code.co_name, tb.tb_frame
        tb = tb.tb_next
    return hook, frame


def _plugin_named(frame: Any, fallback: str) -> str:
    """The registry's name of the plugin whose hook runs in ``frame`` (``fallback`` if none matches)."""
    from optirs.plugin.registry import REGISTRY

    owner = frame.f_locals.get("self") if frame is not None else None
    module = frame.f_globals.get("__name__") if frame is not None else None
    for name, record in list(REGISTRY.records.items()):
        plugin = record.plugin
        if plugin is not None and (plugin is owner or getattr(plugin, "__name__", None) == module):
            return name
    return fallback


def _plugin_failure(backend_name: str, exc: BaseException, hook: Optional[str] = None) -> BaseException:
    """``exc`` as optirs reports it: optirs' own errors as they are; an exception out of a plugin's
    hook (found in its traceback, else ``hook`` when given) as a PluginError naming the plugin and
    the hook, whose ``__cause__`` is the original; anything else as it is."""
    if isinstance(exc, GpuOptimError) or not isinstance(exc, Exception):
        return exc
    found, frame = _raised_in(exc)
    if found is None and hook is None:
        return exc
    error = PluginError(f"plugin {_plugin_named(frame, backend_name)!r} raised {type(exc).__name__} in "
                        f"{found or hook}: {exc}")
    error.__cause__ = exc
    return error


def _host_backend(name: Any, options: Optional[Dict[str, Any]], probe: OptirsOptimizer):
    """The backend that steps the host copies: any whose arrays are host memory that torch CPU
    tensors view without a copy (it implements ``optirs_host_view``), as the front end opens it.
    A plugin failing to open, to view or to stage is a PluginError naming it and the hook, now."""
    from optirs.plugin.registry import REGISTRY

    def require(backend) -> None:
        try:
            view = backend.host_view(np.zeros(2, np.float32))
        except Exception as exc:
            raise _plugin_failure(backend.name, exc, HOST_VIEW_HOOK) from exc
        if view is None:
            raise UnsupportedOperationError(
                f"backend {backend.name!r} does not offer zero-copy host views (hook {HOST_VIEW_HOOK}), expected a "
                "backend whose arrays are host memory that torch CPU tensors view without a copy (backend='cpu'): "
                "CPUOffload steps the host copies in place")
        _check_stage(backend)

    named = isinstance(name, str) and name != "auto"
    try:
        if named:
            require(REGISTRY.get_backend(name, options))  # named: the missing capability is the answer
        backend = probe.backend_for(torch.device("cpu"))  # the front end's own checks (it steps torch CPU tensors)
    except Exception as exc:
        raise _plugin_failure(str(name), exc, "optirs_open") from exc
    require(backend)
    return backend


def _check_stage(backend: Any) -> None:
    """The backend's ``optirs_stage`` on two tiny host arrays, no step (so no ``finish``): a plugin
    that raises or answers with something other than a Staged is named here, before any step."""
    params, grads = [np.zeros(2, np.float32)], [np.zeros(2, np.float32)]
    with backend.lock:
        try:
            staged = backend.stage(backend.ctx, params, grads, None)
        except Exception as exc:
            raise _plugin_failure(backend.name, exc, "optirs_stage") from exc
    try:
        ok = (isinstance(staged, Staged) and len(staged.params) == 1 and len(staged.grads) == 1
              and (staged.finish is None or callable(staged.finish)))
    except TypeError:  # params or grads without a length
        ok = False
    if not ok:
        raise PluginError(
            f"plugin {backend.name!r}'s optirs_stage returned {staged!r} for 1 parameter and 1 gradient, expected "
            "an optirs.plugin.hookspecs.Staged holding 1 of each")


def _amp_value(value: Any, what: str) -> float:
    """A GradScaler value (``grad_scale`` / ``found_inf``) as a float: a number or a 1-element tensor
    (read on the host: a device tensor synchronises, as torch's non-capturable optimizers do)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise InvalidParameterError(
                f"{what} is a tensor of {value.numel()} elements (shape {tuple(value.shape)}), expected a 1-element "
                "tensor (torch.amp.GradScaler's)")
        if value.is_complex():
            raise InvalidParameterError(f"{what} is a {value.dtype} tensor, expected a real one")
        return float(value.item())
    if isinstance(value, (bool, int, float, np.integer, np.floating, np.bool_)):
        return float(value)
    raise InvalidParameterError(f"{what}={value!r}, expected None, a number or a 1-element tensor")


def _sparse_gradient(gi: int, j: int) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"param_groups[{gi}]['params'][{j}] has a sparse gradient, expected a dense one: use optirs.SparseAdam / "
        "optirs.SparseSgd (or torch.optim.SparseAdam) for sparse gradients")


def _event(timing: bool = False) -> Any:
    """A CUDA event whose host-side wait blocks the waiting thread instead of spinning on a core: a
    worker waiting for a gradient copy must not take a core from the CPU step running beside it
    (the cpu backend's parallel loops use every core, and one busy core stalls the whole loop)."""
    return torch.cuda.Event(enable_timing=timing, blocking=True)


@contextmanager
def _numba_threads(limit: Optional[int]) -> Any:
    """At most ``limit`` of numba's threads for the calling thread's parallel steps (numba's count is
    per launching thread, so steps launched by other threads keep theirs)."""
    if limit is None:
        yield
        return
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(min(limit, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(before)


# How step() knows that a gradient's host copy is still the gradient (docs/offload.md, "Gradients
# edited after backward"). A version counter misses edits through ``.data``, a numpy view, DDP's
# bucket views or a kernel writing the memory, so neither mode trusts it alone:
# - COPY_AT_STEP: host tensors (no CUDA), steps at step(): the copy is synchronous, so nothing is
#   gained by copying in backward; step() copies every gradient, after the caller's last edit.
# - FINGERPRINT: the hook records a fingerprint of each gradient on its device as it starts the
#   copy; step() computes it again and copies again what differs (with step_in_backward=True, where
#   the copy may already have been stepped, a difference is an error).
COPY_AT_STEP, FINGERPRINT = "copy-at-step", "fingerprint"


def _gradient_check(device: torch.device, step_in_backward: bool) -> str:
    """COPY_AT_STEP or FINGERPRINT for gradients on ``device``."""
    return COPY_AT_STEP if device.type == "cpu" and not step_in_backward else FINGERPRINT


_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _fingerprint(g: torch.Tensor, out: torch.Tensor) -> None:
    """Two reductions of ``g`` on its own device (queued on the current stream), into ``out`` (2 x int64):
    the wrapping int64 sum of its bit patterns, which any change of a single element moves (and a
    scaling, a clamp, an all-reduce), and the index of its first maximum, which a sign flip moves
    where the bit sum can stay (as many positive as negative elements), as any position-free sum
    must (``-[1, -1]`` holds the same values). No temporaries: the cast happens inside the reduction."""
    flat = g.detach().reshape(-1)
    if flat.numel() == 0:
        out.zero_()
        return
    torch.sum(flat.view(_BITS[flat.dtype]), 0, dtype=torch.int64, out=out[0])
    torch.argmax(flat, 0, out=out[1])


def _words(t: torch.Tensor) -> Any:
    """An integer tensor as the fingerprint capability takes it: a CPU tensor's numpy view, a device
    tensor itself (its ``__cuda_array_interface__``)."""
    return t.numpy() if t.device.type == "cpu" else t


def _gradient_words(g: torch.Tensor) -> Any:
    """A gradient's bit words, flat, as the fingerprint capability takes them (:func:`_words`)."""
    return _words(g.detach().reshape(-1).view(_BITS[g.dtype]))


def _fingerprint_backend(device: torch.device) -> Optional[Tuple[Any, Callable[..., None]]]:
    """(backend, its optirs_fingerprint) for gradients on ``device``: the optirs backend that serves
    torch tensors there with the ``fingerprint`` capability and takes a probe of it; None where none
    does (torch's two reductions per gradient then: the same check, slower)."""
    from optirs.torch._frontend import _open_backend

    try:
        backend = _open_backend("auto", {}, device.type)
        if not backend.supports("fingerprint"):
            return None
        hook = backend.hook("fingerprint", "optirs_fingerprint")
        words = torch.zeros(4, dtype=torch.int32, device=device)
        hook(backend.ctx, [_words(words)], _words(torch.zeros((1, 2), dtype=torch.int64, device=device)), [0])
    except Exception:  # noqa: BLE001 - no backend, another device, a plugin's refusal: torch's reductions
        return None
    return backend, hook


class OffloadTiming:
    """Where the offload's time goes, summed over steps: ``opt.timing = OffloadTiming()`` turns it on.

    - ``cpu_step_s``: the inner optimizers' steps (wall time of each chunk's step call, the front
      end's few microseconds per chunk included), ``step_bytes`` the bytes those steps touch (every
      array read once, the parameters and the state also written once);
    - ``convert_s``: separate 16-bit <-> fp32 passes on the host (only the WIDEN chunks of an
      optimizer without step formats have them; the fused formats step converts in its own pass);
    - ``d2h_s`` / ``h2d_s``: the copies' busy time (CUDA events around each; the host copies' wall
      time without CUDA) and ``d2h_bytes`` / ``h2d_bytes``;
    - ``wait_d2h_s``: workers blocked on gradient copies that had not landed when the chunk's step
      could start (transfer time that nothing hid);
    - ``h2d_tail_s``: after the last CPU step, the wait until every copy back had landed (the
      transfer time left after the CPU work; measured with a host wait, so only while timing);
    - ``check_s``: in ``step()``, the gradients' fingerprints computed again and compared, the wait
      for the device to reach ``step()`` included (docs/offload.md);
    - ``early_chunks``: chunk steps that started before ``step()`` (``step_in_backward=True``);
    - ``step_call_s``: wall time inside ``step()``: what the caller waited.

    Event timing adds a synchronisation at the end of each step: time steps without it.

    ``OffloadTiming(timeline=True)`` also keeps, for the last step, each chunk's times on the host
    clock relative to the call of ``step()`` (:meth:`timeline_rows`: when its gradients had landed,
    its CPU step's start and end, when its copy back was queued; its copies' busy time and bytes)
    and :meth:`timeline_summary` sets the chunks stepped in backward beside those stepped after it.
    """

    FIELDS = ("cpu_step_s", "convert_s", "d2h_s", "h2d_s", "wait_d2h_s", "h2d_tail_s", "check_s", "step_call_s",
              "step_bytes", "d2h_bytes", "h2d_bytes", "early_chunks", "steps")
    # a chunk's timeline entries: host times (made relative to the step() call when the round
    # closes) and its element count are set; the rest (copy times, bytes) add up
    TIMES = ("ready", "step_start", "step_end", "h2d_queued")
    _SET = TIMES + ("elements",)

    def __init__(self, timeline: bool = False) -> None:
        self._lock = threading.Lock()
        self.timeline = bool(timeline)
        self.reset()

    def reset(self) -> None:
        for f in self.FIELDS:
            setattr(self, f, 0)
        self._pairs: List[Tuple[str, Any, Any, int]] = []
        self._round: Dict[int, Dict[str, float]] = {}  # this round's chunks (timeline)
        self.last: Dict[int, Dict[str, float]] = {}  # the last finished step's, times from its step() call

    def add(self, field: str, amount: float) -> None:
        with self._lock:
            setattr(self, field, getattr(self, field) + amount)

    def mark(self, chunk: int, **values: float) -> None:
        """Timeline: set chunk ``chunk``'s host times (:attr:`TIMES`, ``time.perf_counter()``) and
        ``elements``, or add to its sums (copy times in ms, bytes)."""
        if not self.timeline:
            return
        with self._lock:
            row = self._round.setdefault(chunk, {})
            for key, value in values.items():
                row[key] = value if key in self._SET else row.get(key, 0.0) + value

    def copied(self, kind: str, seconds: float, chunk: int) -> None:
        """A copy's busy time: added to ``kind`` (``"d2h_s"`` / ``"h2d_s"``) and to chunk ``chunk``'s
        timeline (``d2h_ms`` / ``h2d_ms``)."""
        self.add(kind, seconds)
        self.mark(chunk, **{kind[: -len("_s")] + "_ms": 1e3 * seconds})

    def events(self, kind: str, chunk: int) -> Tuple[Any, Any]:
        start, end = _event(timing=True), _event(timing=True)
        with self._lock:
            self._pairs.append((kind, start, end, chunk))
        return start, end

    def settle(self, called: Optional[float] = None) -> None:
        """Add the event pairs' times; with ``called`` (the step() call's host time), close the
        round's timeline."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for kind, start, end, chunk in pairs:
            end.synchronize()
            self.copied(kind, start.elapsed_time(end) / 1e3, chunk)
        if called is not None and self.timeline:
            with self._lock:
                rows, self._round = self._round, {}
            self.last = {c: {k: 1e3 * (v - called) if k in self.TIMES else v for k, v in row.items()}
                         for c, row in sorted(rows.items())}

    def timeline_rows(self) -> List[Dict[str, float]]:
        """The last step's chunks: ``chunk``, ``elements``, ``ready`` / ``step_start`` / ``step_end``
        / ``h2d_queued`` (ms from the step() call; negative: in backward), ``d2h_ms`` / ``h2d_ms``
        (the copies' busy time), ``step_bytes`` / ``h2d_bytes``."""
        return [dict(chunk=c, **row) for c, row in self.last.items()]

    def timeline_summary(self) -> Dict[str, Any]:
        """The last step's chunks stepped in backward (started before step()) beside those stepped
        after it: how many, their elements, CPU step ms and ns an element, the step's bytes/s, the
        copies back's GB/s; from the step() call, when the first CPU step started and the last one
        ended, and the time between them with no CPU step running."""
        rows = [r for r in self.timeline_rows() if "step_end" in r]
        out: Dict[str, Any] = {"chunks": len(rows)}
        for label, part in (("in_backward", [r for r in rows if r["step_start"] < 0]),
                            ("after", [r for r in rows if r["step_start"] >= 0])):
            cpu = sum(r["step_end"] - r["step_start"] for r in part)
            elements = sum(r.get("elements", 0) for r in part)
            h2d_ms = sum(r.get("h2d_ms", 0.0) for r in part)
            d = {"chunks": len(part), "elements": elements, "cpu_ms": cpu}
            if elements and cpu > 0:
                d["cpu_ns_per_element"] = 1e6 * cpu / elements
                d["cpu_GBps"] = sum(r.get("step_bytes", 0.0) for r in part) / cpu / 1e6
            if h2d_ms > 0:
                d["h2d_GBps"] = sum(r.get("h2d_bytes", 0.0) for r in part) / h2d_ms / 1e6
            out[label] = d
        if rows:
            out["first_step_start_ms"] = min(r["step_start"] for r in rows)
            out["last_step_end_ms"] = max(r["step_end"] for r in rows)
            # host time between the first CPU step's start and the last one's end with no step running
            idle, reach = 0.0, None
            for r in sorted(rows, key=lambda r: r["step_start"]):
                if reach is not None and r["step_start"] > reach:
                    idle += r["step_start"] - reach
                reach = r["step_end"] if reach is None else max(reach, r["step_end"])
            out["idle_between_steps_ms"] = idle
        return out

    def as_dict(self) -> Dict[str, float]:
        return {f: getattr(self, f) for f in self.FIELDS}


# How a chunk's tensors are held on the host (docs/offload.md, "How a step runs"):
# - DIRECT: float32 parameters. The inner optimizer steps pinned float32 host copies (the masters)
#   with pinned float32 gradients; its state format is the caller's (float32, bfloat16, int8).
# - FUSED: 16-bit parameters through the formats capability. The inner optimizer steps pinned
#   16-bit host copies with pinned 16-bit gradients in the 16-bit-parameter format (float32 masters
#   by default): one pass reads the 16-bit gradients, updates the masters and the state and writes
#   the 16-bit parameters, so nothing is widened or narrowed on its own.
# - WIDEN: 16-bit parameters stepped as float32 masters: float32 masters and gradients in ordinary
#   memory, a pinned 16-bit staging buffer, and a conversion pass each way. The same bits as FUSED
#   with float32 masters (the same per-element math), a third more bytes (40 a parameter against
#   30): asked for by fuse_conversions=False (half the pinned bytes: a staging buffer both ways),
#   and the only way for an optimizer without step formats (Adafactor).
DIRECT, FUSED, WIDEN = "direct", "fused", "widen"


class _Chunk:
    """One CPU step's worth: some tensors of one param group with one dtype, their host buffers,
    the inner optimizer over their host copies, and this round's transfer bookkeeping."""

    def __init__(self, index: int, gi: int, params: List[torch.Tensor], positions: List[int], pin: bool, mode: str):
        self.index, self.gi, self.params, self.positions = index, gi, params, positions
        self.dtype, self.mode = params[0].dtype, mode
        # a DTensor's host copy is this rank's shard; each tensor at its layout offset (a multiple of
        # 8 elements, so the cpu loops' vectors start on their grid; gaps between)
        layout = TensorLayout([tuple(local(p).shape) for p in params])
        total = layout.total
        where = f"param_groups[{gi}] ({len(params)} tensors, {int(layout.sizes.sum())} elements)"
        # Pinned is what a transfer touches: the gradient buffer copied into and the parameter
        # copies copied back (DIRECT, FUSED), or only the 16-bit staging buffer (WIDEN).
        if mode == WIDEN:
            self.host_flat = _host_empty(total, torch.float32, False, f"the fp32 masters of {where}")
            self.grad_flat = _host_empty(total, torch.float32, False, f"the fp32 gradients of {where}")
            self.staging_flat = _host_empty(total, self.dtype, pin, f"the {self.dtype} staging of {where}")
        else:
            self.host_flat = _host_empty(total, self.dtype, pin, f"the {self.dtype} parameter copies of {where}")
            self.grad_flat = _host_empty(total, self.dtype, pin, f"the {self.dtype} gradients of {where}")
            self.staging_flat = None
        self.host = layout.views(self.host_flat)  # the inner optimizer's parameters
        self.grads = layout.views(self.grad_flat)  # ... and their gradients
        self.staging = None if self.staging_flat is None else layout.views(self.staging_flat)
        self.landing = self.grads if self.staging is None else self.staging  # where a gradient copy lands
        self.outbound = self.host if self.staging is None else self.staging  # what is copied back
        self.inner: Optional[OptirsOptimizer] = None
        self.row = 0  # tensor k's fingerprints are row ``row + k`` of the optimizer's tables
        # (version, data_ptr) of each parameter when its host copy last matched it: anything else
        # (model.load_state_dict, an in-place edit) means the host copy is read again from it.
        self.marks: List[Tuple[int, int]] = [(-1, -1)] * len(params)
        self.reset_round()

    def pinned_bytes(self) -> int:
        bufs = (self.staging_flat,) if self.mode == WIDEN else (self.host_flat, self.grad_flat)
        return sum(b.numel() * b.element_size() for b in bufs)

    def master(self, k: int) -> Optional[torch.Tensor]:
        """Tensor k's float32 master on the host (None where the format keeps none as a float32 tensor)."""
        if self.mode != FUSED:
            return self.host[k]
        entry = self.inner.state.get(self.host[k]) if self.inner is not None else None
        return entry.get("master") if entry else None

    def resync(self, k: int) -> None:
        """Read tensor k's host copy again from its parameter if the parameter was written since."""
        p = local(self.params[k])  # (a DTensor's local tensor: FSDP2 may give it new memory)
        if (p._version, p.data_ptr()) == self.marks[k]:
            return
        with torch.no_grad():
            self.host[k].copy_(p.detach())
            if self.mode == FUSED:
                # the format's master follows the parameter that was written (a fresh state reads
                # it from the parameter at its first step anyway)
                entry = self.inner.state.get(self.host[k]) if self.inner is not None else None
                if entry:
                    if "master" in entry:
                        entry["master"].copy_(p.detach())
                    if "master_remainder" in entry:
                        entry["master_remainder"].zero_()  # master == the parameter
        self.mark(k)

    def mark(self, k: int) -> None:
        """Tensor k's host copy matches its parameter now."""
        p = local(self.params[k])
        self.marks[k] = (p._version, p.data_ptr())

    def step_bytes(self, present: List[int]) -> int:
        """What one step of tensors ``present`` touches: gradients read; parameters and every state
        tensor (masters, moments, codes, scales) read and written."""
        total = 0
        for k in present:
            total += self.grads[k].numel() * self.grads[k].element_size()
            total += 2 * self.host[k].numel() * self.host[k].element_size()
            for key, v in (self.inner.state.get(self.host[k]) or {}).items():
                if key != "step" and isinstance(v, torch.Tensor):
                    total += 2 * v.numel() * v.element_size()
        return total

    def reset_round(self) -> None:
        n = len(self.params)
        self.fires = [0] * n  # backward passes that wrote this tensor's gradient since the last step
        self.sent: List[Optional[Tuple[Any, int]]] = [None] * n  # (weakref to the gradient copied, its version)
        self.events: List[Any] = [None] * n  # CUDA events: that copy has landed
        self.future = None  # the chunk's step, when it started in backward
        self.progress = 0  # 1: host copies and state stepped this round; 2: also copied back
        self.h2d_event = None
        self.counts: Optional[Tuple[Any, ...]] = None  # CPUOffload._counts just before this round's step



def _settle_at_end_of_backward(future: Future) -> None:
    """Make the backward running now return only after ``future`` (a chunk step it started) is done.

    The chunk's worker writes the new parameters (on CUDA, queues their copy), which moves their
    version counters. Were it still running when backward returns, it would race whatever the
    caller does next: a forward saving those parameters for another backward (which torch then
    refuses with its in-place RuntimeError, before this optimizer's hooks could refuse the extra
    backward themselves), or that forward reading half-written parameters. Waiting here orders
    the writes before the caller's next line on every run; the usual step() after backward would
    wait for them anyway. The callback never raises: step() reports the chunk's failure."""
    torch.autograd.Variable._execution_engine.queue_callback(lambda: wait([future]))

class CPUOffload(torch.optim.Optimizer):
    """An optirs.torch optimizer whose fp32 masters and state live in host memory.

    Args:
        optimizer_class: an optirs.torch optimizer class (``AdamW``, ``SGD``, ...) or its name.
        params: the model's parameters or param groups (float32, bfloat16 or float16, one device;
            plain tensors or DTensors with Shard / Replicate placements).
        workers: worker threads running chunk steps and transfers (default 2: the host passes run one
            at a time, each on every core; a second worker waits for copies and queues transfers
            meanwhile).
        accumulation_steps: backward passes per step; gradients are copied only in the last one.
        fuse_conversions: for 16-bit parameters with float32 masters: True or None (default) steps
            them through the formats capability in one pass (16-bit gradients in, 16-bit parameters
            out), False as float32 masters with a conversion pass each way (a third more host bytes,
            half the pinned ones). Same bits.
        step_in_backward: start a chunk's CPU step in the backward that completes its gradients.
        cpu_threads: at most how many of numba's threads a chunk's CPU step runs on (default None:
            numba's count). Fewer can leave cores to the thread that drives the GPU while steps run
            in backward (a parallel step waits for its slowest thread).
        bucket_elements: about how many elements one CPU step (chunk) covers.
        **kwargs: the optimizer's arguments (``lr``, ``betas``, ``backend_options``, ...).
    """

    _step_supports_amp_scaling = True

    def __init__(self, optimizer_class: Any, params: Any, *, workers: Optional[int] = None,
                 accumulation_steps: int = 1, step_in_backward: bool = False,
                 bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, fuse_conversions: Optional[bool] = None,
                 cpu_threads: Optional[int] = None, **kwargs: Any):
        cls = resolve_optimizer_class(optimizer_class)
        workers = DEFAULT_WORKERS if workers is None else workers
        for name, value in (("workers", workers), ("accumulation_steps", accumulation_steps),
                            ("bucket_elements", bucket_elements)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"{name}={value!r}, expected an int >= 1")
        if cpu_threads is not None and (isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int)
                                        or cpu_threads < 1):
            raise InvalidParameterError(f"cpu_threads={cpu_threads!r}, expected None or an int >= 1")
        self.cpu_threads = cpu_threads
        if fuse_conversions is not None and not isinstance(fuse_conversions, bool):
            raise InvalidParameterError(f"fuse_conversions={fuse_conversions!r}, expected None, True or False")
        self.fuse_conversions = fuse_conversions
        backend = kwargs.pop("backend", "cpu")
        self._formats = all(k in inspect.signature(cls).parameters for k in OptirsOptimizer.FORMAT_KEYS)
        if self._formats and "master_weights" not in kwargs and not kwargs.get("stochastic_rounding", False):
            # 16-bit parameters keep float32 masters on the host unless the caller chose otherwise
            kwargs["master_weights"] = "float32"
        self._cls, self._kwargs, self._backend_name = cls, kwargs, backend
        # A probe optimizer checks the arguments now and gives the defaults of every group.
        self._probe = cls([torch.zeros(1)], backend=backend, **kwargs)
        self._backend = _host_backend(backend, kwargs.get("backend_options"), self._probe)
        self.workers, self.accumulation_steps = workers, accumulation_steps
        self.step_in_backward, self.bucket_elements = bool(step_in_backward), bucket_elements
        self._armed = False  # step_in_backward: after one plain round showed the loop allows it
        self._chunks: List[_Chunk] = []
        self._where: Dict[torch.Tensor, Tuple[_Chunk, int]] = {}
        # a DTensor parameter's opt.state entry (_shown): the live values it was made of, and it
        self._dt_shown: Dict[torch.Tensor, Tuple[List[Tuple[str, Any]], Dict[str, Any]]] = {}
        self._handles: List[Any] = []
        self._device: Optional[torch.device] = None
        self._lock = threading.RLock()  # the round's bookkeeping (hooks run on autograd's threads)
        self._streams: Optional[Tuple[Any, Any]] = None
        self._check: Optional[str] = None  # COPY_AT_STEP or FINGERPRINT, once the device is known
        # FINGERPRINT: per tensor the fingerprint of the copy sent and of the gradient at step(), on
        # the device, and where their comparison lands on the host
        self._fp_sent: Optional[torch.Tensor] = None
        self._fp_now: Optional[torch.Tensor] = None
        self._fp_differ: Optional[torch.Tensor] = None
        # the backend whose ``fingerprint`` capability takes them (one pass over each gradient), its
        # hook; None: not looked for yet; False: torch's reductions (_fingerprint)
        self._fp_backend: Any = None
        self._groups_ok: Optional[bool] = None  # this round's groups checked by a hook (step_in_backward)
        self._abort = threading.Event()  # this round: a chunk's step failed, start no other
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="optirs-offload")
        self._stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optirs-offload-step")  # _host_pass
        self.timing: Optional[OffloadTiming] = None  # set an OffloadTiming to see where the time goes
        super().__init__(params, self._probe.defaults)

    # ------------------------------------------------------------ groups, chunks, hooks

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        probe = {**self.defaults, **{k: v for k, v in param_group.items() if k not in _GROUP_ONLY}}
        hp = self._group_values(len(self.param_groups), probe)
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        try:
            coupled = getattr(hp, "max_grad_norm", None) is not None  # clipping over the whole group
            chunks = self._make_chunks(gi, self.param_groups[gi], coupled)
        except BaseException:
            self.param_groups.pop()  # a group that cannot be offloaded is not added
            raise
        self._register(chunks)

    def _group_values(self, gi: int, group: Dict[str, Any]) -> Any:
        """The group's hyperparameters record, checked as the inner optimizers will read them; every
        failure an optirs error naming the group (a missing key or a value of the wrong type too)."""
        try:
            check_flags(group)
            return self._probe.group_hyperparameters(group)[1]
        except GpuOptimError as exc:
            raise type(exc)(f"param_groups[{gi}]: {exc}") from exc
        except KeyError as exc:
            key = exc.args[0] if exc.args else None
            default = f" (the default is {self.defaults[key]!r})" if key in self.defaults else ""
            raise InvalidParameterError(
                f"param_groups[{gi}] has no {key!r}, expected every hyperparameter of {self._cls.__name__} in "
                f"each group{default}") from exc
        except Exception as exc:  # noqa: BLE001 - a value the record cannot take
            raise InvalidParameterError(
                f"param_groups[{gi}]'s hyperparameters cannot be read ({type(exc).__name__}: {exc}), expected the "
                f"values {self._cls.__name__} takes") from exc

    def _check_groups(self) -> None:
        """Every group as the step will read it: flags, hyperparameters, the format its chunks were
        made for; raises before anything is stepped."""
        for gi, group in enumerate(self.param_groups):
            hp = self._group_values(gi, group)
            held = {(c.dtype, c.mode) for c in self._chunks if c.gi == gi}
            for dtype, mode in held:
                try:
                    need = self._mode(gi, group, dtype)
                except GpuOptimError as exc:
                    raise type(exc)(f"param_groups[{gi}]: {exc}") from exc
                if need != mode:
                    raise UnsupportedOperationError(
                        f"param_groups[{gi}]'s step format changed since it was added (its {dtype} tensors are held "
                        f"as {mode!r}, the format now needs {need!r}), expected the format chosen at construction "
                        "(make a new CPUOffload and load the state into it)")
            self._check_dtensors(gi, group)
            if getattr(hp, "max_grad_norm", None) is not None and sum(c.gi == gi for c in self._chunks) > 1:
                raise UnsupportedOperationError(
                    f"param_groups[{gi}] now clips over the whole group (max_grad_norm), but it was split into "
                    "several chunks; expected max_grad_norm when the group is added")

    def _make_chunks(self, gi: int, group: Dict[str, Any], coupled: bool) -> List[_Chunk]:
        params = [p for p in group["params"] if p.requires_grad]
        devices = {p.device for p in params} | ({self._device} if self._device is not None else set())
        if len(devices) > 1:
            raise UnsupportedOperationError(
                f"parameters on {sorted(map(str, devices))}, expected every parameter on one device: one CPUOffload "
                "moves one device's tensors (make one per device)")
        for j, p in enumerate(group["params"]):
            if p.dtype not in OFFLOAD_DTYPES:
                raise UnsupportedOperationError(
                    f"param_groups[{gi}]['params'][{j}] is {p.dtype}, expected one of {list(OFFLOAD_DTYPES)}")
            if p.is_sparse:
                raise UnsupportedOperationError(f"param_groups[{gi}]['params'][{j}] is sparse, expected a dense tensor")
        self._check_dtensors(gi, group)
        if not params:
            return []
        device = params[0].device
        position = {id(p): j for j, p in enumerate(group["params"])}
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for p in reversed(params):  # backward writes the last layers' gradients first
            by_dtype.setdefault(p.dtype, []).append(p)
        if coupled and len(by_dtype) > 1:
            raise UnsupportedOperationError(
                f"param_groups[{gi}] clips gradients over the whole group (max_grad_norm) but mixes "
                f"{sorted(map(str, by_dtype))} parameters, expected one dtype per such group")
        modes = {dtype: self._mode(gi, group, dtype) for dtype in by_dtype}
        runs: List[List[torch.Tensor]] = []
        for ps in by_dtype.values():
            run: List[torch.Tensor] = []
            size = 0
            for p in ps:
                if run and size + p.numel() > self.bucket_elements and not coupled:
                    runs.append(run)
                    run, size = [], 0
                run.append(p)
                size += p.numel()
            runs.append(run)
        base = len(self._chunks)
        chunks = [_Chunk(base + i, gi, run, [position[id(p)] for p in run], _pins(device), modes[run[0].dtype])
                  for i, run in enumerate(runs)]
        hyper = {k: v for k, v in group.items() if k not in _GROUP_ONLY}
        with torch.no_grad():
            for c in chunks:
                for k in range(len(c.params)):
                    c.resync(k)
                c.inner = self._cls([{"params": c.host, **hyper}], backend=self._backend_name, **self._kwargs)
        if device.type == "cuda" and self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        self._device = device
        self._check = _gradient_check(device, self.step_in_backward)
        return chunks

    def _check_dtensors(self, gi: int, group: Dict[str, Any]) -> None:
        """Refuse the group's DTensor parameters that its optimizer and format cannot step shard by
        shard on the host: placements other than Shard / Replicate; on sharded ones, what needs the
        whole tensor and int8 state (the inner optimizers step each rank's shard as a plain tensor:
        without the mesh, and without the whole tensor's int8 block grid and small-tensor rule)."""
        dtensors = [(j, p) for j, p in enumerate(group["params"]) if is_dtensor(p)]
        if not dtensors:
            return
        name, hp = self._probe.group_hyperparameters(group)
        definition = DEFINITIONS[name]
        per_tensor = None
        if not definition.pointwise:
            per_tensor = f"{definition.name}'s per-tensor reductions (offloaded, each rank steps its shards alone)"
        elif getattr(hp, "max_grad_norm", None) is not None:
            per_tensor = "clipping over the whole group (max_grad_norm)"
        int8 = self._formats and self._probe.group_precision(group).state_dtype in INT8_STATES
        for j, p in dtensors:
            where = f"param_groups[{gi}]['params'][{j}]"
            error = refusal(p, p, where, per_tensor, False)
            if error is None and int8 and sharded(p):
                error = UnsupportedOperationError(
                    f"{where} is a DTensor sharded {tuple(p.placements)} with int8 state under CPUOffload, expected "
                    "state_dtype 'float32' or 'bfloat16' for its param group: the offload's inner optimizers step "
                    "each rank's shard as a plain host tensor, whose int8 blocks and float32 small-tensor rule "
                    "follow the shard, not the whole tensor's block grid, so its checkpoint would not reshard "
                    "(optirs.torch optimizers without offload keep int8 state under FSDP2)")
            if error is not None:
                raise error

    def _mode(self, gi: int, group: Dict[str, Any], dtype: torch.dtype) -> str:
        """How a chunk of ``dtype`` tensors of this group is held (DIRECT, FUSED or WIDEN); checks
        the group's step format (remainder masters need bf16 parameters, ...)."""
        if not self._formats:
            return DIRECT if dtype == torch.float32 else WIDEN
        name, _ = self._probe.group_hyperparameters(group)
        fmt = resolve_format(self._probe.group_precision(group), dtype, dtype, DEFINITIONS[name].kernel)
        if dtype == torch.float32:
            return DIRECT
        if self.fuse_conversions is False:
            if fmt.master != "float32" or fmt.stochastic:  # what float32 masters alone can step
                raise InvalidParameterError(
                    f"fuse_conversions=False with param_groups[{gi}]'s master_weights={fmt.master!r}, expected "
                    "master_weights='float32' (only float32 masters can be stepped apart from the 16-bit parameters)")
            return WIDEN
        return FUSED

    def _register(self, chunks: List[_Chunk]) -> None:
        # The hook lives as long as the model's parameters: it must keep neither the optimizer nor
        # a chunk (its host buffers and inner optimizer) alive, so it finds the chunk in _where.
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            opt = ref()
            if opt is not None:
                opt._on_grad(*opt._where[p], p)

        if chunks and self._check == FINGERPRINT:
            self._grow_fingerprints(chunks)
        for c in chunks:
            for k, p in enumerate(c.params):
                self._handles.append(p.register_post_accumulate_grad_hook(hook))
                self._where[p] = (c, k)
            self._chunks.append(c)

    def _grow_fingerprints(self, chunks: List[_Chunk]) -> None:
        """Rows for the new chunks' tensors in the fingerprint tables (the rows held are kept)."""
        with self._lock:
            held = 0 if self._fp_sent is None else self._fp_sent.shape[0]
            rows = held
            for c in chunks:
                c.row, rows = rows, rows + len(c.params)
            sent = torch.zeros((rows, 2), dtype=torch.int64, device=self._device)
            if held:
                sent[:held].copy_(self._fp_sent)
            self._fp_sent, self._fp_now = sent, torch.zeros_like(sent)
            self._fp_differ = _host_empty(rows, torch.bool, _pins(self._device), "the gradients' fingerprint check")
            if self._fp_backend is None:
                self._fp_backend = _fingerprint_backend(self._device) or False

    def _take_fingerprints(self, grads: List[torch.Tensor], table: torch.Tensor, rows: List[int]) -> None:
        """Gradient ``grads[k]``'s fingerprint into ``table[rows[k]]``, queued on the current stream."""
        if not self._fp_backend:
            for g, r in zip(grads, rows):
                _fingerprint(g, table[r])
            return
        backend, hook = self._fp_backend
        words = [_gradient_words(g) for g in grads]
        with backend.lock:  # on the cpu backend, one host pass at a time (as the chunk steps)
            hook(backend.ctx, words, _words(table), rows)

    @property
    def gradient_check(self) -> Optional[str]:
        """How ``step()`` knows that a gradient's host copy is still the gradient (docs/offload.md):
        ``"copy-at-step"``, ``"fingerprint (<backend>)"`` (that optirs backend's fingerprint
        capability) or ``"fingerprint (torch)"`` (torch's reductions); None before any parameter."""
        if self._check != FINGERPRINT:
            return self._check
        return f"fingerprint ({self._fp_backend[0].name if self._fp_backend else 'torch'})"

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks (the optimizer then copies every gradient in step())."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------ gradients to the host

    def _on_grad(self, chunk: _Chunk, k: int, p: torch.Tensor) -> None:
        with self._lock:
            self._check_gradient(chunk, k, p, p.grad)
            chunk.fires[k] += 1
            if chunk.fires[k] < self.accumulation_steps or self._check == COPY_AT_STEP:
                return  # not the last backward before step(), or copied by step() itself
            if chunk.future is not None:
                raise UnsupportedOperationError(
                    f"backward {chunk.fires[k]} since the last step() wrote param_groups[{chunk.gi}]['params']"
                    f"[{chunk.positions[k]}]'s gradient, but its step already started with the gradients of "
                    f"accumulation_steps={self.accumulation_steps} backwards (step_in_backward=True); expected "
                    f"step() after every {self.accumulation_steps} backwards")
            self._send(chunk, k, p, fingerprint=True)
            if (self.step_in_backward and self._armed and all(s is not None for s in chunk.sent)
                    and self._groups_valid()):
                chunk.future = self._pool.submit(self._job, chunk, list(range(len(chunk.params))), None, None,
                                                 self._abort)
                _settle_at_end_of_backward(chunk.future)

    def _groups_valid(self) -> bool:
        """Whether every group passes step()'s checks (once per round): a chunk starts in backward
        only then, so that step() refuses a bad group before anything is stepped."""
        if self._groups_ok is None:
            try:
                self._check_groups()
                self._groups_ok = True
            except GpuOptimError:
                self._groups_ok = False
        return self._groups_ok

    @staticmethod
    def _check_gradient(chunk: _Chunk, k: int, p: torch.Tensor, g: torch.Tensor) -> None:
        if g.is_sparse:
            raise _sparse_gradient(chunk.gi, chunk.positions[k])
        if is_dtensor(p) or is_dtensor(g):  # (what the group's optimizer needs was checked with the group)
            error = refusal(p, g, f"param_groups[{chunk.gi}]['params'][{chunk.positions[k]}]", None, False)
            if error is not None:
                raise error
        if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
            raise ShapeMismatchError(
                f"param_groups[{chunk.gi}]['params'][{chunk.positions[k]}] is {tuple(p.shape)} {p.dtype} "
                f"on {p.device}, "
                f"but its gradient {tuple(g.shape)} {g.dtype} on {g.device}; expected the same")

    def _send(self, chunk: _Chunk, k: int, p: torch.Tensor, fingerprint: bool = False) -> None:
        """Start copying p's gradient into its host buffer (on CUDA: on the side stream, after the
        current one); ``fingerprint``: record the gradient's fingerprint for step() to compare."""
        grad = p.grad
        self._check_gradient(chunk, k, p, grad)
        g = local(grad)  # a DTensor's: this rank's shard, what its host copy pairs with
        chunk.resync(k)
        landing = chunk.landing[k]
        timing = self.timing
        if self._streams is not None:
            d2h = self._streams[0]
            current = torch.cuda.current_stream(p.device)
            d2h.wait_stream(current)
            if fingerprint:
                # on the current stream: before any later edit of the gradient there, whichever of
                # the edit and the copy runs first
                self._take_fingerprints([g], self._fp_sent, [chunk.row + k])
            with torch.cuda.stream(d2h):
                if timing is not None:
                    start, end = timing.events("d2h_s", chunk.index)
                    start.record(d2h)
                landing.copy_(g, non_blocking=True)
                if timing is not None:
                    end.record(d2h)
            g.record_stream(d2h)  # its memory is not reused before the copy has read it
            event = _event()
            event.record(d2h)
        else:
            t0 = time.perf_counter()
            with torch.no_grad():
                if fingerprint:
                    self._take_fingerprints([g], self._fp_sent, [chunk.row + k])
                landing.copy_(g)
            if timing is not None:
                timing.copied("d2h_s", time.perf_counter() - t0, chunk.index)
            event = None
        if timing is not None:
            timing.add("d2h_bytes", g.numel() * g.element_size())
        chunk.sent[k] = (weakref.ref(grad), g._version)
        chunk.events[k] = event

    # ------------------------------------------------------------ one chunk's step (a worker)

    def _job(self, chunk: _Chunk, present: List[int], scale: Optional[float], after: Any,
             abort: threading.Event) -> bool:
        """A worker's chunk: a failure sets ``abort``, so that no chunk step starts after it."""
        try:
            with responsive_gil():
                return self._run_chunk(chunk, present, scale, after, abort)
        except BaseException:
            abort.set()
            raise

    def _run_chunk(self, chunk: _Chunk, present: List[int], scale: Optional[float], after: Any,
                   abort: Optional[threading.Event] = None) -> bool:
        """The chunk's CPU step and its copy back, from where it stopped (``chunk.progress``); False
        when ``abort`` was set before the CPU step started (nothing of the chunk was stepped)."""
        timing = self.timing
        clock = time.perf_counter
        with torch.no_grad():
            if chunk.progress == 0:
                w0 = clock()
                for k in present:
                    if chunk.events[k] is not None:
                        chunk.events[k].synchronize()  # a blocking event: the wait neither spins nor holds the GIL
                t0 = clock()
                keep = set(present)
                for k, m in enumerate(chunk.host):
                    want = chunk.grads[k] if k in keep else None
                    if m.grad is not want:
                        m.grad = want
                group, inner = self.param_groups[chunk.gi], chunk.inner.param_groups[0]
                for key, value in group.items():
                    if key not in _GROUP_ONLY:
                        inner[key] = value
                t1 = clock()
                times = self._stepper.submit(self._host_pass, chunk, present, scale, abort).result()
                if times is None:
                    return False  # another chunk's step failed: all chunks step or none
                t2, t3, t4 = times
                chunk.progress = 1
                if timing is not None:
                    timing.add("wait_d2h_s", t0 - w0)
                    if chunk.mode == WIDEN:
                        timing.add("convert_s", t3 - t2)
                    timing.add("cpu_step_s", (t1 - t0) + (t4 - t3))  # the bookkeeping and the step, not the lock wait
                    nbytes = chunk.step_bytes(present)
                    timing.add("step_bytes", nbytes)
                    timing.mark(chunk.index, ready=t0, step_start=t3, step_end=t4, step_bytes=nbytes,
                                elements=sum(chunk.host[k].numel() for k in present))
            if chunk.progress == 1:
                if chunk.mode == WIDEN:
                    with self._backend.lock:
                        t0 = clock()
                        for k in present:
                            chunk.staging[k].copy_(chunk.host[k])  # fp32 masters rounded to the parameters' dtype
                        if timing is not None:
                            timing.add("convert_s", clock() - t0)
                if timing is not None:
                    nbytes = sum(chunk.outbound[k].numel() * chunk.outbound[k].element_size() for k in present)
                    timing.add("h2d_bytes", nbytes)
                    timing.mark(chunk.index, h2d_bytes=nbytes)
                if self._streams is not None:
                    h2d = self._streams[1]
                    with torch.cuda.stream(h2d):
                        for k in present:
                            if chunk.events[k] is not None:
                                h2d.wait_event(chunk.events[k])  # after backward's last use of the parameter
                        if after is not None:
                            h2d.wait_event(after)  # after what was queued before step()
                        if timing is not None:
                            start, end = timing.events("h2d_s", chunk.index)
                            start.record(h2d)
                        for k in present:
                            local(chunk.params[k]).copy_(chunk.outbound[k], non_blocking=True)
                        if timing is not None:
                            end.record(h2d)
                        event = _event()
                        event.record(h2d)
                    chunk.h2d_event = event
                    if timing is not None:
                        timing.mark(chunk.index, h2d_queued=clock())
                else:
                    t0 = clock()
                    for k in present:
                        local(chunk.params[k]).copy_(chunk.outbound[k])
                    if timing is not None:
                        t1 = clock()
                        timing.copied("h2d_s", t1 - t0, chunk.index)
                        timing.mark(chunk.index, h2d_queued=t1)
                for k in present:
                    chunk.mark(k)
                chunk.progress = 2
        return True

    def _host_pass(self, chunk: _Chunk, present: List[int], scale: Optional[float],
                   abort: Optional[threading.Event]) -> Optional[Tuple[float, float, float]]:
        """A chunk's host pass (its WIDEN conversion and CPU step), on the stepper thread: its
        times (before the conversion, before and after the step), or None when ``abort`` was set
        first (nothing stepped).

        Every chunk step of an optimizer runs on that one thread. numba's omp threading layer
        gives each thread that launches a parallel loop a team of its own, whose threads spin a
        while after the loop ends: steps launched by two workers in turn left one team spinning
        beside the other's step (on the 2-core machine, 10-23% more CPU step time than with one
        launching thread). One pass at a time, too: each already runs on every core and is bound by
        memory bandwidth, and the cpu backend's staging caches are shared by everything on it."""
        clock = time.perf_counter
        with torch.no_grad(), self._backend.lock:
            if abort is not None and abort.is_set():
                return None
            chunk.counts = self._counts(chunk, present)
            try:
                t2 = clock()
                if chunk.mode == WIDEN:
                    for k in present:
                        chunk.grads[k].copy_(chunk.staging[k])  # 16-bit gradients to fp32 on the host
                t3 = clock()
                with _numba_threads(self.cpu_threads):
                    chunk.inner.step(grad_scale=scale)
                return t2, t3, clock()
            except BaseException:
                if abort is not None:
                    abort.set()  # under the lock: the next chunk to take it sees the failure
                raise

    @staticmethod
    def _counts(chunk: _Chunk, present: List[int]) -> Tuple[Any, ...]:
        """What says, per tensor, whether the inner optimizer stepped it: its step count (0.0 without
        state), or ``"held"`` for state without a count (SGD's momentum buffer)."""
        out: List[Any] = []
        state = chunk.inner.state
        for k in present:
            entry = state.get(chunk.host[k])
            if not entry:
                out.append(0.0)
            elif "step" in entry:
                step = entry["step"]
                out.append(float(step.item() if isinstance(step, torch.Tensor) else step))
            else:
                out.append("held")
        return tuple(out)

    # ------------------------------------------------------------ the step

    @observed_step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scale: Optional[torch.Tensor] = None,
             found_inf: Optional[torch.Tensor] = None):
        """One step of every chunk; returns ``closure()``'s loss (evaluated with grad enabled).

        ``grad_scale`` / ``found_inf`` (or the attributes GradScaler sets): as the front end, the
        gradients are unscaled by ``1 / grad_scale`` and nothing changes when ``found_inf`` is set.
        A KeyboardInterrupt during the step is delivered after it. A chunk whose CPU step fails
        stops the chunks not yet started; it is retried once where that cannot step anything twice,
        and then the others are stepped: the error says whether the step was completed, or that
        nothing was stepped, or (a chunk failing for good after others had stepped) exactly which
        tensors were (``.stepped`` / ``.not_stepped``). A plugin's exception is named by a
        PluginError (the plugin and the hook).
        """
        loss, grad_scale, found_inf = closure_and_amp(self, closure, grad_scale, found_inf)
        t0 = time.perf_counter()
        with deferred_interrupts(), responsive_gil():
            try:
                self._step_round(grad_scale, found_inf)
            finally:
                with self._lock:
                    for c in self._chunks:
                        c.reset_round()
                    self._groups_ok = None
                    self._abort = threading.Event()
        timing = self.timing
        if timing is not None:
            timing.add("step_call_s", time.perf_counter() - t0)
            timing.add("steps", 1)
            timing.settle(called=t0)
        return loss

    def _started(self) -> List[_Chunk]:
        return [c for c in self._chunks if c.future is not None]

    def _step_round(self, grad_scale: Any, found_inf: Any) -> None:
        with self._lock:
            started = self._started()
        # Check everything before anything is stepped: GradScaler's values, every group.
        try:
            scale = None
            if grad_scale is not None:
                scale = _amp_value(grad_scale, "grad_scale")
                if isinstance(grad_scale, bool) or not (scale > 0.0 and np.isfinite(scale)):
                    raise InvalidParameterError(f"grad_scale={grad_scale!r}, expected a finite scale > 0")
            skip = found_inf is not None and _amp_value(found_inf, "found_inf") != 0.0
            if (grad_scale is not None or found_inf is not None) and self.step_in_backward:
                raise UnsupportedOperationError(
                    "GradScaler (grad_scale / found_inf) with step_in_backward=True, expected step_in_backward=False: "
                    "a step started in backward cannot wait for the inf check")
            self._check_groups()
            if skip:
                return
            # GradScaler passes found_inf without grad_scale after scaler.unscale_(opt), whose in-place
            # unscale moves no version counter: copy every gradient again.
            work, changed = self._gradients(unscaled=found_inf is not None and grad_scale is None)
            if changed and self.step_in_backward:
                names = [f"param_groups[{c.gi}]['params'][{c.positions[k]}]" for c, k in changed]
                raise UnsupportedOperationError(
                    f"the gradients of {names[:3]}{' ...' if len(names) > 3 else ''} changed after backward wrote "
                    "them (clipped, unscaled or edited in place?) with step_in_backward=True, expected them final "
                    "when backward writes them (or step_in_backward=False)")
        except GpuOptimError as exc:
            raise self._refused(exc, started) from exc
        for c, present, stale in work:
            for k in stale:
                self._send(c, k, c.params[k])
        after = None
        if self._streams is not None:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self._device))
        abort = self._abort
        jobs = [(c, present, c.future) for c, present, _ in work if c.future is not None]
        jobs += [(c, present, self._pool.submit(self._job, c, present, scale, after, abort))
                 for c, present, _ in work if c.future is None and present]
        done, held, failures = [], [], []
        for c, present, future in jobs:
            try:
                (done if future.result() else held).append((c, present))
            except Exception as exc:  # noqa: BLE001 - raised below, named
                failures.append((c, present, exc))
        timing = self.timing
        if timing is not None:
            timing.add("early_chunks", len(started))
            if self._streams is not None:
                t0 = time.perf_counter()
                for c, _, _ in jobs:
                    if c.h2d_event is not None:
                        c.h2d_event.synchronize()
                timing.add("h2d_tail_s", time.perf_counter() - t0)
        error = self._finish(done, held, failures, scale, after) if failures else None
        if self._streams is not None:
            current = torch.cuda.current_stream(self._device)
            for c, _, _ in jobs:
                if c.h2d_event is not None:
                    current.wait_event(c.h2d_event)
        self._refresh_state()
        if error is not None:
            raise error
        if self.step_in_backward:
            self._armed = True

    def _finish(self, done: List[Tuple[_Chunk, List[int]]], held: List[Tuple[_Chunk, List[int]]],
                failures: List[Tuple[_Chunk, List[int], BaseException]], scale: Optional[float],
                after: Any) -> GpuOptimError:
        """After chunk steps failed (no chunk step started after the first failure): retry each
        failed chunk once, in this thread, where that cannot step a tensor twice, then step the
        chunks held back; stop at the first chunk that fails for good. Returns the error step()
        raises: it names the first failure (a plugin's as a PluginError naming the plugin and the
        hook) and says whether the step was completed, or exactly what was stepped."""
        first_chunk, first_present, first = failures[0]
        cause = _plugin_failure(self._backend.name, first)
        stepped = list(done)
        queue = sorted([(c, present, exc) for c, present, exc in failures] + [(c, present, None) for c, present in held],
                       key=lambda t: t[0].index)
        final: Optional[Tuple[_Chunk, List[int], BaseException, List[int], bool]] = None
        for c, present, exc in queue:
            if exc is not None and c.progress == 0:
                moved, known = self._moved(c, present)
                if moved or not known:  # part of it may have been stepped: a retry could step it twice
                    final = (c, present, exc, moved, known)
                    break
            try:
                self._run_chunk(c, present, None if c.future is not None else scale, after)
            except Exception as again:  # noqa: BLE001 - the error below names it
                moved, known = self._moved(c, present) if c.progress == 0 else (list(present), True)
                final = (c, present, again, moved, known)
                break
            stepped.append((c, present))
        kind = type(cause) if isinstance(cause, GpuOptimError) else GpuOptimError
        head = f"the CPU step of {self._where_of(first_chunk, first_present)} failed: " + (
            str(cause) if cause is not first else repr(first))
        if final is None:
            error = kind(f"{head}; the step was completed by retrying it (and stepping the chunks held back "
                         "meanwhile), so every parameter, master, state and step count is after the step")
            error.stepped, error.not_stepped = self._names(stepped), []
            error.__cause__ = cause
            return error
        c, present, again, moved, known = final
        if again is not first:
            again_named = _plugin_failure(self._backend.name, again)
            head += (f"; it failed again when retried: {again_named}" if c is first_chunk
                     else f"; then {self._where_of(c, present)} failed: {again_named}")
        if c.progress >= 1:  # stepped on the host; its copy back failed (the next step's copy brings it)
            head += f"; {self._where_of(c, present)} was stepped on the host but not copied back"
        if not known:
            head += (f"; {self._where_of(c, present)} holds tensors with and without state (several launches), so "
                     "whether some of them were stepped is unknown")
        names = self._names(stepped + ([(c, moved)] if moved else []))
        taken = set(names)
        not_stepped = [n for n in self._names([(x, list(range(len(x.params)))) for x in self._chunks])
                       if n not in taken]
        if not names and known:
            message = (f"{head}; nothing was stepped: every parameter, master, state and step count is as before "
                       "this step()")
        else:
            message = (f"{head}; the step is incomplete: {len(names)} tensors were stepped {names[:6]}"
                       f"{' ...' if len(names) > 6 else ''} and {len(not_stepped)} were not {not_stepped[:6]}"
                       f"{' ...' if len(not_stepped) > 6 else ''} (the error's .stepped and .not_stepped list them)")
        error = kind(message)
        error.stepped, error.not_stepped = names, not_stepped
        error.__cause__ = cause
        return error

    def _moved(self, chunk: _Chunk, present: List[int]) -> Tuple[List[int], bool]:
        """(the tensors of a failed chunk step that the inner optimizer counted as stepped, whether
        that is known). The inner step is one transaction: a hook that raised counts nothing, the
        launches before it (tensors of another step count) are counted. Without step counts
        (``"held"``), only a chunk whose tensors all held state or none is known to be one launch."""
        before = chunk.counts
        if before is None:  # it failed before its step started
            return [], True
        after = self._counts(chunk, present)
        if "held" in before or "held" in after:
            return [], len(set(before)) <= 1
        return [k for k, a, b in zip(present, after, before) if a != b], True

    @staticmethod
    def _where_of(chunk: _Chunk, present: List[int]) -> str:
        return f"chunk {chunk.index} (param_groups[{chunk.gi}]['params'] {sorted(chunk.positions[k] for k in present)})"

    @staticmethod
    def _names(parts: List[Tuple[_Chunk, List[int]]]) -> List[str]:
        """'param_groups[i]['params'][j]' of each tensor, in the groups' order."""
        return [f"param_groups[{gi}]['params'][{j}]" for gi, j in sorted((c.gi, c.positions[k]) for c, ks in parts
                                                                         for k in ks)]

    def _gradients(self, unscaled: bool) -> Tuple[List[Tuple[_Chunk, List[int], List[int]]], List[Tuple[_Chunk, int]]]:
        """(per chunk: the chunk, its tensors with a gradient, those whose host copy is not the
        gradient now), and the (chunk, tensor) pairs whose gradient changed after its copy started."""
        work, changed, verify = [], [], []
        for c in self._chunks:
            present: List[int] = []
            stale: List[int] = []
            for k, p in enumerate(c.params):
                g = p.grad
                if g is None:
                    continue
                self._check_gradient(c, k, p, g)
                present.append(k)
                sent = c.sent[k]
                if unscaled or sent is None or sent[0]() is not g or sent[1] != local(g)._version:
                    stale.append(k)
                    if sent is not None and not unscaled:
                        changed.append((c, k))
                else:  # the same tensor and version: edits through .data or other views move neither
                    verify.append((c, k))
            work.append((c, present, stale))
        if verify:
            again = self._fingerprints_differ(verify)
            if again:
                changed += again
                stale_of = {id(c): stale for c, _, stale in work}
                for c, k in again:
                    stale_of[id(c)].append(k)
        return work, changed

    def _fingerprints_differ(self, pairs: List[Tuple[_Chunk, int]]) -> List[Tuple[_Chunk, int]]:
        """The pairs whose gradient's fingerprint now differs from the one recorded with its copy.

        On a device this waits until the device has run everything queued before step() (the
        fingerprints are computed after it); the rows of other tensors are compared too and ignored."""
        t0 = time.perf_counter()
        now = self._fp_now
        self._take_fingerprints([local(c.params[k].grad) for c, k in pairs], now, [c.row + k for c, k in pairs])
        differ = torch.ne(self._fp_sent, now).any(1)
        host = self._fp_differ
        if self._streams is not None:
            host.copy_(differ, non_blocking=True)
            event = _event()
            event.record(torch.cuda.current_stream(self._device))
            event.synchronize()
        else:
            host.copy_(differ)
        flags = host.numpy()
        if self.timing is not None:
            self.timing.add("check_s", time.perf_counter() - t0)
        return [(c, k) for c, k in pairs if flags[c.row + k]]

    def _refused(self, error: GpuOptimError, started: List[_Chunk]) -> GpuOptimError:
        """``error`` as step() raises it: saying what was stepped (chunks started in backward) or that
        nothing was; ``.stepped`` lists the tensors stepped."""
        stepped = self._wait(started)
        refused = type(error)(f"{error}; {self._torn(stepped)}" if stepped else f"{error} (nothing was stepped)")
        refused.stepped = self._names([(c, list(range(len(c.params)))) for c in stepped])
        return refused

    def _wait(self, chunks: List[_Chunk]) -> List[_Chunk]:
        """Wait for steps started in backward; the chunks they stepped (not those held back or failed)."""
        stepped = []
        for c in chunks:
            try:
                if c.future.result():
                    stepped.append(c)
            except Exception:  # noqa: BLE001 - the caller raises the error that matters
                pass
        return stepped

    @staticmethod
    def _torn(stepped: List[_Chunk]) -> str:
        names = [f"param_groups[{c.gi}]['params'][{j}]" for c in stepped for j in sorted(c.positions)]
        return f"these tensors differ from the rest by one step: {names[:6]}{' ...' if len(names) > 6 else ''}"

    # ------------------------------------------------------------ torch.optim's state

    def _refresh_state(self) -> None:
        """Point ``self.state[p]`` at the inner optimizers' live entries (views of host buffers; of a
        DTensor ``p``, as DTensors: :meth:`_shown`); an entry whose step count is 0 (made for a first
        step that failed) is not state yet."""
        for c in self._chunks:
            state = c.inner.state
            for p, m in zip(c.params, c.host):
                entry = state.get(m)
                if not entry:
                    continue
                entry = self._shown(p, entry)
                if self.state.get(p) is not entry:
                    step = entry.get("step", 1)
                    if float(step.item() if isinstance(step, torch.Tensor) else step) != 0:
                        self.state[p] = entry

    def _shown(self, p: torch.Tensor, entry: Dict[str, Any]) -> Dict[str, Any]:
        """What ``opt.state[p]`` holds for the inner optimizer's live ``entry``: the entry itself, or
        for a DTensor ``p`` a dict of the same values whose state tensors are DTensors over the
        same host memory, placed as ``p`` (what torch.distributed.checkpoint saves and reshards;
        the step count stays a plain tensor, as torch keeps it). Made again only when the live
        entry holds other tensors."""
        if not is_dtensor(p):
            return entry
        made = self._dt_shown.get(p)
        values = list(entry.items())
        if made is not None and len(made[0]) == len(values) and all(
                a == c and b is d for (a, b), (c, d) in zip(made[0], values)):
            return made[1]
        whole = not sharded(p)
        shard = tuple(local(p).shape)
        shown = {key: hosted(v, p, key) if key != "step" and isinstance(v, torch.Tensor) and (
            whole or tuple(v.shape) == shard) else v for key, v in values}
        self._dt_shown[p] = (values, shown)
        return shown

    def state_dict(self) -> Dict[str, Any]:
        """torch's format, as the wrapped optimizer's with the same step format: 16-bit parameters
        keep their ``master`` (``MASTER_KEY``) or ``master_remainder`` under the front end's keys,
        whichever way their chunk steps (WIDEN chunks add their float32 masters themselves)."""
        self._refresh_state()
        sd = super().state_dict()
        sd["state"] = {k: plain(v) for k, v in sd["state"].items()}  # the inner optimizers' live entries, as dicts
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                where = self._where.get(p)
                if where is not None and where[0].mode == WIDEN:
                    master = where[0].host[where[1]]
                    sd["state"][index] = {**sd["state"].get(index, {}),
                                          MASTER_KEY: hosted(master, p) if is_dtensor(p) else master}
                index += 1
        return sd

    @staticmethod
    def _local_entry(i: Any, entry: Dict[str, Any], p: torch.Tensor) -> Dict[str, Any]:
        """A saved entry of DTensor ``p`` as its host copy takes it: each DTensor value's local tensor
        laid out as ``p``'s shard (redistributed first if placed otherwise: a collective, which
        every rank runs for the same tensors in the same order)."""
        entry = {key: held(v, p, key) for key, v in entry.items()}
        if sharded(p):
            shard = tuple(local(p).shape)
            for key, v in entry.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != shard:
                    raise ShapeMismatchError(
                        f"state[{i}][{key!r}] is a {type(v).__name__} of shape {tuple(v.shape)} for a DTensor "
                        f"parameter sharded {tuple(p.placements)} (this rank's shard {shard}), expected a DTensor "
                        "on the parameter's mesh (torch.distributed.checkpoint's state dicts are) or a tensor of "
                        "the shard's shape")
        return entry

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        saved = state_dict.get("state", {})
        index: Dict[torch.Tensor, Any] = {}
        for group, saved_group in zip(self.param_groups, state_dict.get("param_groups", [])):
            for p, i in zip(group["params"], saved_group.get("params", [])):
                index[p] = i
        # torch checks the groups and takes their hyperparameters; the state goes to the inner
        # optimizers (torch would cast it to the parameters' device and dtype).
        masters: List[Tuple[_Chunk, int, torch.Tensor]] = []
        locals_: List[Dict[int, Any]] = []
        for c in self._chunks:
            entries = {}
            for k, p in enumerate(c.params):
                entry = dict(saved.get(index.get(p), {}))
                if is_dtensor(p):
                    entry = self._local_entry(index.get(p), entry, p)
                # WIDEN chunks hold the master themselves; FUSED ones leave it to the inner optimizer
                master = entry.pop(MASTER_KEY, None) if c.mode == WIDEN else None
                if master is not None:
                    if tuple(master.shape) != tuple(c.host[k].shape):
                        raise ShapeMismatchError(
                            f"state[{index[p]}][{MASTER_KEY!r}] has shape {tuple(master.shape)}, "
                            f"expected {tuple(c.host[k].shape)}")
                    masters.append((c, k, master))
                if entry:
                    entries[k] = entry
            locals_.append(entries)
        super().load_state_dict({**state_dict, "state": {}})
        for c in self._chunks:
            # the host copies are read again from the parameters at the next step: a checkpoint
            # loaded in place (torch.distributed.checkpoint writes the parameters' memory) moves
            # no version counter; a loaded master stands (marked below)
            c.marks = [(-1, -1)] * len(c.params)
        for c, k, master in masters:
            with torch.no_grad():
                c.host[k].copy_(master)
            c.mark(k)
        for c, entries in zip(self._chunks, locals_):
            hyper = {k: v for k, v in self.param_groups[c.gi].items() if k not in _GROUP_ONLY}
            c.inner.load_state_dict({"state": entries,
                                     "param_groups": [{**hyper, "params": list(range(len(c.params)))}]})
            for k, entry in entries.items():
                live = c.inner.state[c.host[k]]
                for key, value in entry.items():
                    # torch casts every state tensor of a float32 parameter to float32; compact
                    # state (uint8 codes, bfloat16 moments) is kept in its own dtype, on the host
                    kept = live.get(key)
                    if key == "step" or not isinstance(value, torch.Tensor):
                        continue
                    if kept is None or value.dtype != kept.dtype:
                        live[key] = value.detach().to(device="cpu", copy=True)
                if c.mode == FUSED and ("master" in entry or "master_remainder" in entry):
                    # the loaded master stands; the host copy is the parameter
                    with torch.no_grad():
                        c.host[k].copy_(local(c.params[k]).detach())
                    c.mark(k)
        with self._lock:
            for c in self._chunks:
                c.reset_round()
        self._refresh_state()

    # ------------------------------------------------------------ copies

    def __getstate__(self) -> Dict[str, Any]:
        """What ``copy.deepcopy`` and ``pickle`` carry, as torch's optimizers: ``defaults``,
        ``param_groups`` (their parameters: the model's copies when the model is copied along, else
        copies of their own, as torch) and the state per parameter (host copies, compact tensors in
        their dtypes, a 16-bit parameter's float32 master under ``MASTER_KEY``), plus how the
        offload was made. The chunks, host buffers, hooks, locks, worker pool and streams are made
        again for the copy's parameters; a gradient copy in flight is not carried (the copy's step()
        copies every gradient). A step started in backward lands first."""
        with self._lock:
            started = self._started()
        self._wait(started)
        self._refresh_state()
        state: Dict[torch.Tensor, Dict[str, Any]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                entry = dict(self.state[p]) if p in self.state else {}
                where = self._where.get(p)
                if where is not None and where[0].mode == WIDEN:
                    entry[MASTER_KEY] = where[0].host[where[1]]
                if entry:  # copies: the live entries are views of whole flat buffers
                    state[p] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        made = {"optimizer_class": self._cls, "kwargs": dict(self._kwargs), "backend": self._backend_name,
                "workers": self.workers, "accumulation_steps": self.accumulation_steps,
                "step_in_backward": self.step_in_backward, "bucket_elements": self.bucket_elements,
                "fuse_conversions": self.fuse_conversions, "cpu_threads": self.cpu_threads, "armed": self._armed}
        return {"defaults": self.defaults, "param_groups": self.param_groups, "state": state, "offload": made}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        if "offload" not in state:  # torch's load_state_dict installs its state and groups this way
            super().__setstate__(state)
            return
        made = state["offload"]
        groups = [dict(g) for g in state["param_groups"]]
        self.__init__(made["optimizer_class"], groups, workers=made["workers"],
                      accumulation_steps=made["accumulation_steps"], step_in_backward=made["step_in_backward"],
                      bucket_elements=made["bucket_elements"], fuse_conversions=made["fuse_conversions"],
                      cpu_threads=made.get("cpu_threads"), backend=made["backend"], **made["kwargs"])
        index: Dict[torch.Tensor, int] = {}
        saved_groups = []
        for g in groups:
            ids = []
            for p in g["params"]:
                index.setdefault(p, len(index))
                ids.append(index[p])
            saved_groups.append({**g, "params": ids})
        self.load_state_dict({"state": {index[p]: entry for p, entry in state["state"].items()},
                              "param_groups": saved_groups})
        self._armed = made["armed"]

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        for name in ("_pool", "_stepper"):
            pool = getattr(self, name, None)
            if pool is not None:
                pool.shutdown(wait=False)


__all__ = ["CPUOffload", "MASTER_KEY", "OffloadTiming", "resolve_optimizer_class"]
