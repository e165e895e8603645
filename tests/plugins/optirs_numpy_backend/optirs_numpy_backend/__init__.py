"""A third-party optirs backend written as a plain module of hook functions, in numpy.

It implements only the SGD and Adam steps (optirs raises UnsupportedOperationError for the
rest) and, as pluggy allows, some hooks take only the arguments they use.
"""

import numpy as np
from optirs.plugin.hookspecs import DeviceInfo, ProbeResult, Staged, hookimpl

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
    return Staged([p.reshape(-1) for p in params], [g.reshape(-1) for g in grads])


def _slices(layout):
    return [slice(int(o), int(o + n)) for o, n in zip(layout.offsets, layout.sizes)]


@hookimpl
def optirs_step_sgd(ctx, params, grads, state, layout, scalars):
    ctx["steps"] += 1
    for p, g, s in zip(params, grads, _slices(layout)):
        g = g * scalars.grad_factor  # every record's last field: maximize / unscale (1 from the seed API)
        if scalars.weight_decay != 0:  # as torch: no decay term (and no 0 * inf) without decay
            g = g + scalars.weight_decay * p
        if scalars.has_momentum:
            buf = state["momentum_buffer"]
            buf[s] = g if scalars.first_step else scalars.momentum * buf[s] + scalars.dampening_factor * g
            g = g + scalars.momentum * buf[s] if scalars.nesterov else buf[s]
        p -= scalars.lr * g


@hookimpl
def optirs_step_adam(params, grads, state, layout, scalars):
    m, v = state["exp_avg"], state["exp_avg_sq"]
    for p, g, s in zip(params, grads, _slices(layout)):
        g = g * scalars.grad_factor  # every record's last field: maximize / unscale (1 from the seed API)
        if scalars.weight_decay != 0:  # as torch: no decay term (and no 0 * inf) without decay
            g = g + scalars.weight_decay * p
        m[s] = scalars.beta1 * m[s] + scalars.one_minus_beta1 * g
        v[s] = scalars.beta2 * v[s] + scalars.one_minus_beta2 * g * g
        if scalars.amsgrad:
            vmax = state["max_exp_avg_sq"]
            vmax[s] = np.maximum(vmax[s], v[s])
            denom = np.sqrt(vmax[s]) / scalars.bias_correction2_sqrt + scalars.eps
        else:
            denom = np.sqrt(v[s]) / scalars.bias_correction2_sqrt + scalars.eps
        p -= scalars.step_size * m[s] / denom
