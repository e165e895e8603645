"""The opencl backend's kernels for the one step hook (:mod:`optirs.backends.common.steps` picks them).

Every elementwise optimizer runs the generic ``STEP_KERNELS`` of its family (``_elementwise``),
LAMB its norm passes (``_lamb``), Adafactor one work-group per tensor
(:mod:`optirs.backends.opencl.adafactor`), and every step format the formats kernels
(:mod:`optirs.backends.opencl.formats`), which read the found_inf flag on the device; the float32
kernels take no flag, so it is read here first.
"""

from __future__ import annotations

import numpy as np

from typing import Any, List, Sequence, Tuple

from optirs.backends.opencl.context import OpenclContext, _lamb_scratch, _layout_tables, _plan
from optirs.backends.opencl.slots import deal, resident_groups
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import InvalidParameterError
from optirs.core.formats import FORMAT_FAMILIES, STATE_DTYPES
from optirs.backends.common.steps import StepDispatch
from optirs.plugin.hookspecs import StepRequest, StepSupport

# Work-items per compute unit of a chunked launch's grid (slots.RESIDENT unless set).
RESIDENT_VARIABLE = "OPTIRS_OPENCL_RESIDENT"

SUPPORT = StepSupport(optimizers=tuple(DEFINITIONS),
                      formats=tuple(n for n, d in DEFINITIONS.items() if d.kernel in FORMAT_FAMILIES),
                      state_dtypes=STATE_DTYPES)


def _state_base(ctx: OpenclContext, arrays: Sequence[Any]) -> Tuple[List[Any], int]:
    """The state slots' buffers (the dummy for unused ones) and their common element offset."""
    bufs, offsets = [], set()
    for a in arrays:
        if a is None:
            bufs.append(ctx.dummy)
        else:
            bufs.append(a.base_data if a.size else ctx.dummy)
            offsets.add(a.offset // 4)
    if len(offsets) > 1:
        raise InvalidParameterError(f"state buffers start at element offsets {sorted(offsets)}, expected one common offset")
    return bufs, (offsets.pop() if offsets else 0)


def _elementwise(ctx: OpenclContext, family: str, params, grads, state_arrays, layout, scalars) -> None:
    n = layout.total
    if n == 0:
        return
    rec = np.array(tuple(scalars), ctx.records[family])
    s_bufs, s_off = _state_base(ctx, state_arrays)
    wg, cl = ctx.work_group, ctx.cl
    with ctx.lock:
        try:
            plan = _plan(ctx, params, grads, layout, s_off, chunked=False)
            if plan.flat is not None:
                ph, p_off, gh, g_off = plan.flat
                if p_off % 4 == 0 and g_off % 4 == 0 and s_off % 4 == 0:
                    kernel, items = ctx.kernels[family + "_flat4"], n // 4 + (1 if n % 4 else 0)
                else:
                    kernel, items = ctx.kernels[family + "_flat1"], n
                gsize = (items + wg - 1) // wg * wg
                kernel(ctx.queue, (gsize,), (wg,), params[ph].base_data, p_off, grads[gh].base_data, g_off,
                       *s_bufs, s_off, n, rec)
                return
            tables = _layout_tables(ctx, layout)
            kernel, most = ctx.kernels[family + "_chunks"], resident_groups(ctx, wg, RESIDENT_VARIABLE)
            for grp in plan.groups:
                nchunks = grp.chunk_end - grp.chunk_begin
                deal(ctx, kernel, wg, [*grp.buffers(ctx, params, grads), *s_bufs, plan.tens, plan.info,
                                       tables.chunk_tensor, tables.chunk_start, grp.chunk_begin, nchunks],
                     nchunks, [rec], most)
        except cl.Error as exc:
            raise ctx.translate(exc, f"running the {family} step over {n} elements") from exc


def _lamb(ctx: OpenclContext, params, grads, m, v, layout, scalars) -> None:
    n = layout.total
    if n == 0:
        return
    rec = np.array(tuple(scalars), ctx.records["lamb"])
    (mb, vb), s_off = _state_base(ctx, (m, v))
    wg, cl, q, k = ctx.work_group, ctx.cl, ctx.queue, ctx.kernels
    clip = bool(scalars.max_grad_norm > 0)
    with ctx.lock:
        try:
            tables = _layout_tables(ctx, layout)
            plan = _plan(ctx, params, grads, layout, s_off, chunked=True)
            partial_g, partial_pu, scale, ratio = _lamb_scratch(ctx, layout, tables)
            most = resident_groups(ctx, wg, RESIDENT_VARIABLE)
            chunk_args = (plan.tens, plan.info, tables.chunk_tensor, tables.chunk_start)

            def each_group(name: str, state: Sequence[Any], tail: Sequence[Any]) -> None:
                for grp in plan.groups:
                    nchunks = grp.chunk_end - grp.chunk_begin
                    deal(ctx, k[name], wg, [*grp.buffers(ctx, params, grads), *state, *chunk_args, grp.chunk_begin,
                                            nchunks], nchunks, tail, most)

            if clip:
                each_group("lamb_grad_sumsq", (), (partial_g,))
                k["lamb_grad_scale"](q, (wg,), (wg,), partial_g, tables.total_chunks, scalars.max_grad_norm,
                                     scalars.grad_factor, scale)
            each_group("lamb_moments", (mb, vb), (scale, int(clip), partial_pu, rec))
            k["lamb_trust_ratios"](q, (len(layout) * wg,), (wg,), partial_pu, tables.first_chunk, tables.nchunks,
                                   scalars.max_trust_ratio, ratio)
            each_group("lamb_apply", (mb, vb), (ratio, rec))
        except cl.Error as exc:
            raise ctx.translate(exc, f"running the lamb step over {n} elements") from exc


class OpenclSteps(StepDispatch):
    """The opencl backend's kernels for :class:`~optirs.backends.common.steps.StepDispatch`: the
    format kernels read a found_inf flag on the device; the float32 kernels take none, so theirs is
    read on the host first."""

    NAME = "opencl"
    SUPPORT = SUPPORT
    FLAG_ON_DEVICE = frozenset({"formats"})

    def _pointwise(self, ctx, request: StepRequest) -> None:
        names = request.definition.slot_names()
        slots = tuple(request.state.get(names[k]) if k < len(names) else None for k in range(3))
        _elementwise(ctx, request.definition.kernel, request.params, request.grads, slots, request.layout,
                     request.scalars)

    def _lamb(self, ctx, request: StepRequest) -> None:
        state = request.state
        _lamb(ctx, request.params, request.grads, state["exp_avg"], state["exp_avg_sq"], request.layout,
              request.scalars)
