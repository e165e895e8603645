"""The conformance kit (optirs.testing): it passes on the numpy example backend, the minimal
backend of docs/plugins.md and the built-in cpu backend, each check catches the bug it is there
for (broken variants of the minimal backend), and its pytest plugin runs it for a third party."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import optirs
from optirs.core.definitions import DEFINITIONS
from optirs.plugin.hookspecs import hookimpl
from optirs.testing import CHECKS, check, check_backend

from conftest import THIRD_PARTY_BACKEND, register_third_party_backend

EXAMPLES = Path(__file__).parent.parent / "examples"

# The checks each backend skips, and only those: an optional part it does not list, or the
# unsupported-optimizer check of a backend that runs every optimizer.
EXPECTED_SKIPS = {
    THIRD_PARTY_BACKEND: {"formats", "device_scalars"},
    "tiny": {"formats", "device_scalars"},
    "cpu": {"unsupported_optimizer", "device_scalars"},
}


@pytest.fixture
def minimal_backend(fresh_registry, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import minimal_backend

    return minimal_backend


@pytest.fixture
def conformance_backend(request, fresh_registry, minimal_backend):
    name = request.param
    if name == "tiny":
        optirs.register_plugin(minimal_backend.TinyBackend(), "tiny")
    elif name == THIRD_PARTY_BACKEND:
        register_third_party_backend()
    elif not {s.name: s for s in optirs.list_backends()}[name].available:
        pytest.skip(f"backend {name} cannot open here")
    return name


@pytest.mark.parametrize("what", list(CHECKS))
@pytest.mark.parametrize("conformance_backend",
                         [THIRD_PARTY_BACKEND, "tiny", pytest.param("cpu", marks=pytest.mark.cpu)], indirect=True)
def test_backend_passes_the_kit(conformance_backend, what):
    reason = check(conformance_backend, what)
    skipped = EXPECTED_SKIPS[conformance_backend]
    assert (reason is not None) == (what in skipped), (f"{what}: {reason or 'ran'}, expected it to "
                                                       f"{'skip' if what in skipped else 'run'}")
    if reason is not None:
        assert repr(conformance_backend) in reason
        pytest.skip(reason)


# ---------------------------------------------------------------- each check fails the backend it is there for


def _variants(mb):
    """Broken minimal backends: name -> (class, the check that must fail, words of its message)."""

    class IgnoresGradFactor(mb.TinyBackend):
        @hookimpl
        def optirs_step(self, ctx, request):
            super().optirs_step(ctx, request._replace(scalars=request.scalars._replace(grad_factor=np.float32(1))))

    class IgnoresFoundInf(mb.TinyBackend):
        @hookimpl
        def optirs_step(self, ctx, request):
            super().optirs_step(ctx, request._replace(controls=request.controls._replace(found_inf=None)))

    class DropsNesterov(mb.TinyBackend):
        @hookimpl
        def optirs_step(self, ctx, request):
            super().optirs_step(ctx, request._replace(scalars=request.scalars._replace(nesterov=False)))

    class StepsAnyName(mb.TinyBackend):  # never looks at the definition it was asked for
        @hookimpl
        def optirs_step(self, ctx, request):
            super().optirs_step(ctx, request._replace(definition=DEFINITIONS["sgd"]))

    class WritesBeforeRefusing(mb.TinyBackend):
        @hookimpl
        def optirs_step(self, ctx, request):
            if request.controls.device is not None:
                request.params[0][...] = 0
            super().optirs_step(ctx, request)

    class KeepsStateElsewhere(mb.TinyBackend):  # its own momentum per layout: a loaded checkpoint is ignored
        @hookimpl
        def optirs_step(self, ctx, request):
            mine = request.layout.cache.setdefault("tiny.state",
                                                   {k: np.zeros_like(v) for k, v in request.state.items()})
            super().optirs_step(ctx, request._replace(state=mine))
            for k, v in mine.items():
                request.state[k][...] = v

    return {
        "ignores_grad_factor": (IgnoresGradFactor, "grad_factor", "sgd with grad_factor=-1.0 (maximize)"),
        "ignores_found_inf": (IgnoresFoundInf, "found_inf", "after optirs_step with a set found_inf flag"),
        "drops_nesterov": (DropsNesterov, "steps", "nesterov=True"),
        "steps_any_name": (StepsAnyName, "unsupported_optimizer", "a float32 adam request (not listed) raised "
                                                                 "AttributeError"),
        "writes_before_refusing": (WritesBeforeRefusing, "failed_step", "after a refused device-side scalars"),
        "keeps_state_elsewhere": (KeepsStateElsewhere, "resume", "resumed from state_dict()"),
    }


@pytest.mark.parametrize("variant", ["ignores_grad_factor", "ignores_found_inf", "drops_nesterov", "steps_any_name",
                                     "writes_before_refusing", "keeps_state_elsewhere"])
def test_each_check_catches_its_bug(minimal_backend, variant):
    cls, failing, words = _variants(minimal_backend)[variant]
    optirs.register_plugin(cls(), variant)
    with pytest.raises(AssertionError) as info:
        check(variant, failing)
    message = str(info.value)
    assert message.startswith(f"backend {variant!r} fails the {failing!r} check: ") and words in message, message


def test_check_backend_reports_every_check(minimal_backend):
    optirs.register_plugin(minimal_backend.TinyBackend(), "tiny")
    report = check_backend("tiny", optimizers=["sgd", "adam"])
    assert list(report) == list(CHECKS)
    assert {k for k, v in report.items() if v.startswith("skipped: ")} == EXPECTED_SKIPS["tiny"]
    assert {v for k, v in report.items() if k not in EXPECTED_SKIPS["tiny"]} == {"passed"}
    with pytest.raises(AssertionError, match=r"backend 'nope' does not open: unknown backend 'nope'"):
        check_backend("nope")
    with pytest.raises(AssertionError, match=r"names \['adamm'\], expected optimizer definitions"):
        check("tiny", "steps", optimizers=["adamm"])


def test_pytest_plugin_runs_the_kit_for_a_third_party(tmp_path):
    """``-p optirs.testing.pytest_plugin --optirs-backend=NAME`` in a project that registers its
    backend in conftest.py: one test per check, a failure naming the check and the optimizer."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(EXAMPLES)!r})
        import numpy as np
        import minimal_backend
        import optirs
        from optirs.plugin.hookspecs import hookimpl

        class IgnoresGradFactor(minimal_backend.TinyBackend):
            @hookimpl
            def optirs_step(self, ctx, request):
                sc = request.scalars._replace(grad_factor=np.float32(1))
                super().optirs_step(ctx, request._replace(scalars=sc))

        optirs.register_plugin(minimal_backend.TinyBackend(), "tiny")
        optirs.register_plugin(IgnoresGradFactor(), "broken")
    """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "optirs.testing.pytest_plugin", "--optirs-backend=tiny",
                          "--optirs-backend=broken", "-p", "no:cacheprovider", "-rfs"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed, 11 passed, 4 skipped" in out.stdout, out.stdout
    assert "FAILED optirs-conformance/broken::grad_factor" in out.stdout
    assert "backend 'broken' fails the 'grad_factor' check: sgd with grad_factor=-1.0 (maximize)" in out.stdout
    assert "backend 'tiny' lists no step formats" in out.stdout
