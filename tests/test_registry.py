"""The plugin registry: built-ins, entry points (real pip-installed packages), broken plugins, choosing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import optirs
from optirs.core import reference
from optirs.plugin import registry
from optirs.core.errors import BackendUnavailableError, PluginError, UnsupportedOperationError
from optirs.plugin.hookspecs import DeviceInfo, ProbeResult, hookimpl
from optirs.plugin.registry import REGISTRY, PluginWarning

from conftest import FakeHostBackend

PLUGINS = Path(__file__).parent / "plugins"


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory):
    """The two plugin packages in tests/plugins, pip-installed (with their entry points) into a folder."""
    target = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
           "--target", str(target), str(PLUGINS / "optirs_numpy_backend"), str(PLUGINS / "optirs_broken_plugin")]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return target


@pytest.fixture
def with_plugins(plugin_site, monkeypatch, fresh_registry):
    """The registry as it loads with the third-party packages importable."""
    import importlib

    monkeypatch.syspath_prepend(str(plugin_site))
    importlib.invalidate_caches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh_registry.pm
    yield caught
    for mod in [m for m in sys.modules if m.startswith(("optirs_numpy_backend", "optirs_broken_plugin"))]:
        del sys.modules[mod]


def test_entry_point_backend_is_selected_by_name_and_steps(with_plugins, rng):
    statuses = {s.name: s for s in optirs.list_backends()}
    assert statuses["numpy"].available
    assert statuses["numpy"].optimizers == ("adam", "sgd")
    assert "optirs-numpy-backend" in statuses["numpy"].source
    params = [rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal(7).astype(np.float32)]
    grads = [[rng.standard_normal(p.shape).astype(np.float32) for p in params] for _ in range(5)]
    for cls, name, hp in [(optirs.GpuSgd, "sgd", optirs.SgdParams(lr=0.1, momentum=0.9, nesterov=True)),
                          (optirs.GpuAdam, "adam", optirs.AdamParams(lr=0.01, amsgrad=True))]:
        mine = [p.copy() for p in params]
        opt = cls(hp, optirs.GpuOptimizerConfig(backend="numpy"))
        for g in grads:
            opt.step_gpu(mine, g)
        expected, _ = reference.run(name, params, grads, hp)
        for a, e in zip(mine, expected):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
        assert opt.backend.name == "numpy"


def test_partial_backend_raises_unsupported_and_changes_nothing(with_plugins, rng):
    p = rng.standard_normal(8).astype(np.float32)
    before = p.copy()
    opt = optirs.GpuRmsprop(config=optirs.GpuOptimizerConfig(backend="numpy"))
    with pytest.raises(UnsupportedOperationError, match=r"'numpy'.*'rmsprop'"):
        opt.step_gpu(p, np.ones_like(p))
    np.testing.assert_array_equal(p, before)
    assert opt.step_count == 0 and opt.state_dict()["state"] == []


def test_broken_plugins_are_reported_and_harmless(with_plugins, rng):
    messages = [str(w.message) for w in with_plugins if issubclass(w.category, PluginWarning)]
    for name in ("broken_import", "broken_misspelt", "broken_signature"):
        assert any(f'"{name}"' in m for m in messages), messages
    plugins = {p.name: p for p in optirs.list_plugins()}
    assert plugins["broken_import"].kind == "broken" and "deliberately broken" in plugins["broken_import"].error
    assert "optirs_step_adamm" in plugins["broken_misspelt"].error
    assert "device_index" in plugins["broken_signature"].error
    for name in ("broken_import", "broken_misspelt", "broken_signature"):
        with pytest.raises(BackendUnavailableError, match="broken"):
            optirs.get_backend(name)
    # The built-in backend and the working third-party one still work.
    p = rng.standard_normal(3).astype(np.float32)
    optirs.GpuSgd(config=optirs.GpuOptimizerConfig(backend="cpu")).step_gpu(p, np.ones_like(p))
    assert optirs.get_backend("numpy").name == "numpy"


def test_autoload_can_be_disabled(plugin_site, monkeypatch, fresh_registry):
    monkeypatch.syspath_prepend(str(plugin_site))
    monkeypatch.setenv("OPTIRS_DISABLE_PLUGIN_AUTOLOAD", "1")
    names = {p.name for p in optirs.list_plugins()}
    assert "cpu" in names and "numpy" not in names and "broken_import" not in names


def test_import_is_light_and_survives_broken_plugins(plugin_site):
    """`import optirs` loads no plugin and no compiler; first use loads plugins and only warns."""
    code = textwrap.dedent("""
        import sys, warnings
        import optirs
        heavy = [m for m in ("numba", "pyopencl", "optirs_numpy_backend", "optirs_broken_plugin") if m in sys.modules]
        assert not heavy, heavy
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            names = [b.name for b in optirs.list_backends()]
        assert "numpy" in names and "cpu" in names, names
        print("ok", len(w))
    """)
    env = {**__import__("os").environ, "PYTHONPATH": str(plugin_site)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_unknown_backend_lists_known_names(fresh_registry):
    with pytest.raises(BackendUnavailableError, match=r"unknown backend 'nope'; known backends: .*cpu"):
        optirs.get_backend("nope")


class FakeGpuBackend(FakeHostBackend):
    """FakeHostBackend whose device is a GPU: ``auto`` prefers it to a CPU backend."""

    @hookimpl
    def optirs_probe(self, options):
        return ProbeResult(self.available, "" if self.available else "no fake device", (DeviceInfo("fake", "gpu"),))


def test_auto_probes_in_order(fresh_registry, monkeypatch):
    monkeypatch.setattr(registry, "SUPPORTED_BACKENDS", ("fake_gpu", "cpu"))
    fake = FakeGpuBackend(available=False)
    optirs.register_plugin(fake, "fake_gpu")
    assert optirs.get_backend("auto").name == "cpu"
    with pytest.raises(BackendUnavailableError, match="cannot open: no fake device"):
        optirs.get_backend("fake_gpu")
    fresh_registry.reload()
    optirs.register_plugin(FakeGpuBackend(available=True), "fake_gpu")
    assert optirs.get_backend("auto").name == "fake_gpu"
    assert optirs.GpuAdam().backend.name == "fake_gpu"


def test_default_auto_picks_fastest_kind_of_builtin(fresh_registry):
    """auto: the first available GPU/accelerator backend in probe order, else the last CPU one."""
    status = {s.name: s for s in optirs.list_backends() if s.available and s.devices}
    order = [n for n in optirs.SUPPORTED_BACKENDS if n in status]
    gpus = [n for n in order if status[n].devices[0].kind in ("gpu", "accelerator")]
    cpus = [n for n in order if status[n].devices[0].kind == "cpu"]
    expected = gpus[0] if gpus else cpus[-1] if cpus else order[0]
    assert optirs.get_backend().name == expected


def test_backend_without_step_hooks_raises_unsupported(fresh_registry):
    optirs.register_plugin(FakeHostBackend(), "nosteps")
    status = {s.name: s for s in optirs.list_backends()}["nosteps"]
    assert status.optimizers == ()
    p = np.ones(3, np.float32)
    with pytest.raises(UnsupportedOperationError, match=r"backend 'nosteps' does not run the 'adam' step; it runs \[\]"):
        optirs.GpuAdam(config=optirs.GpuOptimizerConfig(backend="nosteps")).step_gpu(p, p.copy())
    np.testing.assert_array_equal(p, 1.0)


def test_backend_missing_required_hooks_cannot_open(fresh_registry):
    class Half:
        @hookimpl
        def optirs_probe(self, options):
            return ProbeResult(True)

    optirs.register_plugin(Half(), "half")
    with pytest.raises(BackendUnavailableError, match="required hooks"):
        optirs.get_backend("half")


def test_runtime_registration_validates(fresh_registry):
    class Misspelt:
        @hookimpl
        def optirs_step_sgdd(self, ctx):
            pass

    class BadArgs:
        @hookimpl
        def optirs_alloc(self, ctx, size, dtype, fill, pinned):
            pass

    with pytest.raises(PluginError, match="optirs_step_sgdd"):
        optirs.register_plugin(Misspelt(), "misspelt")
    with pytest.raises(PluginError, match="pinned"):
        optirs.register_plugin(BadArgs(), "badargs")
    with pytest.raises(PluginError, match="already registered"):
        optirs.register_plugin(FakeHostBackend(), "cpu")
    assert "misspelt" not in {p.name for p in optirs.list_plugins()}
    assert optirs.get_backend("cpu").name == "cpu"


def test_probe_that_raises_is_reported(fresh_registry):
    class Exploding(FakeHostBackend):
        @hookimpl
        def optirs_probe(self, options):
            raise OSError("driver exploded")

    optirs.register_plugin(Exploding(), "exploding")
    status = {s.name: s for s in optirs.list_backends()}["exploding"]
    assert not status.available and "driver exploded" in status.reason


def test_step_hook_is_bound_once(fresh_registry):
    """The hot path calls the chosen plugin's own function, not the whole hook relay."""
    cpu = optirs.get_backend("cpu")
    assert cpu.step.__self__ is REGISTRY.records["cpu"].plugin
    assert optirs.get_backend("cpu") is cpu
