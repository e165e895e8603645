"""The cuda backend's kernels for the one step hook (:mod:`optirs.backends.common.steps` picks them).

Every elementwise optimizer is one launch of the generic step kernel of its family
(``kernels.STEP_FUNCTIONS``), with the definition's state slots as slots 0-2 and the found_inf
flag read on the device; LAMB runs its norm passes (``kernels.LAMB_FUNCTIONS``), Adafactor one
block per tensor (:mod:`optirs.backends.cuda.adafactor`), every step format the formats kernels
(:mod:`optirs.backends.cuda.formats`), and device-side scalars the capturable pair
(:mod:`optirs.backends.cuda.capturable`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from optirs.backends.cuda.context import CudaContext, device_address
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import InvalidParameterError
from optirs.core.formats import FORMAT_FAMILIES, STATE_DTYPES
from optirs.core.scalars import FORMULAS
from optirs.backends.common.steps import StepDispatch
from optirs.plugin.hookspecs import StepRequest, StepSupport

SUPPORT = StepSupport(optimizers=tuple(DEFINITIONS),
                      formats=tuple(n for n, d in DEFINITIONS.items() if d.kernel in FORMAT_FAMILIES),
                      capturable=tuple(n for n in DEFINITIONS if n in FORMULAS),
                      state_dtypes=STATE_DTYPES)


def flag_address(flag: Any) -> int:
    """The device address of a found_inf flag (0: none)."""
    if flag is None:
        return 0
    address = device_address(flag)
    if address is None:
        raise InvalidParameterError(f"found_inf is a {type(flag).__name__}, expected a 1-element int32 CUDA device "
                                    "array or None")
    return int(address)


class CudaSteps(StepDispatch):
    """The cuda backend's kernels for :class:`~optirs.backends.common.steps.StepDispatch`: the
    elementwise and format kernels read a found_inf flag on the device; LAMB's and Adafactor's
    passes read none, so theirs is read on the host first (one synchronisation)."""

    NAME = "cuda"
    SUPPORT = SUPPORT
    FLAG_ON_DEVICE = frozenset({"pointwise", "formats"})

    @staticmethod
    def _pointers(ctx: CudaContext, params: Any, grads: Any, layout: Any):
        paddr = getattr(params, "addresses", None)
        gaddr = getattr(grads, "addresses", None)
        if paddr is None or gaddr is None:  # called directly with device arrays
            paddr = tuple(device_address(a) for a in params)
            gaddr = tuple(device_address(a) for a in grads)
        return ctx.pointer_table(layout, paddr, gaddr)

    def _device_scalars_step(self, ctx, request: StepRequest) -> None:
        self._capturable_step(ctx, request.definition.name, request.params, request.grads, request.state,
                              request.layout, request.scalars, request.controls.device)

    def _pointwise(self, ctx, request: StepRequest) -> None:
        definition, params, grads, state, layout, scalars = (request.definition, request.params, request.grads,
                                                             request.state, request.layout, request.scalars)
        found_inf = request.controls.found_inf
        ptrs = self._pointers(ctx, params, grads, layout)
        # The same pointer table, state, flag and optimizer as the last step of this layout: its
        # prepared launch, with this step's scalars (the arguments are addresses that did not move).
        last = layout.cache.get("cuda.pointwise.last")
        if last is not None and last[1] is state and last[2] is found_inf and last[3] is definition:
            prepared = last[4]
            if last[0] is not ptrs:
                # another table of the same pointer tables (a new address set): the launch prepared
                # on it with the last one, whose other arguments are these
                family = prepared.family
                prepared = family.get(id(ptrs)) if family is not None else None
                if prepared is not None:
                    layout.cache["cuda.pointwise.last"] = (ptrs, state, found_inf, definition, prepared)
            if prepared is not None:
                prepared(scalars, ctx.stream, ctx.nstream)
                return
        flag = flag_address(found_inf)
        family = definition.kernel
        compiled, chunk, grid, block = ctx.plan(family, ctx.kernels.STEP_FUNCTIONS[family], "step", scalars, layout)
        chunks, nchunks = ctx.chunk_table(layout, chunk)
        addrs, used = [0, 0, 0], 0
        for k, slot in enumerate(definition.slot_names()):
            if slot in state:
                addrs[k] = device_address(state[slot])
                used |= 1 << k
        prepared = ctx.launch(compiled, (chunks, ptrs, nchunks, *addrs, used, 0, flag, scalars), grid, block)
        layout.cache["cuda.pointwise.last"] = (ptrs, state, found_inf, definition, prepared)

    def _lamb(self, ctx, request: StepRequest) -> None:
        params, grads, state, layout, scalars = (request.params, request.grads, request.state, request.layout,
                                                 request.scalars)
        ptrs = self._pointers(ctx, params, grads, layout)
        ntensors = len(layout)
        acc = layout.cache.get("cuda.lamb_acc")
        if acc is None:  # per-tensor sums, two alternating rows (see cuda_kernels)
            acc = layout.cache["cuda.lamb_acc"] = [ctx.upload(np.zeros((2, 2 * ntensors + 1))), 0]
        sums, q = acc
        m, v = device_address(state["exp_avg"]), device_address(state["exp_avg_sq"])
        fns = ctx.kernels.LAMB_FUNCTIONS
        passes = (("lamb_moments", "moments", "lamb", (m, v)), ("lamb_apply", "apply", "lamb", (m, v)))
        if scalars.max_grad_norm > 0:
            passes = (("lamb_grad_norm", "grad_norm", "grad_norm", ()),) + passes
        try:
            for name, fn, family, slots in passes:
                compiled, chunk, grid, block = ctx.plan(name, fns[fn], family, scalars, layout)
                chunks, nchunks = ctx.chunk_table(layout, chunk)
                ctx.launch(compiled, (chunks, ptrs, nchunks, *slots, sums, q, ntensors, scalars), grid, block)
        except Exception:
            acc[0] = ctx.upload(np.zeros((2, 2 * ntensors + 1)))  # start the sums clean
            acc[1] = 0
            raise
        acc[1] = 1 - q
