"""The plugin registry: built-in backends, entry-point plugins, probing and choosing by name.

The registry owns choosing and the error messages; plugins only provide. Plugins are loaded
once, lazily, on first use (never at ``import optirs``). A third-party plugin that fails to
import or to validate is recorded as broken with its error and a warning; it never takes the
registry or the other backends down. ``OPTIRS_DISABLE_PLUGIN_AUTOLOAD=1`` skips entry points.
"""

from __future__ import annotations

import importlib
import inspect
import os
import threading
import traceback
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pluggy

from optirs.plugin import hookspecs
from optirs.core.errors import BackendUnavailableError, GpuOptimError, PluginError, UnsupportedOperationError
from optirs.plugin.hookspecs import (CAPABILITIES, LEGACY_STEP_HOOKS, STEP_CAPABILITIES, DeviceInfo, ProbeResult,
                                    StepRequest, StepSupport)

ENTRY_POINT_GROUP = "optirs"
AUTOLOAD_ENV = "OPTIRS_DISABLE_PLUGIN_AUTOLOAD"
# The backends ``"auto"`` considers, in probe order: from the most device-specific to the host's
# own backend. ``"auto"`` ranks them by the kind of device each would open (DEVICE_KIND_RANK): a
# GPU or accelerator first (the first of this order wins), then a CPU (the last of this order
# wins: the host's own compiled loops beat a portable runtime on the same cores, e.g. numba's
# cpu backend runs 1.2-2x faster than OpenCL on PoCL), then a simulator (tests only: slowest).
SUPPORTED_BACKENDS: Tuple[str, ...] = ("cuda", "opencl", "cpu")
DEVICE_KIND_RANK: Dict[str, int] = {"gpu": 0, "accelerator": 0, "cpu": 1, "simulator": 2}
_OTHER_KIND_RANK = 1  # a device kind not listed above ranks with CPUs
_KIND_WORDS = {"gpu": "a GPU", "accelerator": "an accelerator", "cpu": "a CPU", "simulator": "a simulator"}

# Built-in plugins: name -> (module exposing ``plugin``, kind). Imported when the registry first loads.
BUILTIN_PLUGINS: Dict[str, Tuple[str, str]] = {
    "cpu": ("optirs.backends.cpu", "backend"),
    "cuda": ("optirs.backends.cuda", "backend"),
    "opencl": ("optirs.backends.opencl", "backend"),
    "occupancy": ("optirs.analysis.occupancy", "analysis"),
    "fusion": ("optirs.analysis.fusion", "analysis"),
    "quantization": ("optirs.analysis.quantization", "analysis"),
}

# Hooks a backend must implement to run any step at all.
REQUIRED_BACKEND_HOOKS = ("optirs_open", "optirs_alloc", "optirs_to_device", "optirs_to_host", "optirs_stage")


class PluginWarning(UserWarning):
    """A plugin could not be loaded; the others keep working."""


class PluginDeprecationWarning(FutureWarning):
    """A plugin implements a hook of an earlier release that optirs still adapts, for one more release."""


@dataclass
class PluginRecord:
    """A plugin the registry knows about, loaded or broken."""

    name: str
    source: str
    plugin: Any = None
    error: str = ""

    @property
    def broken(self) -> bool:
        return self.plugin is None


@dataclass(frozen=True)
class BackendStatus:
    """What ``list_backends()`` reports for one backend."""

    name: str
    available: bool
    reason: str
    devices: Tuple[DeviceInfo, ...]
    optimizers: Tuple[str, ...]
    source: str
    capabilities: Tuple[str, ...] = ()


@dataclass(frozen=True)
class AutoChoice:
    """What ``backend="auto"`` picks here and why (``Registry.choose_auto``; ``optirs info`` prints it)."""

    name: Optional[str]  # None when no backend opens
    reason: str
    ranking: Tuple[str, ...] = ()  # the backends that probe available, best first

    def __str__(self) -> str:
        return f"backend='auto' chooses {self.name}: {self.reason}" if self.name else f"backend='auto': {self.reason}"


def _open_device(probe: ProbeResult) -> Optional[DeviceInfo]:
    """The device a backend would open: the one its probe marks ``selected``, else its first."""
    devices = tuple(probe.devices)
    return next((d for d in devices if d.details.get("selected")), devices[0] if devices else None)


def _kind_rank(device: Optional[DeviceInfo]) -> int:
    return DEVICE_KIND_RANK.get(device.kind, _OTHER_KIND_RANK) if device is not None else _OTHER_KIND_RANK


def _kind_words(device: DeviceInfo) -> str:
    return _KIND_WORDS.get(device.kind, f"a device of kind {device.kind!r}")


def _describe_device(device: DeviceInfo) -> str:
    where = device.details.get("platform")
    return device.name + (f" on {where}" if where else "")


@dataclass(frozen=True)
class PluginStatus:
    """What ``list_plugins()`` reports for any plugin (backend or analysis)."""

    name: str
    kind: str  # "backend", "analysis" or "broken"
    source: str
    summary: str
    error: str = ""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _bind(caller: Any, impl: Any) -> Callable:
    """The implementation as a plain callable taking the spec's arguments positionally.

    pluggy lets an implementation accept a subset of the spec's arguments; map them once here
    so the hot path is a direct call.
    """
    spec_args = tuple(caller.spec.argnames)
    impl_args = tuple(impl.argnames)
    if impl_args == spec_args:
        return impl.function
    picks = tuple(spec_args.index(a) for a in impl_args)
    fn = impl.function
    return lambda *args: fn(*[args[i] for i in picks])


class Backend:
    """A backend opened on a device: its context and its own hook implementations, bound once.

    ``lock`` serializes transactions on the context (a step's stage -> step -> finish), whose
    staging buffers and launch caches are shared by every optimizer on it. ``step`` is the
    plugin's :func:`~optirs.plugin.hookspecs.optirs_step` (or the adapter of the per-optimizer
    hooks of earlier releases), ``support`` its :class:`~optirs.plugin.hookspecs.StepSupport`.
    :meth:`plugin_error` is how a feature reports a hook's own exception.
    """

    def __init__(self, registry: "Registry", name: str, plugin: Any, options: Dict[str, Any]):
        self.name = name
        self.plugin = plugin
        self.options = dict(options)
        missing = [h for h in REQUIRED_BACKEND_HOOKS if registry.implementation(name, h) is None]
        if missing:
            raise BackendUnavailableError(f"backend {name!r} does not implement the required hooks {missing}")
        probe = registry.probe(name, options)
        if not probe.available:
            raise BackendUnavailableError(f"backend {name!r} cannot open: {probe.reason}")
        self.devices: Tuple[DeviceInfo, ...] = tuple(probe.devices)
        try:
            self.ctx = registry.implementation(name, "optirs_open")(self.options)
        except GpuOptimError:
            raise
        except Exception as exc:  # a plugin's own failure, named
            raise PluginError(f"plugin {name!r} raised {type(exc).__name__} in optirs_open: {exc}") from exc
        self.lock = threading.RLock()
        impl = lambda hook: registry.implementation(name, hook)  # noqa: E731
        self.alloc = impl("optirs_alloc")
        self.to_device = impl("optirs_to_device")
        self.to_host = impl("optirs_to_host")
        self.stage = impl("optirs_stage")
        self._synchronize = impl("optirs_synchronize")
        self._host_view = impl("optirs_host_view")
        self.support: StepSupport = registry.step_support(name)
        self.optimizers = self.support.optimizers
        step = impl("optirs_step")
        if step is None:
            self._legacy = {opt: impl(hook) for opt, hook in LEGACY_STEP_HOOKS.items() if impl(hook) is not None}
            if self._legacy:
                warnings.warn(
                    f"optirs: plugin {name!r} implements the per-optimizer step hooks "
                    f"{sorted(LEGACY_STEP_HOOKS[o] for o in self._legacy)}, which optirs adapts for one more "
                    "release; implement optirs_step and optirs_step_support instead (docs/plugins.md)",
                    PluginDeprecationWarning, stacklevel=4)
            step = self._legacy_step
        self.step: Callable[[Any, StepRequest], None] = step
        self._hooks: Dict[str, Optional[Callable]] = {}
        self._impl = impl
        self.capabilities = registry.capabilities(name)

    def supports(self, capability: str) -> bool:
        """Whether this backend implements every hook of ``capability`` (a key of CAPABILITIES), or
        runs the step capability ``capability`` (``"formats"``, ``"capturable"``) for some optimizer."""
        return capability in self.capabilities

    def steps(self, optimizer: str, fmt: Any = None, device_scalars: bool = False) -> bool:
        """Whether :attr:`step` runs ``optimizer`` in float32 (``fmt`` None or plain), in a step format,
        or with device-side scalars."""
        if device_scalars:
            return optimizer in self.support.capturable
        if fmt is not None and not fmt.plain:
            return optimizer in self.support.formats and fmt.state_dtype in self.support.state_dtypes
        return optimizer in self.support.optimizers

    def hook(self, capability: str, hook: str) -> Callable:
        """This backend's own implementation of ``hook``, bound once, for the feature ``capability``.

        Features above the interface call this instead of asking which backend they run on.

        :raises UnsupportedOperationError: naming the backend and the capability when it lacks the hook.
        """
        fn = self._hooks.get(hook)
        if fn is None:
            fn = self._impl(hook)
            if fn is None:
                raise UnsupportedOperationError(
                    f"backend {self.name!r} does not implement the {capability!r} capability (hook {hook}); "
                    f"it implements {sorted(self.capabilities)}"
                )
            self._hooks[hook] = fn
        return fn

    def step_hook(self, optimizer: str) -> str:
        """The name of the hook :attr:`step` runs for ``optimizer`` (for messages)."""
        return LEGACY_STEP_HOOKS[optimizer] if self.step == self._legacy_step else "optirs_step"

    def _legacy_step(self, ctx: Any, request: StepRequest) -> None:
        """A request run by the per-optimizer hooks of earlier releases: float32 steps, found_inf read on the host."""
        name = request.definition.name
        fn = self._legacy.get(name)
        controls = request.controls
        if fn is None or request.fmt is not None or controls.device is not None or controls.check_finite:
            what = (f"the {name!r} step" if fn is None else "step formats" if request.fmt is not None
                    else "device-side scalars" if controls.device is not None else "check_finite")
            raise UnsupportedOperationError(
                f"backend {self.name!r} does not run {what}{'' if fn is None else f' for {name!r}'}; it steps "
                f"{list(self.optimizers)} in float32 through the per-optimizer hooks of earlier releases")
        flag = controls.found_inf
        if flag is not None:
            host = flag if isinstance(flag, np.ndarray) else np.asarray(self.to_host(ctx, flag))
            if host.reshape(-1)[0] != 0:
                return
        fn(ctx, request.params, request.grads, request.state, request.layout, request.scalars)

    def host_view(self, array: Any) -> Optional[Any]:
        """A zero-copy device array over a C-contiguous host array, or None where the backend must copy."""
        if self._host_view is None or not array.flags.c_contiguous:
            return None
        return self._host_view(self.ctx, array)

    def plugin_error(self, exc: BaseException, hook: str) -> BaseException:
        """What a feature raises for an exception out of this backend's ``hook``: optirs' own
        errors as they are, anything else as a PluginError naming the plugin (raise it ``from exc``)."""
        if isinstance(exc, GpuOptimError) or not isinstance(exc, Exception):
            return exc
        return PluginError(f"plugin {self.name!r} raised {type(exc).__name__} in {hook}: {exc}")

    def synchronize(self) -> None:
        if self._synchronize is not None:
            self._synchronize(self.ctx)

    def __repr__(self) -> str:
        return f"<optirs Backend {self.name!r} devices={[d.name for d in self.devices]}>"


class Registry:
    """Owns the pluggy PluginManager and the opened backends."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pm: Optional[pluggy.PluginManager] = None
        self.records: Dict[str, PluginRecord] = {}
        self._opened: Dict[Tuple[str, Tuple], Backend] = {}
        self._auto: Dict[Tuple, AutoChoice] = {}  # choose_auto's answers, per options and candidates
        self._support: Dict[str, StepSupport] = {}  # optirs_step_support's answers, per plugin

    # ------------------------------------------------------------ loading

    @property
    def pm(self) -> pluggy.PluginManager:
        with self._lock:
            if self._pm is None:
                self._pm = pluggy.PluginManager(hookspecs.PROJECT)
                self._pm.add_hookspecs(hookspecs)
                for name, (module, _) in BUILTIN_PLUGINS.items():
                    self._load(name, f"built-in ({module})", lambda m=module: importlib.import_module(m).plugin)
                if not os.environ.get(AUTOLOAD_ENV):
                    self._load_entry_points()
            return self._pm

    def _load_entry_points(self) -> None:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = getattr(ep, "dist", None)
            where = f"entry point {ep.value!r}" + (f" of {dist.name} {dist.version}" if dist else "")
            self._load(ep.name, where, ep.load)

    def _load(self, name: str, source: str, loader: Callable[[], Any]) -> None:
        try:
            self._register(name, source, loader())
        except Exception as exc:  # a broken plugin must not break the host
            error = f"{type(exc).__name__}: {exc}"
            if name not in self.records or self.records[name].broken:  # never shadow a working plugin
                self.records[name] = PluginRecord(name, source, None, error + "\n" + traceback.format_exc(limit=3))
            warnings.warn(f'optirs: error loading plugin "{name}" from {source}: {error}', PluginWarning, stacklevel=3)

    def _check_plugin(self, name: Any, plugin: Any) -> None:
        """A plugin is a module, class or object with at least one ``optirs_*`` hook implementation,
        under a non-empty string name that is not ``"auto"``; anything else would be recorded and
        break ``list_backends()``/``get_backend()`` later."""
        if not isinstance(name, str) or not name.strip() or name == "auto":
            raise PluginError(f"plugin name {name!r}, expected a non-empty string other than 'auto'")
        if plugin is None or isinstance(plugin, (bool, int, float, complex, str, bytes)):
            raise PluginError(
                f"plugin {name!r} is {plugin!r} ({type(plugin).__name__}), expected a module, class or object "
                "with @hookimpl methods named after optirs hooks (optirs_probe, optirs_open, ...)"
            )
        pm = self._pm
        assert pm is not None
        hooks = [attr for attr in dir(plugin) if attr.startswith("optirs_")
                 and pm.parse_hookimpl_opts(plugin, attr) is not None]
        if not hooks:
            raise PluginError(
                f"plugin {name!r} ({type(plugin).__module__}.{type(plugin).__qualname__}) implements no optirs hook, "
                "expected @hookimpl methods named after optirs hooks (optirs_probe, optirs_open, ...)"
            )

    def _register(self, name: str, source: str, plugin: Any) -> None:
        if inspect.isclass(plugin):
            plugin = plugin()
        self._check_plugin(name, plugin)
        if name in self.records and not self.records[name].broken:
            raise PluginError(f"a plugin named {name!r} is already registered (from {self.records[name].source})")
        pm = self._pm
        assert pm is not None
        try:
            pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name!r} does not match the hook specifications: {_one_line(exc)}") from exc
        except ValueError as exc:
            raise PluginError(f"plugin {name!r} could not be registered: {exc}") from exc
        try:
            pm.check_pending()
        except pluggy.PluginValidationError as exc:
            pm.unregister(plugin)
            raise PluginError(f"plugin {name!r} has a hook with no specification (misspelt?): {_one_line(exc)}") from exc
        self.records[name] = PluginRecord(name, source, plugin)

    def register(self, plugin: Any, name: str, source: str = "registered at run time") -> None:
        """Register a plugin object (or class) under ``name``; raises PluginError when it is invalid."""
        with self._lock:
            self.pm  # load built-ins first, so names clash visibly
            self._register(name, source, plugin)

    def reload(self) -> None:
        """Forget every plugin and opened backend; the next use loads them again (tests, after installs)."""
        with self._lock:
            self._pm = None
            self.records.clear()
            self._opened.clear()
            self._auto.clear()
            self._support.clear()

    def unregister(self, name: str) -> None:
        with self._lock:
            record = self.records.pop(name, None)
            self._support.pop(name, None)
            if record is not None and record.plugin is not None:
                self.pm.unregister(record.plugin)
            for key in [k for k in self._opened if k[0] == name]:
                del self._opened[key]

    # ------------------------------------------------------------ looking up

    def implementation(self, name: str, hook: str) -> Optional[Callable]:
        """The named plugin's own implementation of ``hook``, bound for direct calls, or None."""
        record = self.records.get(name)
        if record is None or record.plugin is None:
            return None
        caller = getattr(self.pm.hook, hook)
        for impl in caller.get_hookimpls():
            if impl.plugin is record.plugin:
                return _bind(caller, impl)
        return None

    def kind(self, name: str) -> str:
        record = self.records[name]
        if record.broken:
            return "broken"
        return "backend" if self.implementation(name, "optirs_probe") is not None else "analysis"

    def backend_names(self) -> List[str]:
        """Backends, including broken plugins that are (or, for third parties, may be) backends."""
        self.pm
        return [n for n, r in self.records.items()
                if self.kind(n) == "backend" or (r.broken and BUILTIN_PLUGINS.get(n, ("", "backend"))[1] == "backend")]

    def probe(self, name: str, options: Optional[Dict[str, Any]] = None) -> ProbeResult:
        record = self.records[name]
        if record.broken:
            return ProbeResult(False, f"plugin is broken: {record.error.splitlines()[0]}")
        probe = self.implementation(name, "optirs_probe")
        try:
            result = probe(dict(options or {}))
        except Exception as exc:  # probing must not raise; report instead
            return ProbeResult(False, f"probe raised {type(exc).__name__}: {exc}")
        return result if isinstance(result, ProbeResult) else ProbeResult(False, f"probe returned {result!r}")

    def torch_devices(self, name: str) -> Optional[Tuple[str, ...]]:
        """The torch device types the named backend could step (``optirs_torch_devices``), or None
        where it does not say (or its answer is broken: then only opening it tells)."""
        self.pm  # the plugins load on first use
        answer = self.implementation(name, "optirs_torch_devices")
        if answer is None:
            return None
        try:
            devices = answer()
            if isinstance(devices, str) or not all(isinstance(d, str) for d in devices):
                raise TypeError(f"returned {devices!r}, expected a tuple of torch device type strings")
            return tuple(devices)
        except Exception as exc:  # noqa: BLE001 - a broken answer: open the backend to know
            warnings.warn(f"optirs: plugin {name!r}'s optirs_torch_devices failed: {type(exc).__name__}: {exc}",
                          PluginWarning, stacklevel=3)
            return None

    def step_support(self, name: str) -> StepSupport:
        """What the named backend's step runs: its ``optirs_step_support`` answer; a plugin with
        ``optirs_step`` but no answer steps every optimizer in float32; one with only the
        per-optimizer hooks of earlier releases, those optimizers in float32."""
        hit = self._support.get(name)
        if hit is not None:
            return hit
        from optirs.core.definitions import DEFINITIONS

        if self.implementation(name, "optirs_step") is not None:
            answer = self.implementation(name, "optirs_step_support")
            support = StepSupport(tuple(DEFINITIONS))
            if answer is not None:
                try:
                    support = self._checked_support(name, answer())
                except Exception as exc:  # a broken answer: the backend steps nothing, and says why
                    support = StepSupport()
                    warnings.warn(f"optirs: plugin {name!r}'s optirs_step_support failed, so it steps nothing: "
                                  f"{type(exc).__name__}: {exc}", PluginWarning, stacklevel=3)
        else:
            support = StepSupport(tuple(opt for opt, hook in LEGACY_STEP_HOOKS.items()
                                        if self.implementation(name, hook) is not None))
        self._support[name] = support
        return support

    @staticmethod
    def _checked_support(name: str, got: Any) -> StepSupport:
        from optirs.core.definitions import DEFINITIONS

        if not isinstance(got, StepSupport):
            raise PluginError(f"plugin {name!r}'s optirs_step_support returned {got!r}, expected a StepSupport")
        from optirs.core.formats import STATE_DTYPES

        unknown = sorted(set(got.optimizers + got.formats + got.capturable) - set(DEFINITIONS))
        if unknown:
            raise PluginError(f"plugin {name!r}'s optirs_step_support names {unknown}, expected optimizer "
                              f"definitions {sorted(DEFINITIONS)}")
        if isinstance(got.state_dtypes, str) or not set(got.state_dtypes) <= set(STATE_DTYPES):
            raise PluginError(f"plugin {name!r}'s optirs_step_support has state_dtypes={got.state_dtypes!r}, "
                              f"expected a tuple of {list(STATE_DTYPES)}")
        kinds = (got.optimizers, got.formats, got.capturable)
        return StepSupport(*(tuple(d for d in DEFINITIONS if d in field) for field in kinds),
                           state_dtypes=tuple(d for d in STATE_DTYPES if d in got.state_dtypes))

    def capabilities(self, name: str) -> Tuple[str, ...]:
        """The capabilities (keys of CAPABILITIES) whose every hook the named plugin implements, and the
        step capabilities (STEP_CAPABILITIES) its step runs for some optimizer."""
        caps = [cap for cap, hooks in CAPABILITIES.items()
                if all(self.implementation(name, h) is not None for h in hooks)]
        if self.implementation(name, "optirs_step") is not None:
            support = self.step_support(name)
            caps += [cap for cap in STEP_CAPABILITIES if getattr(support, cap)]
        return tuple(caps)

    def optimizers(self, name: str) -> Tuple[str, ...]:
        return self.step_support(name).optimizers

    def list_backends(self, options: Optional[Dict[str, Any]] = None) -> List[BackendStatus]:
        out = []
        for name in self.backend_names():
            probe = self.probe(name, options)
            record = self.records[name]
            out.append(BackendStatus(name, probe.available, probe.reason, tuple(probe.devices),
                                     self.optimizers(name), record.source, self.capabilities(name)))
        return out

    def list_plugins(self) -> List[PluginStatus]:
        self.pm
        out = []
        for name, record in self.records.items():
            info: Dict[str, str] = {}
            describe = self.implementation(name, "optirs_plugin_info")
            if describe is not None:
                try:
                    info = describe() or {}
                except Exception as exc:
                    info = {"summary": f"(optirs_plugin_info raised {exc!r})"}
            out.append(PluginStatus(name, self.kind(name), record.source, info.get("summary", ""),
                                    record.error.splitlines()[0] if record.error else ""))
        return out

    def check_backend_name(self, name: str) -> None:
        """Raise BackendUnavailableError unless ``name`` is ``"auto"`` or a known backend plugin.

        Loads the plugins (once) but probes no device, so optimizers can check their config at
        construction.
        """
        with self._lock:
            self.pm
            if name == "auto" or name in self.backend_names():
                return
            if name in self.records:
                raise BackendUnavailableError(f"plugin {name!r} is an analysis plugin, not a backend")
            known = ", ".join(sorted(self.backend_names())) or "none"
            raise BackendUnavailableError(f"unknown backend {name!r}; known backends: {known} (or 'auto')")

    def choose_auto(self, options: Optional[Dict[str, Any]] = None) -> AutoChoice:
        """Which backend ``"auto"`` opens here, and why, from the probes of SUPPORTED_BACKENDS.

        Each candidate that probes available is ranked by the kind of the device it would open
        (DEVICE_KIND_RANK); among GPUs and accelerators the first in probe order wins, among CPUs
        the last (the host's own backend), among simulators the first. Probes only; opens nothing.
        """
        options = dict(options or {})
        with self._lock:
            self.pm
            order = tuple(SUPPORTED_BACKENDS)
            key = (order, tuple(self.records), tuple(sorted((k, repr(v)) for k, v in options.items())))
            hit = self._auto.get(key)
            if hit is not None:
                return hit
            found: List[Tuple[Tuple[int, int], str, Optional[DeviceInfo], ProbeResult]] = []
            missing: List[str] = []
            for pos, candidate in enumerate(order):
                if candidate not in self.records:
                    missing.append(f"{candidate}: not installed")
                    continue
                if not self.records[candidate].broken and self.kind(candidate) != "backend":
                    missing.append(f"{candidate}: an analysis plugin, not a backend")
                    continue
                probe = self.probe(candidate, options)
                if not probe.available:
                    missing.append(f"{candidate}: {probe.reason}")
                    continue
                device = _open_device(probe)
                rank = _kind_rank(device)
                found.append(((rank, -pos if rank == DEVICE_KIND_RANK["cpu"] else pos), candidate, device, probe))
            found.sort(key=lambda f: f[0])
            if not found:
                choice = AutoChoice(None, "no backend could open: " + "; ".join(missing))
            else:
                choice = AutoChoice(found[0][1], self._auto_reason(found, missing), tuple(f[1] for f in found))
            self._auto[key] = choice
            return choice

    @staticmethod
    def _auto_reason(found: List[Tuple], missing: List[str]) -> str:
        (rank, _), name, device, _ = found[0]
        what = f"{_describe_device(device)}, {_kind_words(device)}" if device is not None else "a device of unknown kind"
        if rank == DEVICE_KIND_RANK["gpu"]:
            parts = [f"it opens on {what}; a GPU or accelerator backend beats a CPU one"]
        else:
            parts = []
            for (_, _), other, other_device, probe in found[1:]:
                if other_device is None:
                    continue
                only = "only device is" if len(probe.devices) == 1 else "device is"
                parts.append(f"{other}'s {only} {_kind_words(other_device)} ({_describe_device(other_device)})")
            if rank == DEVICE_KIND_RANK["cpu"]:
                tail = f"where the host's own {name} backend is faster" if parts else f"it runs on {what}"
            else:
                tail = f"it runs on {what} (no GPU, accelerator or CPU backend opens)"
            parts = [", ".join(parts + [tail]) if parts else tail]
            if rank == DEVICE_KIND_RANK["cpu"]:
                parts.append("no GPU or accelerator backend opens")
        if missing:
            parts.append("; ".join(missing))
        return "; ".join(parts)

    def get_backend(self, name: str = "auto", options: Optional[Dict[str, Any]] = None) -> Backend:
        """Open (once) and return the backend called ``name``; ``"auto"``: the one ``choose_auto`` ranks first that opens."""
        options = dict(options or {})
        with self._lock:
            self.pm
            if name == "auto":
                choice = self.choose_auto(options)
                reasons = []
                for candidate in choice.ranking:
                    try:
                        return self.get_backend(candidate, options)
                    except BackendUnavailableError as exc:
                        reasons.append(f"{candidate}: {exc}")
                if choice.name is None:
                    raise BackendUnavailableError(choice.reason)
                raise BackendUnavailableError("no backend could open: " + "; ".join(reasons) + f" (probes: {choice.reason})")
            record = self.records.get(name)
            if record is None:
                known = ", ".join(sorted(self.backend_names())) or "none"
                raise BackendUnavailableError(f"unknown backend {name!r}; known backends: {known}")
            if record.broken:
                raise BackendUnavailableError(f"backend {name!r} is broken: {record.error.splitlines()[0]}")
            if self.kind(name) != "backend":
                raise BackendUnavailableError(f"plugin {name!r} is an analysis plugin, not a backend")
            key = (name, tuple(sorted((k, repr(v)) for k, v in options.items())))
            if key not in self._opened:
                self._opened[key] = Backend(self, name, record.plugin, options)
            return self._opened[key]

    def launch_config(self, kernel: Any, device: Any, elements: int) -> Optional[Any]:
        """Ask the analysis plugins for a (grid, block) launch configuration."""
        return self.pm.hook.optirs_launch_config(kernel=kernel, device=device, elements=elements)


REGISTRY = Registry()


def list_backends(options: Optional[Dict[str, Any]] = None) -> List[BackendStatus]:
    """Every known backend: whether it opens, why not, its devices and the optimizers it implements."""
    return REGISTRY.list_backends(options)


def list_plugins() -> List[PluginStatus]:
    """Every known plugin, backends and analyses, with broken ones and their errors."""
    return REGISTRY.list_plugins()


def get_backend(name: str = "auto", **options: Any) -> Backend:
    """The opened backend called ``name`` (``"auto"``: the fastest kind of device found, see :func:`choose_auto`)."""
    return REGISTRY.get_backend(name, options)


def choose_auto(**options: Any) -> AutoChoice:
    """Which backend ``backend="auto"`` opens on this machine, and why (nothing is opened)."""
    return REGISTRY.choose_auto(options)


def register_plugin(plugin: Any, name: str) -> None:
    """Register a backend or analysis plugin at run time (tests, notebooks)."""
    REGISTRY.register(plugin, name)


def unregister_plugin(name: str) -> None:
    REGISTRY.unregister(name)
