"""A complete optirs backend in numpy: the device hooks and the SGD step (docs/plugins.md).

Run it to register the backend under the name "tiny" and train with it:

    python examples/minimal_backend.py
"""

from __future__ import annotations

import argparse

import numpy as np

import optirs
from optirs.plugin.hookspecs import DeviceInfo, ProbeResult, Staged, StepRequest, StepSupport, hookimpl


class TinyContext:
    """What optirs_open returns: here, only a step counter."""

    def __init__(self) -> None:
        self.steps = 0


class TinyBackend:
    """Host memory is the device; numpy does the math."""

    @hookimpl
    def optirs_plugin_info(self):
        return {"summary": "numpy SGD (the docs/plugins.md example)"}

    @hookimpl
    def optirs_probe(self, options):
        return ProbeResult(True, "", (DeviceInfo("numpy on the host", "cpu"),))

    @hookimpl
    def optirs_open(self, options):
        return TinyContext()

    @hookimpl
    def optirs_alloc(self, ctx, size, dtype, fill):
        return np.full(size, fill, dtype=dtype)

    @hookimpl
    def optirs_to_device(self, ctx, array):
        return np.array(array, copy=True).reshape(-1)

    @hookimpl
    def optirs_to_host(self, ctx, array):
        return np.array(array, copy=True)

    @hookimpl
    def optirs_stage(self, ctx, params, grads):
        # numpy arrays are already "on the device": flat views, updated in place
        return Staged([p.reshape(-1) for p in params], [g.reshape(-1) for g in grads])

    @hookimpl
    def optirs_step_support(self):
        return StepSupport(optimizers=("sgd",))  # float32 only: no step formats, no device-side scalars

    @hookimpl
    def optirs_step(self, ctx, request: StepRequest):
        controls, sc, layout = request.controls, request.scalars, request.layout
        if request.definition.name != "sgd" or request.fmt or controls.device or controls.check_finite:
            raise optirs.UnsupportedOperationError(f"the tiny backend runs float32 SGD only, not this "
                                                   f"{request.definition.name!r} step")
        if controls.found_inf is not None and controls.found_inf[0] != 0:
            return  # a loss scaler saw inf/NaN gradients: write nothing
        ctx.steps += 1
        for p, g, start, size in zip(request.params, request.grads, layout.offsets, layout.sizes):
            g = g * sc.grad_factor  # first: -1 maximizes, 1 / scale unscales
            if sc.weight_decay != 0:  # as torch: no decay term (no 0 * inf) without decay
                g = g + sc.weight_decay * p
            if sc.has_momentum:  # the state buffer holds every tensor, each at its layout offset
                buf = request.state["momentum_buffer"][start : start + size]
                buf[...] = g if sc.first_step else sc.momentum * buf + sc.dampening_factor * g
                g = g + sc.momentum * buf if sc.nesterov else buf
            p -= sc.lr * g


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    optirs.register_plugin(TinyBackend(), "tiny")
    rng = np.random.default_rng(0)
    params = [rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal(5).astype(np.float32)]
    hp = optirs.SgdParams(lr=0.1, momentum=0.9, nesterov=True)
    opt = optirs.GpuSgd(hp, optirs.GpuOptimizerConfig(backend="tiny"))
    for _ in range(3):
        opt.step_gpu(params, [2 * p for p in params])  # the gradient of sum(p^2)
    print("tiny backend, 3 SGD steps: |p| =", round(float(sum(np.abs(p).sum() for p in params)), 4))
    try:
        optirs.GpuAdam(config=optirs.GpuOptimizerConfig(backend="tiny")).step_gpu(params, [2 * p for p in params])
    except optirs.UnsupportedOperationError as exc:
        print("as expected:", exc)


if __name__ == "__main__":
    main()
