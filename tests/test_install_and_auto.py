"""Fresh installs and ``backend="auto"``.

* The ``cuda`` extra caps numpy below the first release numba-cuda cannot import with, and the
  cuda probe says why numba.cuda does not import (the error, the likely cause, the fix).
* ``auto`` picks by the kind of device each backend would open: a GPU or accelerator first, an
  OpenCL CPU device never over the host's own ``cpu`` backend, a simulator last; ``optirs info``
  says which it chose and why.
* An unknown backend name fails when the optimizer is made, without probing any device.
"""

from __future__ import annotations

import builtins
import sys
from pathlib import Path

import numpy as np
import pytest

import optirs
from optirs.core.errors import BackendUnavailableError
from optirs.optim.optimizers import OPTIMIZERS
from optirs.plugin import registry
from optirs.plugin.hookspecs import DeviceInfo, ProbeResult, hookimpl
from optirs.plugin.registry import REGISTRY

from conftest import FakeHostBackend

ROOT = Path(__file__).resolve().parents[1]
ROW_STACK_ERROR = "module 'numpy' has no attribute 'row_stack'"


# ---------------------------------------------------------------- the cuda extra and the cuda probe


def _cuda_extra():
    tomllib = pytest.importorskip("tomllib")
    requirements = pytest.importorskip("packaging.requirements")
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return [requirements.Requirement(r) for r in project["optional-dependencies"]["cuda"]]


def test_cuda_extra_caps_numpy_below_2_5_and_keeps_the_installed_numpy():
    numpy_reqs = [r for r in _cuda_extra() if r.name == "numpy"]
    assert numpy_reqs, "the cuda extra does not constrain numpy"
    spec = numpy_reqs[0].specifier
    assert not spec.contains("2.5.0", prereleases=True), spec  # numba-cuda 0.30.4 fails with numpy 2.5
    # CI installs .[all] (which includes the cuda extra) beside the numpy installed here.
    assert spec.contains(np.__version__, prereleases=True), (spec, np.__version__)


@pytest.fixture
def numba_cuda_import_fails(monkeypatch):
    """``from numba import cuda`` raises what numba-cuda 0.30.4 raises with numpy 2.5."""
    real_import = builtins.__import__

    def fake_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name.startswith("numba.cuda") or (name == "numba" and fromlist and "cuda" in fromlist):
            raise AttributeError(ROW_STACK_ERROR)
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(np, "__version__", "2.5.0")


def _check_reason(reason: str) -> None:
    assert ROW_STACK_ERROR in reason, reason  # the exception text
    assert "AttributeError" in reason, reason
    assert "numpy 2.5.0" in reason and "numba-cuda" in reason, reason  # the versions involved
    assert "numpy<2.5" in reason, reason  # the fix


def test_cuda_probe_explains_a_numpy_incompatibility(numba_cuda_import_fails):
    from optirs.backends.cuda import plugin

    result = plugin.optirs_probe({})
    assert not result.available
    _check_reason(result.reason)


def test_registry_reports_the_cuda_import_failure(fresh_registry, numba_cuda_import_fails):
    status = {s.name: s for s in optirs.list_backends()}["cuda"]
    assert not status.available
    _check_reason(status.reason)
    assert "probe raised" not in status.reason  # the probe explains; the registry's fallback is not needed


def test_optirs_info_says_why_cuda_is_unavailable(fresh_registry, numba_cuda_import_fails, monkeypatch, capsys):
    pytest.importorskip("rich")
    from optirs.tools import cli

    monkeypatch.setenv("COLUMNS", "4000")  # one line per cell, so the text can be matched
    assert cli.main(["info"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ROW_STACK_ERROR in out and "numpy<2.5" in out, out


# ---------------------------------------------------------------- auto: by device kind


def _fake(kind: str, available: bool = True, opens: bool = True, n_devices: int = 1):
    class Fake(FakeHostBackend):
        @hookimpl
        def optirs_probe(self, options):
            devices = tuple(DeviceInfo(f"fake {kind} {i}", kind) for i in range(n_devices))
            return ProbeResult(available, "" if available else f"no fake {kind}", devices)

        @hookimpl
        def optirs_open(self, options):
            if not opens:
                raise BackendUnavailableError(f"fake {kind} failed to open")
            return object()

    return Fake()


@pytest.fixture
def fakes(fresh_registry, monkeypatch):
    """Register fake backends in probe order: fakes({"name": plugin, ...}) -> the registry."""

    def setup(plugins):
        monkeypatch.setattr(registry, "SUPPORTED_BACKENDS", tuple(plugins))
        for name, plugin in plugins.items():
            optirs.register_plugin(plugin, name)
        return fresh_registry

    return setup


def test_auto_prefers_a_gpu_later_in_probe_order(fakes):
    fakes({"cl_cpu": _fake("cpu"), "gpu": _fake("gpu"), "host": _fake("cpu")})
    assert optirs.get_backend("auto").name == "gpu"
    choice = registry.choose_auto()
    assert choice.name == "gpu" and choice.ranking[0] == "gpu"
    assert "gpu" in choice.reason


def test_auto_prefers_an_accelerator_to_cpus(fakes):
    fakes({"cl_cpu": _fake("cpu"), "acc": _fake("accelerator"), "host": _fake("cpu")})
    assert optirs.get_backend("auto").name == "acc"


def test_auto_among_cpu_devices_takes_the_hosts_own_backend(fakes):
    fakes({"gpu": _fake("gpu", available=False), "cl_cpu": _fake("cpu"), "host": _fake("cpu")})
    assert optirs.get_backend("auto").name == "host"
    text = str(registry.choose_auto())
    assert text.startswith("backend='auto' chooses host: "), text
    assert "cl_cpu's only device is a CPU" in text, text
    assert "gpu: no fake gpu" in text, text  # why the GPU backend lost


def test_auto_ranks_a_simulator_last(fakes):
    fakes({"sim": _fake("simulator"), "host": _fake("cpu")})
    assert optirs.get_backend("auto").name == "host"
    optirs.unregister_plugin("host")
    assert optirs.get_backend("auto").name == "sim"


def test_auto_falls_back_when_the_best_backend_fails_to_open(fakes):
    fakes({"gpu": _fake("gpu", opens=False), "host": _fake("cpu")})
    assert optirs.get_backend("auto").name == "host"


def test_auto_with_nothing_available_lists_every_reason(fakes):
    fakes({"gpu": _fake("gpu", available=False), "host": _fake("cpu", available=False)})
    with pytest.raises(BackendUnavailableError, match="no backend could open: gpu: no fake gpu; host: no fake cpu"):
        optirs.get_backend("auto")


def test_auto_on_the_builtins_never_puts_an_opencl_cpu_device_over_cpu(fresh_registry):
    status = {s.name: s for s in optirs.list_backends()}
    opencl, cpu = status.get("opencl"), status.get("cpu")
    if not (opencl and opencl.available and cpu and cpu.available):
        pytest.skip("needs the opencl and cpu backends")
    if any(d.kind in ("gpu", "accelerator") for d in opencl.devices):
        pytest.skip("opencl has a GPU or accelerator here")
    cuda = status.get("cuda")
    if cuda is not None and cuda.available and any(d.kind == "gpu" for d in cuda.devices):
        pytest.skip("a CUDA GPU is here")
    assert optirs.get_backend("auto").name == "cpu"
    assert optirs.GpuAdam().backend.name == "cpu"
    text = str(registry.choose_auto())
    assert text.startswith("backend='auto' chooses cpu: opencl's only device is a CPU"), text


def test_optirs_info_says_what_auto_chooses(fresh_registry, monkeypatch, capsys):
    pytest.importorskip("rich")
    from optirs.tools import cli

    monkeypatch.setenv("COLUMNS", "4000")
    assert cli.main(["info"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    expected = registry.choose_auto()
    assert expected.name is not None
    assert f"backend='auto' chooses {expected.name}: " in out, out


# ---------------------------------------------------------------- unknown names at construction


@pytest.fixture
def no_probing(monkeypatch):
    calls = []
    real = REGISTRY.probe

    def probe(name, options=None):
        calls.append(name)
        return real(name, options)

    monkeypatch.setattr(REGISTRY, "probe", probe)
    return calls


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_unknown_backend_fails_at_construction(fresh_registry, no_probing, name):
    cls = OPTIMIZERS[name]
    with pytest.raises(BackendUnavailableError, match=r"unknown backend 'nope'; known backends: .*cpu"):
        cls(config=optirs.GpuOptimizerConfig(backend="nope"))
    assert no_probing == []


def test_analysis_plugin_is_not_a_backend_at_construction(fresh_registry, no_probing):
    with pytest.raises(BackendUnavailableError, match="'occupancy' is an analysis plugin, not a backend"):
        optirs.GpuAdam(config=optirs.GpuOptimizerConfig(backend="occupancy"))
    assert no_probing == []


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "opencl"])
def test_known_backend_names_construct_without_probing(fresh_registry, no_probing, name):
    opt = optirs.GpuAdam(config=optirs.GpuOptimizerConfig(backend=name))
    assert opt.step_count == 0
    assert no_probing == []


def test_a_plugin_registered_at_run_time_is_a_known_name(fresh_registry, no_probing):
    optirs.register_plugin(_fake("cpu"), "late")
    optirs.GpuAdam(config=optirs.GpuOptimizerConfig(backend="late"))
    assert no_probing == []
