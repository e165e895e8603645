"""A third-party optirs backend written as a plain module of hook functions, in numpy.

It steps SGD and Adam in float32 through the one step hook (optirs raises
UnsupportedOperationError for the rest) and, as pluggy allows, some hooks take only the
arguments they use.
"""

import numpy as np
from optirs.core.errors import UnsupportedOperationError
from optirs.plugin.hookspecs import DeviceInfo, ProbeResult, Staged, StepSupport, hookimpl

from optirs_numpy_backend.mixed_precision import (optirs_mixed_precision_describe, optirs_mixed_precision_narrow,
                                                  optirs_mixed_precision_unscale)
# The sparse capability's hooks, in their own module; importing them here registers them.
from .sparse import optirs_sparse_adam_step, optirs_sparse_sgd_step, optirs_sparse_stage  # noqa: F401


@hookimpl
def optirs_plugin_info():
    return {"summary": "numpy reference backend (third-party example)", "version": "0.1.0"}


@hookimpl
def optirs_probe(options):
    return ProbeResult(True, "", (DeviceInfo("numpy on the host", "cpu"),))


@hookimpl
def optirs_open(options):
    return {"steps": 0}


@hookimpl
def optirs_alloc(size, dtype, fill):
    return np.full(size, fill, dtype=dtype)


@hookimpl
def optirs_to_device(array):
    return np.array(array, copy=True).reshape(-1)


@hookimpl
def optirs_to_host(array):
    return np.array(array, copy=True)


@hookimpl
def optirs_stage(params, grads):
    # no ``fmt`` argument: this backend stages float32 steps only
    return Staged([p.reshape(-1) for p in params], [g.reshape(-1) for g in grads])


def _sgd(p, g, state, s, sc):
    if sc.weight_decay != 0:  # as torch: no decay term (and no 0 * inf) without decay
        g = g + sc.weight_decay * p
    if sc.has_momentum:
        buf = state["momentum_buffer"]
        buf[s] = g if sc.first_step else sc.momentum * buf[s] + sc.dampening_factor * g
        g = g + sc.momentum * buf[s] if sc.nesterov else buf[s]
    p -= sc.lr * g


def _adam(p, g, state, s, sc):
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if sc.weight_decay != 0:
        g = g + sc.weight_decay * p
    m[s] = sc.beta1 * m[s] + sc.one_minus_beta1 * g
    v[s] = sc.beta2 * v[s] + sc.one_minus_beta2 * g * g
    if sc.amsgrad:
        vmax = state["max_exp_avg_sq"]
        vmax[s] = np.maximum(vmax[s], v[s])
        denom = np.sqrt(vmax[s]) / sc.bias_correction2_sqrt + sc.eps
    else:
        denom = np.sqrt(v[s]) / sc.bias_correction2_sqrt + sc.eps
    p -= sc.step_size * m[s] / denom


# The one place the step is chosen: definition name -> element math (adamw would need decoupled decay).
STEPS = {"sgd": _sgd, "adam": _adam}


@hookimpl
def optirs_step_support():
    return StepSupport(optimizers=tuple(STEPS))  # float32 only: no step formats, no device-side scalars


@hookimpl
def optirs_step(ctx, request):
    name, controls = request.definition.name, request.controls
    if name not in STEPS or request.fmt is not None or controls.device is not None or controls.check_finite:
        what = ("a step format" if request.fmt is not None else "device-side scalars" if controls.device is not None
                else "check_finite" if controls.check_finite else "that optimizer")
        raise UnsupportedOperationError(f"the numpy example backend does not run {what} for {name!r}, expected a "
                                        f"float32 step of one of {sorted(STEPS)}")
    if controls.found_inf is not None and controls.found_inf.reshape(-1)[0] != 0:
        return  # the flag is one of our (host) arrays: set means write nothing
    ctx["steps"] += 1
    sc, layout = request.scalars, request.layout
    for p, g, o, n in zip(request.params, request.grads, layout.offsets, layout.sizes):
        # grad_factor (every record's last field) first: -1 maximizes, 1 / scale unscales
        STEPS[name](p, g * sc.grad_factor, request.state, slice(int(o), int(o + n)), sc)
