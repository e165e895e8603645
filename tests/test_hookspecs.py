"""A meta-test: every hook is documented, and every backend hook is implemented by a built-in backend."""

from __future__ import annotations

import inspect

import pytest

from optirs.plugin import hookspecs
from optirs.plugin.registry import REGISTRY

SPECS = [name for name, fn in vars(hookspecs).items() if name.startswith("optirs_") and callable(fn)]


@pytest.mark.parametrize("name", SPECS)
def test_hook_is_documented(name):
    fn = getattr(hookspecs, name)
    doc = inspect.getdoc(fn) or ""
    assert doc, f"{name} has no docstring"
    for arg in inspect.signature(fn).parameters:
        assert f":param {arg}:" in doc, f"{name} does not document {arg}"


@pytest.mark.parametrize("name", SPECS)
def test_hook_context_is_typed(name):
    """Backend hooks take the context first, typed as BackendContext (never Any)."""
    params = inspect.signature(getattr(hookspecs, name)).parameters
    if "ctx" in params:
        assert list(params)[0] == "ctx"
        assert params["ctx"].annotation in ("BackendContext", hookspecs.BackendContext), name


# The per-optimizer step hooks of earlier releases are for third parties only (adapted, deprecated).
LEGACY = set(hookspecs.LEGACY_STEP_HOOKS.values())


@pytest.mark.parametrize("name", [n for n in SPECS if n not in ("optirs_launch_config", "optirs_fusion_generate")
                                  and n not in LEGACY])
def test_backend_hook_is_implemented_by_cpu(name):
    assert getattr(REGISTRY.pm.hook, name).spec is not None
    assert REGISTRY.implementation("cpu", name) is not None, f"the cpu backend does not implement {name}"


@pytest.mark.parametrize("name", ["cpu", "cuda", "opencl"])
def test_builtin_backends_answer_the_one_step_hook_only(name):
    """A built-in backend answers optirs_step (and says what it runs), never a per-optimizer hook."""
    REGISTRY.pm
    if REGISTRY.records[name].broken:
        pytest.skip(f"backend {name} does not load here")
    assert REGISTRY.implementation(name, "optirs_step") is not None
    assert REGISTRY.implementation(name, "optirs_step_support") is not None
    assert not [h for h in LEGACY if REGISTRY.implementation(name, h) is not None]
